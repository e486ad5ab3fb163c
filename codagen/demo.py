"""``codagen demo``: train a small LLaMA twice from the same init, with codagen and with plain PyTorch.

The corpus is generated (no downloads): sentences from a small random grammar plus additions with
their sums, read one character at a time. Both runs see the same batches in the same order; the
codagen run uses :class:`codagen.models.Llama` (fused kernels: Triton on a GPU, the PyTorch
reference backend on CPU) and the baseline :class:`codagen.models.ReferenceLlama` (eager PyTorch).
Prints both loss curves' summary and their largest per-step difference, and writes ``demo_out/loss.png``.
On CPU both runs are float64, so that difference measures the fused programs against the eager model, not
fp32 rounding amplified over the steps; the reference backend runs the fused programs op by op, so no speed
is printed. On a GPU both runs are bfloat16, and each run's tokens/s and their ratio are printed.
"""
from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from pathlib import Path

import torch

from codagen._cli import command_parser, device_arg
from codagen.backends import resolve_backend_name
from codagen.models import Llama, LlamaConfig, ReferenceLlama

__all__ = ["main", "make_corpus", "CharTokenizer", "batches", "lr_schedule"]

_NOUNS = "cat dog bird fox horse child farmer king queen river tree house ship star moon garden".split()
_ADJECTIVES = "old young small big red green quiet happy dark bright lazy clever".split()
_VERBS = "sees finds likes follows paints watches helps carries remembers".split()
_PLACES = "near the river|under the tree|in the garden|by the sea|on the hill|at night".split("|")


def make_corpus(num_chars: int, seed: int = 0) -> str:
    """Generated text: ``the old cat sees a red ship near the river.`` style sentences and ``17+25=42.``"""
    rng = random.Random(seed)

    def noun_phrase():
        article = rng.choice(("the", "a"))
        return f"{article} {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}" if rng.random() < 0.6 \
            else f"{article} {rng.choice(_NOUNS)}"

    parts, size = [], 0
    while size < num_chars:
        if rng.random() < 0.25:
            a, b = rng.randrange(100), rng.randrange(100)
            line = f"{a}+{b}={a + b}."
        else:
            line = f"{noun_phrase()} {rng.choice(_VERBS)} {noun_phrase()}"
            line += f" {rng.choice(_PLACES)}." if rng.random() < 0.5 else "."
        parts.append(line)
        size += len(line) + 1
    return "\n".join(parts)[:num_chars]


class CharTokenizer:
    """Characters to ids and back; the vocabulary is the corpus's sorted characters."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Model and run size for one device class."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    batch: int
    seq: int
    steps: int
    lr: float
    dtype: torch.dtype


# float64 on CPU costs about twice fp32 per token: batch 8 keeps the run as short as fp32's batch 16
CPU_SETUP = Setup(hidden=128, layers=4, heads=4, kv_heads=2, batch=8, seq=128, steps=300, lr=3e-3,
                  dtype=torch.float64)
GPU_SETUP = Setup(hidden=768, layers=8, heads=12, kv_heads=4, batch=32, seq=512, steps=300, lr=1e-3,
                  dtype=torch.bfloat16)


def batches(data: torch.Tensor, batch: int, seq: int, steps: int, seed: int, device):
    """``steps`` random (input, target) windows of the token stream, the same for every call with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        window = torch.stack([data[s: s + seq + 1] for s in start.tolist()])
        yield window[:, :-1].to(device), window[:, 1:].to(device)


