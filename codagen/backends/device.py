"""Which CUDA device a launch runs on."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["on_device"]


def on_device(device: torch.device):
    """Make ``device`` the current CUDA device for a kernel launch: Triton launches on the current
    device, not on its tensors' (tensors on ``cuda:1`` while ``cuda:0`` is current would fault). A no-op
    context when it already is current, or for CPU tensors."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
