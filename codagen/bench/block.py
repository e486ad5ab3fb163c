"""``codagen bench block``: one decoder block forward+backward, and a small full model's training step,
against PyTorch eager, torch.compile, Liger-Kernel and the speed-of-light line (GPU, bf16).

Providers (the same weights and inputs; every GEMM in ``nn.Linear`` layout):

- ``eager``: RMSNorm -> fused-weight QKV GEMM -> half-split RoPE -> SDPA -> O-proj + residual -> RMSNorm
  -> fused-weight gate/up GEMM -> SiLU*up -> down + residual (the full step adds the embedding, the
  final norm, the LM head and fp32 cross-entropy over materialized logits, as Hugging Face does);
- ``compile``: ``torch.compile`` of the eager function;
- ``liger``: the eager function with Liger's RMSNorm, RoPE, SwiGLU (and fused linear cross-entropy);
- ``codagen``: the CODA-regrouped ops (:mod:`codagen.models.llama`); the block also computes the next
  block's norm statistics, as it would inside a model;
- ``speed_of_light``: only the block's cuBLAS GEMMs (forward, input gradient, weight gradient of each
  weight) and SDPA forward+backward: the time left if every memory-bound op were free.

Block shapes: M = 16384 tokens (2 x 8192); the paper's MHA blocks d in {2048, 4096, 8192} with
f = round_up(8d/3, 256), head_dim 128; LLaMA-3 1B (d 2048, f 8192, GQA 32/8, hd 64) and 8B (d 4096,
f 14336, GQA 32/8, hd 128); Qwen3-8B (d 4096, f 12288, GQA 32/8, hd 128) with QK-norm, an RMSNorm over
each Q and K head before RoPE (in every provider but the speed-of-light line, which has no such work).
Each block shape runs in three attention cases (``--cases``), every provider under the same mask: ``causal``
(SDPA's ``is_causal``), ``padded`` (25% of the tokens right padding: the last row's second half) and
``packed`` (each row four documents of S/2, S/4, S/8, S/8 tokens, RoPE positions restarting per document);
the masked cases run SDPA on a boolean mask with K/V heads repeated, as Hugging Face's SDPA path does.
Records go to ``codagen-results/<date>-block.json`` in the current directory (``--out`` to change) with a
bar chart beside it; every provider runs in its own try/except, and a failure is recorded.
``--smoke`` runs tiny shapes on CPU (wall-clock timing) to check the harness itself.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from codagen import ops
from codagen._cli import command_parser, preset_arg
from codagen.models import Llama, LlamaConfig
from codagen.models.llama import AttentionSpec, BlockWeights, decoder_stack, fuse_qkv
from codagen.models.masks import causal_mask, document_ids
from codagen.models.reference import rotate_half

from .common import OUT_HELP, median_ms, peak_gib, pyplot, timed_rounds, wall_ms, write_results

__all__ = ["main", "BlockShape", "SHAPES"]

PROVIDERS = ("speed_of_light", "eager", "compile", "liger", "codagen")


def round_up(n: int, multiple: int) -> int:
    return multiple * math.ceil(n / multiple)


@dataclasses.dataclass(frozen=True)
class BlockShape:
    d: int
    f: int
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool = False  # Qwen3: an RMSNorm over each Q and K head (weights q_norm, k_norm [head_dim])

    @classmethod
    def mha(cls, d: int) -> BlockShape:
        return cls(d, round_up(8 * d // 3, 256), d // 128, d // 128, 128)

    @property
    def qkv(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


SHAPES = {
    "d2048": BlockShape.mha(2048),
    "d4096": BlockShape.mha(4096),
    "d8192": BlockShape.mha(8192),
    "llama3-1b": BlockShape(2048, 8192, 32, 8, 64),
    "llama3-8b": BlockShape(4096, 14336, 32, 8, 128),
    "qwen3-8b": BlockShape(4096, 12288, 32, 8, 128, qk_norm=True),
}
SMOKE_SHAPES = {"smoke-mha": BlockShape(64, 192, 2, 2, 32), "smoke-gqa": BlockShape(64, 160, 4, 2, 16),
                "smoke-qk-norm": BlockShape(64, 160, 4, 2, 16, qk_norm=True)}
EPS = 1e-5


# --- the eager block and model ---------------------------------------------------------------------
def _eager_rms(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def _eager_rope(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _eager_swiglu(gate, up):
    return F.silu(gate) * up


def _eager_ce(h, weight, targets):
    return F.cross_entropy((h @ weight.t()).float(), targets)


EAGER_OPS = {"rms": _eager_rms, "rope": _eager_rope, "swiglu": _eager_swiglu, "ce": _eager_ce}


def liger_ops() -> dict:
    """Liger-Kernel's Triton ops in the eager function's slots (ImportError when not installed)."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    fused_ce = LigerFusedLinearCrossEntropyLoss()
    # (contiguous: Liger's RMSNorm views its input as rows; QK-norm's q and k are column views of the QKV output)
    return {"rms": lambda x, w: LigerRMSNormFunction.apply(x.contiguous(), w, EPS),
            "rope": lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos[0], sin[0]),
            "swiglu": lambda g, u: LigerSiLUMulFunction.apply(g.contiguous(), u.contiguous()),
            "ce": lambda h, w, t: fused_ce(w, h, t)}