class _ProgressBar:
    """A one-line bar redrawn in place on a terminal; silent when stdout is not one (a log gets the summary)."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done, self.postfix = total, desc, 0, ""
        self.shown = sys.stdout.isatty()

    def update(self, n: int = 1):
        self.done += n
        if self.shown:
            filled = 30 * self.done // max(self.total, 1)
            print(f"\r{self.desc} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {self.postfix}",
                  end="", flush=True)

    def set_postfix_str(self, text: str):
        self.postfix = text

    def close(self):
        if self.shown:
            print(flush=True)


def lr_schedule(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of ``peak``."""
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(model: torch.nn.Module, data: torch.Tensor, setup: Setup, seed: int, desc: str, device) -> dict:
    """AdamW over the fixed batch sequence; returns the loss per step and tokens/s (after 10 warm-up steps)."""
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses, bar = [], _ProgressBar(setup.steps, desc)
    warmup = min(10, setup.steps // 2)
    start = None
    for step, (inputs, targets) in enumerate(batches(data, setup.batch, setup.seq, setup.steps, seed, device)):
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_schedule(step, setup.steps, setup.lr)
        loss = model(inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.set_postfix_str(f"loss {losses[-1]:.3f}")
        bar.update(1)
    _sync(device)
    bar.close()
    seconds = time.perf_counter() - start
    return {"losses": losses, "tokens_per_s": (setup.steps - warmup) * setup.batch * setup.seq / seconds}


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def sample(model: Llama, tok: CharTokenizer, prompt: str, length: int, context: int, device) -> str:
    """Greedy continuation (the forward runs over the last ``context`` characters at every step: no KV cache)."""
    ids = tok.encode(prompt).to(device)[None]
    for _ in range(length):
        logits = model(ids[:, -context:])
        ids = torch.cat((ids, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return tok.decode(ids[0].tolist())


def _plot(curves: dict[str, list[float]], path: Path, title: str) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install codagen[bench]): no plot written")
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    # the curves coincide: a wide translucent line under a thin dashed one keeps both visible
    styles = [dict(linewidth=3.0, alpha=0.45), dict(linewidth=1.0, linestyle="--")]
    for (name, losses), style in zip(curves.items(), styles):
        ax.plot(range(1, len(losses) + 1), losses, label=name, **style)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/char)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("codagen demo", __doc__)
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda[:index] (default: cuda when a GPU is available)")
    parser.add_argument("--steps", type=int, help="training steps per run (default: 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="demo_out", help="folder for loss.png (default: demo_out)")
    args = parser.parse_args(argv)
    device = args.device
    setup = GPU_SETUP if device.type == "cuda" else CPU_SETUP
    if args.steps is not None:
        if args.steps < 2:
            parser.error("--steps must be at least 2")
        setup = dataclasses.replace(setup, steps=args.steps)

    text = make_corpus(400_000, seed=args.seed)
    tok = CharTokenizer(text)
    data = tok.encode(text)
    config = LlamaConfig(vocab_size=len(tok.chars), hidden_size=setup.hidden,
                         intermediate_size=64 * math.ceil(8 * setup.hidden / 3 / 64),
                         num_layers=setup.layers, num_heads=setup.heads, num_kv_heads=setup.kv_heads)
    backend = resolve_backend_name(device)
    print(f"codagen demo: {config.num_parameters() / 1e6:.2f}M-parameter LLaMA (d {config.hidden_size}, "
          f"f {config.intermediate_size}, {config.num_layers} layers, GQA {config.num_heads}/{config.num_kv_heads}), "
          f"vocab {config.vocab_size} characters")
    dtype_name = str(setup.dtype).removeprefix("torch.")
    print(f"  {setup.steps} steps x {setup.batch} x {setup.seq} tokens on {device} in {dtype_name}; "
          f"codagen backend: {backend}")

    torch.manual_seed(args.seed)
    fused = Llama(config, device=device, dtype=setup.dtype)
    baseline = ReferenceLlama(config).to(device=device, dtype=setup.dtype)
    baseline.load_state_dict(fused.to_hf_state_dict())  # the same init

    runs = {"codagen": train(fused, data, setup, args.seed, "codagen", device),
            "PyTorch": train(baseline, data, setup, args.seed, "PyTorch", device)}

    every = max(1, setup.steps // 6)
    print(f"\n{'step':>6}{'codagen':>10}{'PyTorch':>10}")
    for step in sorted({*range(0, setup.steps, every), setup.steps - 1}):
        print(f"{step + 1:>6}{runs['codagen']['losses'][step]:>10.4f}{runs['PyTorch']['losses'][step]:>10.4f}")
    timed = device.type == "cuda"  # the reference backend (CPU) runs the fused programs op by op: no speed
    header = f"\n{'run':<9}{'first loss':>12}{'final loss':>12}{'last-20 mean':>14}"
    print(header + f"{'tokens/s':>12}" if timed else header)
    for name, run in runs.items():
        losses = run["losses"]
        row = f"{name:<9}{losses[0]:>12.4f}{losses[-1]:>12.4f}{sum(losses[-20:]) / len(losses[-20:]):>14.4f}"
        print(row + f"{run['tokens_per_s']:>12,.0f}" if timed else row)
    diff = max(abs(a - b) for a, b in zip(runs["codagen"]["losses"], runs["PyTorch"]["losses"]))
    print(f"max |loss difference| over {setup.steps} steps, {dtype_name}: {diff:.1e}")
    if timed:
        speedup = runs["codagen"]["tokens_per_s"] / runs["PyTorch"]["tokens_per_s"]
        print(f"codagen / PyTorch tokens/s: {speedup:.2f}x")
    prompt = "the old "
    print(f"codagen model continues {prompt!r}: {sample(fused, tok, prompt, 60, setup.seq, device)!r}")
    path = _plot({name: run["losses"] for name, run in runs.items()}, Path(args.out) / "loss.png",
                 f"{config.num_parameters() / 1e6:.1f}M LLaMA, {device.type}, {dtype_name}")
    if path is not None:
        print(f"loss curves written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
