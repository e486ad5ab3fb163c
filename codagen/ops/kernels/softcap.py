"""The backward of a logit soft-cap (Gemma 2's ``final_logit_softcapping``), with the RMSNorm backward's row statistic.

``out = cap * t`` with ``t = tanh(z / cap)``; ``grad_z = grad_out * (1 - t^2)``; ``mean_z_dz[m] = sum_k z grad_z
/ width``. One program per row. ``tanh`` is the epilogues' (``Unary("tanh")``): ``2 sigmoid(2x) - 1`` with the
device sigmoid, so a row kernel differentiates the function the forward GEMM's epilogue computes, formula for
formula.
"""
from __future__ import annotations

import torch

from .._checks import stats_dtype
from ._launch import dispatcher, launch_kernel, launcher, portable_math, row_block, sigmoid, tl, triton

__all__ = ["softcap_backward", "softcap_backward_ref", "softcap_backward_triton", "softcap_tanh"]


@triton.jit
def softcap_tanh(z, inv_softcap, PORTABLE: tl.constexpr):
    """``tanh(z / cap)`` on fp32, as ``2 sigmoid(2 z / cap) - 1`` (the epilogues' ``tanh``)."""
    return 2.0 * sigmoid(2.0 * (z * inv_softcap), PORTABLE) - 1.0


@triton.jit
def _softcap_backward_kernel(grad_ptr, z_ptr, grad_z_ptr, mean_z_dz_ptr, n_cols, inv_softcap, inv_width,
                             BLOCK: tl.constexpr, PORTABLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_dz = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dy = tl.load(grad_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        t = softcap_tanh(z, inv_softcap, PORTABLE)
        dz = dy * (1.0 - t * t)
        z_dz += z * dz
        tl.store(grad_z_ptr + row * n_cols + cols, dz.to(grad_z_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_z_dz_ptr + row, tl.sum(z_dz, axis=0) * inv_width)


def softcap_backward_ref(grad_out: torch.Tensor, z: torch.Tensor, softcap: float,
                         width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_z, mean_z_dz)`` of ``out = softcap * tanh(z / softcap)``: ``grad_z = grad_out * (1 - tanh(z /
    softcap)^2)`` in ``grad_out``'s dtype, ``mean_z_dz[m] = sum_k z grad_z / width`` (fp32; fp64 for fp64)."""
    cd = stats_dtype(grad_out.dtype)
    z_c = z.to(cd)
    t = torch.tanh(z_c / softcap)
    grad_z = grad_out.to(cd) * (1 - t * t)
    return grad_z.to(grad_out.dtype), (z_c * grad_z).sum(dim=-1) / width


@launcher
def softcap_backward_triton(grad_out: torch.Tensor, z: torch.Tensor, softcap: float,
                            width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`softcap_backward_ref` as one kernel launch (fp16/bf16/fp32; contiguous tensors)."""
    m, n = grad_out.shape
    grad_z = torch.empty_like(grad_out)
    mean_z_dz = torch.empty(m, dtype=torch.float32, device=grad_out.device)
    if m:
        launch_kernel(_softcap_backward_kernel, (m,), grad_out, z, grad_z, mean_z_dz, n, 1.0 / softcap, 1.0 / width,
                      BLOCK=row_block(n), PORTABLE=portable_math())
    return grad_z, mean_z_dz


softcap_backward = dispatcher(softcap_backward_ref, softcap_backward_triton)