def eager_block(x, p: dict, cos, sin, s: BlockShape, batch: int, seq: int, o=EAGER_OPS, mask=None):
    """One pre-norm block on ``x`` [batch * seq, d]; ``p`` holds HF-layout weights (``qkv = [q; k; v]``,
    ``gate_up = [gate; up]``); ``mask`` a boolean SDPA mask (else causal), K/V heads repeated under it as
    Hugging Face's SDPA path does."""
    h = o["rms"](x, p["attn_norm"])
    q, k, v = (h @ p["qkv"].t()).split((s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim), -1)
    q, k = q.view(batch, seq, s.heads, s.head_dim), k.view(batch, seq, s.kv_heads, s.head_dim)
    if s.qk_norm:  # Qwen3: RMSNorm over each head, before RoPE
        q, k = o["rms"](q, p["q_norm"]), o["rms"](k, p["k_norm"])
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = v.view(batch, seq, s.kv_heads, s.head_dim).transpose(1, 2)
    q, k = o["rope"](q, k, cos, sin)
    a = masked_attention(q, k, v, mask, s)
    x = x + a.transpose(1, 2).reshape(batch * seq, -1) @ p["o"].t()
    gate, up = (o["rms"](x, p["mlp_norm"]) @ p["gate_up"].t()).chunk(2, dim=-1)
    return x + o["swiglu"](gate, up) @ p["down"].t()


