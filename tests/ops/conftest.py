"""What the ops tests share: a naive eager LLaMA block in the standard (Hugging Face) layouts, the same
block from codagen.ops (its weights built from the same leaf tensors through the layout conversions,
differentiably), the bf16 2x-rule check and the reference backend with small tiles."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from codagen import ops
from codagen.backends import get_backend, use_backend


# ==================================================================================================
# The model, eager and fused
# ==================================================================================================
@dataclass(frozen=True)
class Config:
    batch: int = 2
    seq: int = 5
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    ffn: int = 40
    vocab: int = 50
    layers: int = 2
    eps: float = 1e-6
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE (weights in HF channel order)
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


LAYER_WEIGHTS = ("attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down")


def make_params(cfg: Config, dtype=torch.float64, device="cpu") -> dict[str, torch.Tensor]:
    """Fresh random leaf parameters in the standard layout (norm weights near 1, never all ones)."""
    d, hd = cfg.hidden, cfg.head_dim

    def w(*shape, scale=None):
        scale = shape[-1] ** -0.5 if scale is None else scale
        return torch.randn(*shape, dtype=torch.float64) * scale

    params = {}
    for layer in range(cfg.layers):
        p = f"{layer}."
        params[p + "attn_norm"] = 1 + 0.2 * w(d, scale=1)
        params[p + "q"] = w(cfg.heads * hd, d)
        params[p + "k"] = w(cfg.kv_heads * hd, d)
        params[p + "v"] = w(cfg.kv_heads * hd, d)
        params[p + "o"] = w(d, cfg.heads * hd)
        params[p + "mlp_norm"] = 1 + 0.2 * w(d, scale=1)
        params[p + "gate"] = w(cfg.ffn, d)
        params[p + "up"] = w(cfg.ffn, d)
        params[p + "down"] = w(d, cfg.ffn)
        if cfg.qk_norm:
            params[p + "q_norm"] = 1 + 0.2 * w(hd, scale=1)
            params[p + "k_norm"] = 1 + 0.2 * w(hd, scale=1)
    params["final_norm"] = 1 + 0.2 * w(d, scale=1)
    params["lm_head"] = w(cfg.vocab, d)
    return {k: v.to(device=device, dtype=dtype).requires_grad_() for k, v in params.items()}


def make_inputs(cfg: Config, dtype=torch.float64, device="cpu"):
    x = torch.randn(cfg.tokens, cfg.hidden, dtype=torch.float64).to(device, dtype).requires_grad_()
    positions = torch.arange(cfg.seq).repeat(cfg.batch).to(device)
    target = torch.randint(0, cfg.vocab, (cfg.tokens,))
    target[torch.randperm(cfg.tokens)[: cfg.tokens // 4]] = -100  # some ignored rows (none if M < 4)
    probe = torch.randn(cfg.tokens, cfg.hidden, dtype=torch.float64).to(device, dtype)
    return x, positions, target.to(device), probe


#: the MLP gate's nonlinearity by the ops' ``activation`` name, as eager PyTorch computes it
GATE_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_half_split(t, positions, inv_freq):
    """Hugging Face RoPE: rotate (i, i + hd/2) by positions * inv_freq[i]; t is [B, heads, S, hd]."""
    freqs = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(t.dtype), emb.sin().to(t.dtype)
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rotated * sin


def attention(q, k, v, cfg: Config):
    """Causal GQA attention on [tokens, heads * hd] inputs -> [tokens, heads * hd]."""
    b, s, hd = cfg.batch, cfg.seq, cfg.head_dim
    q = q.reshape(b, s, cfg.heads, hd).transpose(1, 2)
    k = k.reshape(b, s, cfg.kv_heads, hd).transpose(1, 2)
    v = v.reshape(b, s, cfg.kv_heads, hd).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=cfg.heads != cfg.kv_heads)
    return out.transpose(1, 2).reshape(b * s, cfg.heads * hd)


def inv_freq(cfg: Config, device="cpu"):
    return 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim)).to(device)


def eager_model(params, x, positions, target, cfg: Config):
    """The naive block stack: RMSNorm -> QKV -> RoPE -> SDPA -> out-proj -> residual -> RMSNorm -> gated MLP
    (SwiGLU or GeGLU) -> residual; then final norm + LM head + cross-entropy. Returns (hidden, loss)."""
    b, s = cfg.batch, cfg.seq
    pos = positions[: s]
    freq = inv_freq(cfg, x.device).to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    for layer in range(cfg.layers):
        p = {name: params[f"{layer}.{name}"] for name in LAYER_WEIGHTS}
        h = rms_norm(x, p["attn_norm"], cfg.eps)
        q, k, v = h @ p["q"].t(), h @ p["k"].t(), h @ p["v"].t()
        q, k = q.reshape(b, s, cfg.heads, -1), k.reshape(b, s, cfg.kv_heads, -1)
        if cfg.qk_norm:  # per head, over head_dim
            q = rms_norm(q, params[f"{layer}.q_norm"], cfg.eps)
            k = rms_norm(k, params[f"{layer}.k_norm"], cfg.eps)
        q = rope_half_split(q.transpose(1, 2), pos, freq)
        k = rope_half_split(k.transpose(1, 2), pos, freq)
        q, k = (t.transpose(1, 2).reshape(b * s, -1) for t in (q, k))
        x = x + attention(q, k, v, cfg) @ p["o"].t()
        h = rms_norm(x, p["mlp_norm"], cfg.eps)
        x = x + (GATE_ACTIVATIONS[cfg.activation](h @ p["gate"].t()) * (h @ p["up"].t())) @ p["down"].t()
    if target is None:  # the block stack alone
        return x, None
    logits = rms_norm(x, params["final_norm"], cfg.eps) @ params["lm_head"].t()
    loss = F.cross_entropy(logits.float() if logits.dtype != torch.float64 else logits, target, ignore_index=-100)
    return x, loss


def fused_weights(params, cfg: Config):
    """Fused layouts: taken as given (``{layer}.qkv``, ``{layer}.gate_up``) or built differentiably from the
    standard leaf parameters."""
    out = {}
    for layer in range(cfg.layers):
        p = f"{layer}."
        if p + "qkv" in params:
            out[p + "qkv"], out[p + "gate_up"] = params[p + "qkv"], params[p + "gate_up"]
            continue
        out[p + "qkv"] = torch.cat((ops.rope_pairs_from_half_split(params[p + "q"], cfg.head_dim),
                                    ops.rope_pairs_from_half_split(params[p + "k"], cfg.head_dim),
                                    params[p + "v"]))
        out[p + "gate_up"] = ops.interleave_gate_up(params[p + "gate"], params[p + "up"])
    return out


def fused_model(params, x, positions, target, cfg: Config, reduction="mean"):
    """The same stack from codagen.ops. Returns (hidden, loss)."""
    fused = fused_weights(params, cfg)
    frequencies = ops.rope_frequencies(cfg.heads, cfg.kv_heads, cfg.head_dim, device=x.device)
    if x.dtype == torch.float64:
        frequencies = frequencies.double()
    q_cols, kv_cols = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    normed, rstd = ops.rms_norm_stats(x, params["0.attn_norm"], cfg.eps)
    for layer in range(cfg.layers):
        p = f"{layer}."
        next_norm = params[f"{layer + 1}.attn_norm"] if layer + 1 < cfg.layers else params["final_norm"]
        if cfg.qk_norm:  # norm weights to the pair order of the Q/K rows
            q_norm, k_norm = (ops.rope_pairs_from_half_split(params[p + n], cfg.head_dim) for n in ("q_norm", "k_norm"))
            q, k, v = ops.rms_qkv_rope(x, normed, rstd, params[p + "attn_norm"], fused[p + "qkv"], positions,
                                       frequencies, q_norm, k_norm, num_heads=cfg.heads, qk_norm_eps=cfg.eps,
                                       split_sizes=(q_cols, kv_cols, kv_cols))
        else:
            q, k, v = ops.rms_qkv_rope(x, normed, rstd, params[p + "attn_norm"], fused[p + "qkv"], positions,
                                       frequencies, split_sizes=(q_cols, kv_cols, kv_cols))
        x, normed, rstd = ops.out_proj_residual_rms(attention(q, k, v, cfg), params[p + "o"], x,
                                                    params[p + "mlp_norm"], cfg.eps)
        x, normed, rstd = ops.swiglu_mlp_residual_rms(x, normed, rstd, params[p + "mlp_norm"], fused[p + "gate_up"],
                                                      params[p + "down"], next_norm, cfg.eps,
                                                      activation=cfg.activation)
    if target is None:  # the block stack alone
        return x, None
    loss = ops.rms_lm_head_cross_entropy(x, normed, rstd, params["final_norm"], params["lm_head"], target,
                                         reduction=reduction)
    return x, loss


def forward_backward(model, params, x, positions, target, probe, cfg: Config):
    """Loss + a random probe of the hidden output (so the residual path's gradient is checked too)."""
    hidden, loss = model(params, x, positions, target, cfg)
    objective = (hidden * probe).sum() if loss is None else loss + (hidden * probe).sum()
    names = ["x", *(k for k, v in params.items() if v.requires_grad)]
    leaves = [x, *(v for v in params.values() if v.requires_grad)]
    grads = torch.autograd.grad(objective, leaves, allow_unused=True)  # the head's weights without a head
    return hidden.detach(), None if loss is None else loss.detach(), {
        name: grad for name, grad in zip(names, grads) if grad is not None}


def fuse_params(params, cfg: Config) -> dict[str, torch.Tensor]:
    """New leaf parameters in the fused layouts (qkv, gate_up), as a model would store them."""
    fused = {k: v.detach().clone().requires_grad_() for k, v in params.items()
             if k.split(".")[-1] not in ("q", "k", "v", "gate", "up")}
    for key, value in fused_weights(params, cfg).items():
        fused[key] = value.detach().clone().requires_grad_()
    return fused


def unfuse_grads(grads: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """Gradients of fused parameters mapped back to the standard layout (q, k, v, gate, up)."""
    out = dict(grads)
    q_rows, kv_rows = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    for layer in range(cfg.layers):
        p = f"{layer}."
        q, k, v = out.pop(p + "qkv").split((q_rows, kv_rows, kv_rows))
        out[p + "q"] = ops.rope_half_split_from_pairs(q, cfg.head_dim)
        out[p + "k"] = ops.rope_half_split_from_pairs(k, cfg.head_dim)
        out[p + "v"] = v
        out[p + "gate"], out[p + "up"] = ops.split_gate_up(out.pop(p + "gate_up"))
    return out


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.bfloat16).requires_grad_(t.requires_grad)


def bf16_problem(cfg: Config, device="cpu"):
    """bf16 parameters and inputs, and float32 copies of exactly the same (bf16-rounded) values."""
    params = {k: bf16(v) for k, v in make_params(cfg, dtype=torch.float32, device=device).items()}
    x, positions, target, probe = make_inputs(cfg, dtype=torch.float32, device=device)
    x, probe = bf16(x), bf16(probe)
    as32 = lambda t: t.detach().float().requires_grad_(t.requires_grad)  # noqa: E731
    return (params, x, positions, target, probe), ({k: as32(v) for k, v in params.items()}, as32(x), positions,
                                                   target, as32(probe))


def max_errors(run, reference) -> dict[str, float]:
    """Max abs error of each tensor output (hidden state, every gradient) vs the reference run."""
    errors = {"hidden": (run[0].float() - reference[0]).abs().max().item()}
    for key, value in reference[2].items():
        errors[f"grad {key}"] = (run[2][key].float() - value).abs().max().item()
    return errors


def assert_two_x_rule(cfg: Config, device: str = "cpu") -> None:
    """The 2x rule on a bf16 problem: each tensor's max error vs float32 math on the same bf16-rounded
    values is at most 2x that of the eager bf16 model (+1e-6). The loss is one number whose eager bf16
    error can be luckily tiny (a single draw), so it is held to bf16 rounding instead: 2^-8 relative."""
    bf16_run, fp32_run = bf16_problem(cfg, device)
    reference = forward_backward(eager_model, *fp32_run, cfg)
    fused_run = forward_backward(fused_model, *bf16_run, cfg)
    eager = max_errors(forward_backward(eager_model, *bf16_run, cfg), reference)
    fused = max_errors(fused_run, reference)
    failures = [f"{k}: fused {fused[k]:.3e} > 2 x eager {eager[k]:.3e} + 1e-6" for k in eager
                if not fused[k] <= 2 * eager[k] + 1e-6]
    if reference[1] is not None:
        loss_error = (fused_run[1].double() - reference[1].double()).abs().item() / reference[1].abs().item()
        if not loss_error <= 2 ** -8:
            failures.append(f"loss: relative error {loss_error:.3e} > 2^-8")
    assert not failures, "\n".join(failures)


@contextlib.contextmanager
def reference_tiles(block_m: int = 16, block_n: int = 8):
    """The reference backend with small tiles, so partial reductions span several tiles."""
    backend = get_backend("reference")
    saved = backend.block_m, backend.block_n
    backend.block_m, backend.block_n = block_m, block_n
    try:
        with use_backend("reference"):
            yield
    finally:
        backend.block_m, backend.block_n = saved



def assert_close(name, got, want, rtol=1e-9, atol=1e-10):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
