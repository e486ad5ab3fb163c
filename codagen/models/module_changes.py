"""A counter of the changes that can alter a module tree, so that a patched model's forward re-walks its modules only
after one.

A patched forward checks the model's structure (projections swapped, biases added), its hooks and its PEFT modules
before it computes (:mod:`.hf`). Walking ``named_modules()`` and reading every module for that costs about a
microsecond per module: 1 ms per forward at 16 layers, as much as a decode step's GPU time at small widths. What
those checks read changes only when

- a module, parameter or buffer is registered anywhere (assigned as an attribute, ``register_*``, PEFT wrapping a
  projection): counted by torch's global registration hooks, installed on import;
- a hook is registered anywhere (forward, backward, state-dict hooks: each makes a ``RemovableHandle``, whose class
  numbers them);

or through a plain attribute (a norm's ``variance_epsilon``, ``head_dim``, a config field), which the forward reads
again every time. :func:`version` is both counters: equal versions mean no module, parameter, buffer or hook was added
or replaced in between (a removed hook only refuses less). Assigning a tensor to an existing buffer's name, or a
``.data`` of another shape to a parameter, is not counted.
"""
from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["version"]

_registrations = 0


def _count(*_args) -> None:  # returns None: the registration proceeds unchanged
    # Not while Dynamo traces: reading the counter there would guard the graph on its value (a recompile per call
    # of a compiled model whose forward slices a ModuleList, as transformers' decoders do); what a traced forward
    # registers exists at trace time only
    if torch.compiler.is_compiling():
        return
    global _registrations
    _registrations += 1


for _register in (torch.nn.modules.module.register_module_module_registration_hook,
                  torch.nn.modules.module.register_module_parameter_registration_hook,
                  torch.nn.modules.module.register_module_buffer_registration_hook):
    _register(_count)


def version() -> tuple[int, int]:
    """``(registrations, hook handles)`` so far in this process: see the module docstring."""
    return _registrations, RemovableHandle.next_id