def masked_attention(q, k, v, mask, s: BlockShape):
    """SDPA of ``[B, heads, S, hd]`` q, k, v: causal without ``mask``, else under it with K/V heads repeated."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=s.kv_heads != s.heads)
    k, v = (t.repeat_interleave(s.heads // s.kv_heads, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_case(case: str, batch: int, seq: int, device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(mask, positions [seq])`` of a benchmark case, the same for every provider:

    - ``causal``: no mask;
    - ``padded``: 25% of the tokens are right padding (the last row's second half, of 2 rows);
    - ``packed``: each row holds documents of S/2, S/4, S/8 and S/8 tokens, positions restarting per document.
    """
    positions = torch.arange(seq, device=device)
    if case == "causal":
        return None, positions
    if case == "padded":
        padding = torch.ones(batch, seq, dtype=torch.bool, device=device)
        padding[-1, seq - seq * batch // 4:] = False  # batch * seq / 4 pad tokens in the last row
        return causal_mask(batch, seq, device, padding=padding), positions
    if case == "packed":
        lengths = [seq // 2, seq // 4, seq // 8, seq - seq // 2 - seq // 4 - seq // 8]
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        return causal_mask(batch, seq, device, documents=document_ids(positions[None])), positions
    raise ValueError(f"attention case must be one of {ATTENTION_CASES}, got {case!r}")


ATTENTION_CASES = ("causal", "padded", "packed")


def eager_model_loss(ids, targets, m: dict, cos, sin, s: BlockShape, o=EAGER_OPS):
    batch, seq = ids.shape
    x = F.embedding(ids, m["embed"]).view(batch * seq, -1)
    for p in m["layers"]:
        x = eager_block(x, p, cos, sin, s, batch, seq, o)
    return o["ce"](o["rms"](x, m["norm"]), m["lm_head"], targets.view(-1))


def rope_tables(s: BlockShape, seq: int, device, dtype, theta: float = 500000.0, positions=None):
    """cos/sin ``[1, 1, seq, hd]`` (half-split layout) at ``positions`` (default 0..seq-1), fp32 math then cast,
    as Hugging Face."""
    inv = 1.0 / theta ** (torch.arange(0, s.head_dim, 2, device=device, dtype=torch.float32) / s.head_dim)
    positions = torch.arange(seq, device=device) if positions is None else positions
    angles = torch.outer(positions.to(torch.float32), inv)
    angles = torch.cat((angles, angles), dim=-1)[None, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


# --- weights -------------------------------------------------------------------------------------------
def block_weights(s: BlockShape, device, dtype) -> dict:
    def w(rows, cols):
        return (torch.randn(rows, cols, device=device, dtype=dtype) / math.sqrt(cols)).requires_grad_()

    def norm(d):
        return (1 + 0.1 * torch.randn(d, device=device, dtype=dtype)).requires_grad_()
    p = {"attn_norm": norm(s.d), "qkv": w(s.qkv, s.d), "o": w(s.d, s.heads * s.head_dim), "mlp_norm": norm(s.d),
         "gate_up": w(2 * s.f, s.d), "down": w(s.d, s.f), "next_norm": norm(s.d)}
    if s.qk_norm:
        p.update(q_norm=norm(s.head_dim), k_norm=norm(s.head_dim))
    return p


def codagen_block_weights(p: dict, s: BlockShape) -> tuple[BlockWeights, torch.Tensor]:
    """The same weights in the fused layout (pair-order Q/K rows, interleaved gate/up) as leaf tensors."""
    with torch.no_grad():
        q, k, v = p["qkv"].split((s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim))
        gate, up = p["gate_up"].chunk(2)
        fused = {"qkv": fuse_qkv(q, k, v, s.head_dim), "gate_up": ops.interleave_gate_up(gate, up)}
        fused.update({name: ops.rope_pairs_from_half_split(p[name], s.head_dim)  # pair order, as the Q/K rows
                      for name in ("q_norm", "k_norm") if name in p})
    leaf = {name: (fused.get(name, t)).detach().clone().requires_grad_() for name, t in p.items()}
    blk = BlockWeights(attn_norm=leaf["attn_norm"], qkv=leaf["qkv"], o=leaf["o"], mlp_norm=leaf["mlp_norm"],
                       gate_up=leaf["gate_up"], down=leaf["down"], q_norm=leaf.get("q_norm"),
                       k_norm=leaf.get("k_norm"))
    return blk, leaf["next_norm"]


# --- timing ----------------------------------------------------------------------------------------------
def _timer(device) -> Callable[[Callable], float]:
    if device.type == "cuda":
        return lambda fn: median_ms(fn, warmup_ms=50, rep_ms=300)
    return wall_ms


def _peak_gib(fn, device) -> float | None:
    """:func:`.common.peak_gib` of one step, which carries its parameters as ``fn.params``."""
    return peak_gib(fn, device, getattr(fn, "params", ()))


def _train_step(loss_fn: Callable[[], torch.Tensor], params: list, grad_out=None) -> Callable[[], None]:
    """forward + backward with fresh gradients (``grad_out`` for a non-scalar output)."""
    def step():
        for t in params:
            t.grad = None
        out = loss_fn()
        out.backward(grad_out)
    step.params = params  # for the harness's own test: each of these gets a fresh gradient every step
    return step


# --- providers -------------------------------------------------------------------------------------------
def block_providers(s: BlockShape, batch: int, seq: int, device, dtype, case: str = "causal") -> tuple[dict, Callable]:
    """name -> factory of a fwd+bwd callable; and a check of codagen's output against eager's. ``case``: the
    attention mask (:func:`attention_case`)."""
    m = batch * seq
    p = block_weights(s, device, dtype)
    mask, case_positions = attention_case(case, batch, seq, device)
    cos, sin = rope_tables(s, seq, device, dtype, positions=case_positions)
    x = torch.randn(m, s.d, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(m, s.d, device=device, dtype=dtype)
    eager_params = [x] + [t for name, t in p.items() if name != "next_norm"]

    def with_ops(get_ops, compiled=False):
        def make():
            o = get_ops()
            block = eager_block
            if compiled:
                torch._dynamo.reset()
                block = torch.compile(eager_block)
            return _train_step(lambda: block(x, p, cos, sin, s, batch, seq, o, mask), eager_params, grad_out)
        return make

    def codagen_forward():
        blk, next_norm = codagen_block_weights(p, s)
        spec = AttentionSpec(batch, seq, s.heads, s.kv_heads, s.head_dim, mask=mask)
        positions = case_positions.repeat(batch)
        freqs = ops.rope_frequencies(s.heads, s.kv_heads, s.head_dim, base=500000.0).to(device)
        xc = x.detach().clone().requires_grad_()
        # the block's own tensors (dataclasses.astuple would deep-copy them: their gradients would then
        # never be reset and every step would accumulate into the previous step's)
        # (next_norm only scales the next block's input: the block gives it no gradient)
        fields = (getattr(blk, f.name) for f in dataclasses.fields(blk))
        params = [xc] + [t for t in fields if isinstance(t, torch.Tensor)]
        return (lambda: decoder_stack(xc, [blk], next_norm, EPS, spec, positions, freqs)[0]), params

    def codagen():
        fn, params = codagen_forward()
        return _train_step(fn, params, grad_out)

    def check() -> float:
        """Relative difference of codagen's block output from eager's (same weights; bf16 rounding)."""
        with torch.no_grad():
            want = eager_block(x, p, cos, sin, s, batch, seq, mask=mask).float()
            got = codagen_forward()[0]().float()
        return ((got - want).norm() / want.norm()).item()

    factories = {"speed_of_light": lambda: speed_of_light_block(s, batch, seq, device, dtype, mask=mask),
                 "eager": with_ops(lambda: EAGER_OPS), "compile": with_ops(lambda: EAGER_OPS, compiled=True),
                 "liger": with_ops(liger_ops), "codagen": codagen}
    return factories, check


def cublas_gemms(a: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor) -> None:
    """One weight's three GEMMs on cuBLAS: ``a W^T``, ``dy W``, ``dy^T a``."""
    a @ weight.t(), grad_out @ weight, grad_out.t() @ a


def speed_of_light_block(s: BlockShape, batch: int, seq: int, device, dtype,
                         gemms_of: Callable[..., None] = cublas_gemms, mask=None) -> Callable[[], None]:
    """The block's GEMMs (y = a W^T, dA = dy W, dW = dy^T a, per weight; ``gemms_of(a, W, dy)`` runs them)
    and SDPA fwd+bwd (under ``mask`` when given), nothing else."""
    m = batch * seq
    gemms = []
    for n, k in ((s.qkv, s.d), (s.d, s.heads * s.head_dim), (2 * s.f, s.d), (s.d, s.f)):
        gemms.append((torch.randn(m, k, device=device, dtype=dtype), torch.randn(n, k, device=device, dtype=dtype),
                      torch.randn(m, n, device=device, dtype=dtype)))
    q = torch.randn(batch, s.heads, seq, s.head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, s.kv_heads, seq, s.head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    grad_attn = torch.randn_like(q)

    def run():
        for a, w, dy in gemms:
            gemms_of(a, w, dy)
        q.grad = k.grad = v.grad = None
        masked_attention(q, k, v, mask, s).backward(grad_attn)
    return run


def model_providers(s: BlockShape, layers: int, vocab: int, batch: int, seq: int, device, dtype) -> dict:
    """name -> factory of one training step's fwd+bwd (loss over all tokens) of a ``layers``-block model."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=s.d, intermediate_size=s.f, num_layers=layers,
                         num_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim, rope_theta=500000.0,
                         rms_norm_eps=EPS, qk_norm=s.qk_norm)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    targets = torch.randint(0, vocab, (batch, seq), device=device)
    cos, sin = rope_tables(s, seq, device, dtype)

    def eager_model():
        def w(rows, cols):
            return (0.02 * torch.randn(rows, cols, device=device, dtype=dtype)).requires_grad_()
        mp = {"embed": w(vocab, s.d), "norm": torch.ones(s.d, device=device, dtype=dtype, requires_grad=True),
              "lm_head": w(vocab, s.d), "layers": [block_weights(s, device, dtype) for _ in range(layers)]}
        params = [mp["embed"], mp["norm"], mp["lm_head"]] + [t for p in mp["layers"] for name, t in p.items()
                                                             if name != "next_norm"]
        return mp, params

    def with_ops(get_ops, compiled=False):
        def make():
            o = get_ops()
            mp, params = eager_model()
            loss = eager_model_loss
            if compiled:
                torch._dynamo.reset()
                loss = torch.compile(eager_model_loss)
            return _train_step(lambda: loss(ids, targets, mp, cos, sin, s, o), params)
        return make

    def codagen():
        model = Llama(config, device=device, dtype=dtype)
        return _train_step(lambda: model(ids, targets), list(model.parameters()))

    def speed_of_light():
        block = speed_of_light_block(s, batch, seq, device, dtype)
        h = torch.randn(batch * seq, s.d, device=device, dtype=dtype)
        head = torch.randn(vocab, s.d, device=device, dtype=dtype)
        dlogits = torch.randn(batch * seq, vocab, device=device, dtype=dtype)

        def run():
            for _ in range(layers):
                block()
            h @ head.t(), dlogits @ head, dlogits.t() @ h
        return run

    return {"speed_of_light": speed_of_light, "eager": with_ops(lambda: EAGER_OPS),
            "compile": with_ops(lambda: EAGER_OPS, compiled=True), "liger": with_ops(liger_ops),
            "codagen": codagen}


# --- driver ----------------------------------------------------------------------------------------------
def run_providers(factories: dict, providers: list[str], base: dict, device, rounds: int = 3) -> list[dict]:
    """Time each provider (its own try/except: a failure becomes a record with ``error``).

    All providers are built first, then timed in ``rounds`` interleaved rounds in rotating order (A B C,
    B C A, C A B: :func:`codagen.bench.common.timed_rounds`): the GPU's clocks drift by a few percent over
    a run (power, temperature), as much as the differences between providers, so each provider's
    ``median_ms`` is the median of its round medians (``round_ms`` keeps them all). Peak memory is
    measured once, after the rounds.
    """
    timer = _timer(device)
    records, steps = {}, {}
    for name in providers:
        record = records[name] = dict(base, provider=name, median_ms=None)
        started = time.perf_counter()
        try:
            steps[name] = factories[name]()
            steps[name]()  # first call: compilation, autotuning
            record["setup_s"] = round(time.perf_counter() - started, 2)
        except Exception as error:  # noqa: BLE001 - recorded, the other providers still run
            _record_error(record, error)
            steps.pop(name, None)
    def failed(name, error):
        _record_error(records[name], error)
        del steps[name]

    for name, round_ms in timed_rounds(dict(steps), rounds, timer, on_error=failed).items():
        records[name]["round_ms"] = round_ms
    for name, step in steps.items():
        record = records[name]
        record["median_ms"] = statistics.median(record["round_ms"])
        try:
            record["peak_mem_gib"] = _peak_gib(step, device)
        except Exception as error:  # noqa: BLE001
            _record_error(record, error)
    steps.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for name in providers:
        record = records[name]
        status = f"{record['median_ms']:.3f} ms" if record["median_ms"] is not None else record["error"][:100]
        print(f"  {base['name']:<12} {base['pass']:<8} {name:<15} {status}", flush=True)
    sol = records.get("speed_of_light", {}).get("median_ms")
    for r in records.values():
        if sol and r["median_ms"]:
            r["vs_speed_of_light"] = r["median_ms"] / sol
    return [records[name] for name in providers]


def _record_error(record: dict, error: Exception) -> None:
    record["median_ms"] = None
    record["error"] = f"{type(error).__name__}: {error}"[:500]
    record["traceback"] = traceback.format_exc()[-1500:]


def table(records: list[dict], providers: list[str]) -> str:
    """Markdown: one row per (pass, shape), ms per provider, codagen / speed of light, codagen / best peer."""
    rows = {}
    for r in records:
        rows.setdefault((r["pass"], r["name"]), {})[r["provider"]] = r["median_ms"]
    head = "| pass | shape | " + " | ".join(providers) + " | codagen / SOL | codagen / best peer |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (pass_, name), ms in rows.items():
        cells = [f"{ms[p]:.3f}" if ms.get(p) else "—" for p in providers]
        peers = [ms[p] for p in ("eager", "compile", "liger") if ms.get(p)]
        coda, sol = ms.get("codagen"), ms.get("speed_of_light")
        ratio_sol = f"{coda / sol:.3f}x" if coda and sol else "—"
        ratio_peer = f"{coda / min(peers):.3f}x" if coda and peers else "—"
        lines.append(f"| {pass_} | {name} | " + " | ".join(cells) + f" | {ratio_sol} | {ratio_peer} |")
    return "\n".join(lines)


def plot(records: list[dict], providers: list[str], path: Path) -> Path | None:
    """Grouped bars of time / speed of light per shape, one panel per pass (lower is better)."""
    plt = pyplot()
    if plt is None:
        return None
    passes = sorted({r["pass"] for r in records})
    fig, axes = plt.subplots(1, len(passes), figsize=(6 * len(passes), 4), squeeze=False)
    for ax, pass_ in zip(axes[0], passes):
        names = list(dict.fromkeys(r["name"] for r in records if r["pass"] == pass_))
        width = 0.8 / len(providers)
        for i, provider in enumerate(providers):
            ratio = {r["name"]: r.get("vs_speed_of_light") for r in records
                     if r["pass"] == pass_ and r["provider"] == provider}
            xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(names))]
            ax.bar(xs, [ratio.get(n) or 0 for n in names], width, label=provider)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set_ylabel("time / speed of light")
        ax.set_title(f"{pass_} (lower is better)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("codagen bench block", __doc__)
    parser.add_argument("--quick", action="store_true", help="LLaMA-3 1B and 8B blocks only; a 2-layer model")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the harness, not speed")
    parser.add_argument("--shapes", nargs="+", type=preset_arg(sorted(SHAPES)),
                        help=f"block shapes: {', '.join(sorted(SHAPES))} (default: all)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--model-shape", default="llama3-1b", type=preset_arg(sorted(SHAPES)),
                        help="the full model's block (one of --shapes' names; default llama3-1b)")
    parser.add_argument("--layers", type=int, help="full model layers (default 4; 2 with --quick; 0: skip)")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--cases", nargs="+", choices=ATTENTION_CASES, default=list(ATTENTION_CASES),
                        help="attention masks of the block: causal, padded (25%% padding), packed (4 documents a row)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per provider (default 3)")
    parser.add_argument("--out", help=OUT_HELP)
    args = parser.parse_args(argv)

    if args.smoke:
        device, dtype, batch, seq = torch.device("cpu"), torch.float32, 2, 64
        shapes, model_shape, vocab = SMOKE_SHAPES, SMOKE_SHAPES["smoke-gqa"], 128
        layers = 2 if args.layers is None else args.layers  # 0 skips the model, as on the GPU
    else:
        if not torch.cuda.is_available():
            print("codagen bench block needs a CUDA GPU (use --smoke to check the harness on CPU)", file=sys.stderr)
            return 2
        device, dtype, batch, seq = torch.device("cuda"), torch.bfloat16, 2, 8192
        names = args.shapes or (["llama3-1b", "llama3-8b"] if args.quick else list(SHAPES))
        shapes = {n: SHAPES[n] for n in names}
        model_shape, vocab = SHAPES[args.model_shape], args.vocab
        layers = args.layers if args.layers is not None else (2 if args.quick else 4)
    providers = list(args.providers)
    print(f"block benchmark on {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, {dtype}, "
          f"M = {batch} x {seq} tokens; providers {providers}", flush=True)

    records = []
    for (shape_name, s), case in itertools.product(shapes.items(), args.cases):
        name = shape_name if case == "causal" else f"{shape_name}-{case}"
        shape = dict(dataclasses.asdict(s), tokens=batch * seq)
        try:
            factories, check = block_providers(s, batch, seq, device, dtype, case)
        except Exception as error:  # noqa: BLE001 - e.g. out of memory building the weights
            print(f"  {name}: setup failed: {error}")
            continue
        block_records = run_providers(factories, providers, {"suite": "block", "name": name, "pass": "fwd+bwd",
                                                             "attention": case, "shape": shape, "dtype": str(dtype)},
                                      device, args.rounds)
        if "codagen" in providers:
            try:
                block_records[providers.index("codagen")]["rel_diff_vs_eager"] = check()
            except Exception as error:  # noqa: BLE001
                block_records[providers.index("codagen")]["check_error"] = f"{type(error).__name__}: {error}"[:300]
        records += block_records
        del factories, check
        write_results("block", records, args.out)  # after every shape: a run cut short keeps what it measured
    if layers > 0:
        s = model_shape
        name = f"{args.model_shape if not args.smoke else 'smoke'}-x{layers}"
        shape = dict(dataclasses.asdict(s), tokens=batch * seq, layers=layers, vocab=vocab)
        factories = model_providers(s, layers, vocab, batch, seq, device, dtype)
        records += run_providers(factories, providers, {"suite": "block", "name": name, "pass": "step",
                                                        "shape": shape, "dtype": str(dtype)}, device, args.rounds)

    path = write_results("block", records, args.out)
    chart = plot(records, providers, path.with_suffix(".png"))
    print(f"\nresults: {path}" + (f", chart: {chart}" if chart else ""))
    print(table(records, providers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
