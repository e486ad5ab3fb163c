"""Which CUDA device a launch runs on, and what it is."""
from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["on_device", "capability"]


def on_device(device: torch.device):
    """Make ``device`` the current CUDA device for a kernel launch: Triton launches on the current
    device, not on its tensors' (tensors on ``cuda:1`` while ``cuda:0`` is current would fault). A no-op
    context when it already is current, or for CPU tensors."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


@functools.cache
def _capability_index(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of CUDA ``device``, read once per GPU (launchers ask it every call)."""
    return _capability_index(device.index if device.index is not None else torch.cuda.current_device())
