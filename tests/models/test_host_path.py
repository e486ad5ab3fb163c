"""A patched model's decode step does its per-call Python once, not per step: counted, never timed
(``docs/notes/host-overhead.md``, ``bench/host_overhead.py``)."""
from __future__ import annotations

import importlib
from unittest import mock

import pytest
import torch
from torch._library.custom_ops import CustomOpDef
from torch.utils._python_dispatch import TorchDispatchMode

from codagen.backends import get_backend, use_backend
from codagen.models import patch

from .conftest import build, triton_backend_missing

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402  (after the importorskip)

bind_module = importlib.import_module("codagen.epilogue.bind")  # the module (the package exports its function)


def _decode_steps(model, steps: int, on_step=None):
    """Prefill 4 tokens, then ``steps`` decode steps under no_grad; ``on_step()`` after each."""
    ids = torch.randint(0, model.config.vocab_size, (1, 4))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
            if on_step is not None:
                on_step()


class _CountCodagenOps:
    """Counts the calls of ``codagen::`` custom ops that go through the dispatcher."""

    def __init__(self):
        self.calls = 0
        self.original = CustomOpDef.__call__

    def __enter__(self):
        counter = self

        def counting(op, *args, **kwargs):
            counter.calls += op._namespace == "codagen"
            return counter.original(op, *args, **kwargs)
        self.patcher = mock.patch.object(CustomOpDef, "__call__", counting)
        self.patcher.__enter__()
        return self

    def __exit__(self, *exc):
        self.patcher.__exit__(*exc)


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_eager_decode_calls_the_custom_ops_implementations_directly():
    model = patch(build("llama")).eval()
    with use_backend("reference"), _CountCodagenOps() as counter:
        _decode_steps(model, 2)
    assert counter.calls == 0
    # under a dispatch mode (a tracer, a recorder) every op goes through the dispatcher
    with use_backend("reference"), _CountCodagenOps() as counter, _PassThrough():
        _decode_steps(model, 1)
    assert counter.calls > 0


def test_decode_steps_bind_without_repeating_the_checks():
    model = patch(build("llama")).eval()
    counts = []
    with use_backend("reference"):
        _decode_steps(model, 4, on_step=lambda: counts.append(bind_module.validations()))
    assert counts[1] == counts[0] and counts[3] == counts[0], counts
    # the checks still run on a new signature, and still raise
    with pytest.raises(ValueError, match="inner dimensions differ"):
        bind_module.bind(bind_module.library.linear(), torch.randn(3, 5), torch.randn(4, 6), {})


def test_decode_steps_walk_the_modules_only_after_a_registration():
    """The walk that checks hooks, adapters and structure and keys the kept fused weights is kept while nothing is
    registered (codagen.models.module_changes): no walk per decode step, whatever the depth; a buffer registered
    (or a hook added) anywhere gives one walk at the next step, and a hook added on a submodule is refused there."""
    model = patch(build("llama", num_hidden_layers=3)).eval()
    walks = []
    named_modules = type(model).named_modules

    def counting(self, *args, **kwargs):
        if self is model:
            walks.append(1)
        return named_modules(self, *args, **kwargs)
    counts = []
    with use_backend("reference"), mock.patch.object(type(model), "named_modules", counting):
        _decode_steps(model, 3, on_step=lambda: counts.append(len(walks)))
        assert [b - a for a, b in zip(counts, counts[1:])] == [0, 0], counts
        torch.nn.Linear(2, 2)  # a registration elsewhere in the process: the next forward (a prefill) walks, once
        _decode_steps(model, 2, on_step=lambda: counts.append(len(walks)))
        assert counts[3:] == [counts[2] + 1] * 2, counts
        model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
        with pytest.raises(NotImplementedError, match="forward hooks on submodule 'model.layers.1.mlp'"):
            _decode_steps(model, 1)


@pytest.mark.skipif(triton_backend_missing() is not None, reason=str(triton_backend_missing()))
def test_triton_decode_steps_plan_once():
    """The Triton backend (interpreter on CPU) plans each call signature at the first step only."""
    model = patch(build("llama", num_hidden_layers=1)).eval()
    backend = get_backend("triton")
    counts = []
    with use_backend("triton"):
        _decode_steps(model, 2, on_step=lambda: counts.append((backend.plans_made, bind_module.validations())))
    assert counts[1] == counts[0], counts


def test_the_registration_counter_guards_no_compiled_graph():
    """transformers' decoders slice their ModuleList in forward, which registers modules while Dynamo traces: the
    counter of codagen.models.module_changes must not enter the graph's guards (a recompile per call)."""
    import codagen.models.module_changes  # noqa: F401  (installed, as by any codagen import)
    model = build("llama")
    compiled = torch.compile(model, backend="eager")
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):  # monkeypatch's undo would delete the setting
        for _ in range(3):
            compiled(input_ids=ids)
