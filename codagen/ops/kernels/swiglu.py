"""The gated activation's backward of the standalone gate/up op, with the RMSNorm backward's row statistic.

``act[m, j] = f(g) u`` with ``(g, u) = preact[m, 2j:2j+2]`` and ``f`` the activation: ``"silu"`` (SwiGLU),
``dg = dy u sigmoid(g) (1 + g (1 - sigmoid(g)))``, ``du = dy silu(g)``; ``"gelu_tanh"`` (GeGLU), with
``s = sigmoid(a)``, ``a = 2 sqrt(2/pi) (g + 0.044715 g^3)``, ``dg = dy u (s + g s (1 - s) a'(g))``,
``du = dy gelu_tanh(g) = dy g s``. Both written interleaved like ``preact``; ``mean_z_dz[m] = sum_j (g dg + u du) /
width``. One program per row. (The fused MLP op does this in the down-projection's input-gradient epilogue.)
"""
from __future__ import annotations

import torch

from codagen.backends import reference

from .._checks import stats_dtype
from ._launch import dispatcher, launch_kernel, launcher, portable_math, row_block, sigmoid, tl, triton

__all__ = ["swiglu_backward", "swiglu_backward_ref", "swiglu_backward_triton"]

#: activation -> the pair map's backward on the whole tensor
_BACKWARD_REFS = {"silu": reference.swiglu_backward_ref, "gelu_tanh": reference.geglu_backward_ref}


def _checked(activation: str) -> str:
    if activation not in _BACKWARD_REFS:
        raise ValueError(f"activation: expected one of {tuple(_BACKWARD_REFS)}, got {activation!r}")
    return activation


@triton.jit
def _swiglu_backward_kernel(grad_ptr, preact_ptr, grad_preact_ptr, mean_z_dz_ptr, n_out, inv_width,
                            BLOCK: tl.constexpr, GELU_TANH: tl.constexpr, PORTABLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_dz = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_out, BLOCK):
        j = start + tl.arange(0, BLOCK)
        mask = j < n_out
        dy = tl.load(grad_ptr + row * n_out + j, mask=mask, other=0.0).to(tl.float32)
        gate_at, up_at = row * 2 * n_out + 2 * j, row * 2 * n_out + 2 * j + 1
        gate = tl.load(preact_ptr + gate_at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(preact_ptr + up_at, mask=mask, other=0.0).to(tl.float32)
        if GELU_TANH:
            # a = g (2 sqrt(2/pi) + 2 sqrt(2/pi) 0.044715 g^2), a' = 2 sqrt(2/pi) + 3 (2 sqrt(2/pi) 0.044715) g^2
            sig = sigmoid(gate * (1.5957691216057308 + 0.07135481627260025 * gate * gate), PORTABLE)
            d_gelu = sig + sig * (1.0 - sig) * gate * (1.5957691216057308 + 0.21406444881780073 * gate * gate)
            d_gate = dy * up * d_gelu
        else:
            sig = sigmoid(gate, PORTABLE)
            d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
        d_up = dy * gate * sig  # silu(g) and gelu_tanh(g) are both g times their sigmoid
        z_dz += gate * d_gate + up * d_up
        out_ty = grad_preact_ptr.dtype.element_ty
        tl.store(grad_preact_ptr + gate_at, d_gate.to(out_ty), mask=mask)
        tl.store(grad_preact_ptr + up_at, d_up.to(out_ty), mask=mask)
    tl.store(mean_z_dz_ptr + row, tl.sum(z_dz, axis=0) * inv_width)


def swiglu_backward_ref(grad_act: torch.Tensor, preact: torch.Tensor, width: int,
                        activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved ``(dg, du)`` of ``act = f(g) * u`` (``f`` = silu or, for ``activation="gelu_tanh"``, the tanh
    approximation of GELU) and ``mean_z_dz[m] = sum_j (g dg + u du) / width``."""
    cd = stats_dtype(grad_act.dtype)
    preact_c = preact.to(cd)
    grad_preact = _BACKWARD_REFS[_checked(activation)](preact_c, grad_act.to(cd))
    return grad_preact.to(grad_act.dtype), (preact_c * grad_preact).sum(dim=-1) / width


@launcher
def swiglu_backward_triton(grad_act: torch.Tensor, preact: torch.Tensor, width: int,
                           activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`swiglu_backward_ref` as one kernel launch (fp16/bf16/fp32)."""
    _checked(activation)
    m, f = grad_act.shape
    grad_preact = torch.empty_like(preact)
    mean_z_dz = torch.empty(m, dtype=torch.float32, device=grad_act.device)
    if m:
        launch_kernel(_swiglu_backward_kernel, (m,), grad_act, preact, grad_preact, mean_z_dz, f, 1.0 / width,
                      BLOCK=row_block(f), GELU_TANH=activation == "gelu_tanh", PORTABLE=portable_math())
    return grad_preact, mean_z_dz


swiglu_backward = dispatcher(swiglu_backward_ref, swiglu_backward_triton)
