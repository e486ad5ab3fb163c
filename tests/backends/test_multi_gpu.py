"""Kernels launch on their tensors' device, whichever CUDA device is current (GPU, two or more).

Triton launches on the current device; codagen makes the tensors' device current for each launch
(:func:`codagen.backends.on_device`). Without that, tensors on ``cuda:1`` with ``cuda:0`` current
fault or read the wrong memory (Hugging Face ``device_map="auto"`` places layers that way).
"""
from __future__ import annotations

import pytest
import torch

from codagen.backends.triton import TritonBackend
from codagen.epilogue import library
from codagen.ops import kernels


def _need_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["residual_rms_stats", "swiglu_backward", "rms_lm_head_cross_entropy"])
def test_gpu_fused_program_on_the_second_device(check, name):
    _need_two_gpus()
    with torch.cuda.device(0):
        outs = check(library.PROGRAMS[name](), 1000, 2048, 512, torch.bfloat16, device="cuda:1",
                     backend=TritonBackend(autotune=False))
        assert all(t.device == torch.device("cuda:1") for t in outs.values())
        assert torch.cuda.current_device() == 0


@pytest.mark.gpu
def test_gpu_row_kernel_on_the_second_device():
    _need_two_gpus()
    x = torch.randn(300, 1024, device="cuda:1", dtype=torch.bfloat16)
    weight = torch.rand(1024, device="cuda:1", dtype=torch.bfloat16) + 0.5
    with torch.cuda.device(0):
        normed, rstd = kernels.rms_norm_stats_triton(x, weight, 1e-6)
        torch.cuda.synchronize(1)
    ref_normed, ref_rstd = kernels.rms_norm_stats_ref(x, weight, 1e-6)
    torch.testing.assert_close(rstd, ref_rstd, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(normed.float(), ref_normed.float(), rtol=2e-2, atol=2e-2)
