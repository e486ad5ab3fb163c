"""A small tour: run the CODA library programs and compare each output with plain PyTorch math.

This is the placeholder main job until the training demo lands (issue: model level).
"""
from __future__ import annotations

import torch

from codagen.backends import execute, resolve_backend_name
from codagen.epilogue import finish, library


def main(argv: list[str] | None = None, tokens: int = 256, hidden: int = 128, ffn: int = 384) -> int:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(f"codagen demo on {device} ({resolve_backend_name(torch.device(device))} backend), {dtype}")
    attn = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w_o = torch.randn(hidden, hidden, device=device, dtype=dtype) / hidden ** 0.5
    w_gu = torch.randn(2 * ffn, hidden, device=device, dtype=dtype) / hidden ** 0.5
    residual = torch.randn(tokens, hidden, device=device, dtype=dtype)
    gamma = 1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype)

    out = execute(library.residual_rms_stats(), attn, w_o, residual=residual, norm_weight=gamma)
    rstd = finish.rstd_from_partial_sumsq(out["partial_sumsq"], hidden, 1e-6)
    act = execute(library.rms_gate_up_swiglu(), out["normed"], w_gu, rstd=rstd)["out"]

    x = residual.double() + attn.double() @ w_o.double().T
    h = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * gamma.double()
    z = h @ w_gu.double().T
    ref = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    print(library.residual_rms_stats())
    print(f"  residual stream max error {(out['residual_out'].double() - x).abs().max().item():.2e}")
    print(library.rms_gate_up_swiglu())
    print(f"  SwiGLU output  max error {(act.double() - ref).abs().max().item():.2e}")
    return 0
