"""How far does FP8 training move the loss curve from bf16: codagen's blockwise recipe against torchao's Float8?

    PYTHONPATH=. python bench/fp8_loss_curve.py [--steps 300] [--device cpu|cuda] [--out FILE]

Four runs of one Hugging Face Llama from the same init on ``codagen demo``'s generated corpus, with the same batches
in the same order (AdamW, the demo's schedule, fp32 parameters under ``torch.autocast`` to bf16):

- ``bf16``: the unpatched model;
- ``codagen bf16``: ``codagen.patch(model)``;
- ``codagen fp8``: ``codagen.patch(model, fp8="blockwise")`` (1 x 128 groups, 128 x 128 weight blocks);
- ``torchao fp8``: torchao's ``convert_to_float8_training`` with its ``rowwise`` recipe on every projection
  (the LM head excluded, as torchtitan does), where torchao imports.

Reported per run and seed: the losses, their mean over the last 20 steps, the distance from the bf16 run (the mean
absolute difference per step, over all steps and over the last 100), and, at the init, the loss's and each
projection gradient's relative error against the float64 model (the per-step error the curves accumulate); then
their means over the seeds. On CPU codagen runs on its reference backend and torchao on PyTorch's CPU
``_scaled_mm``; both are FP8's arithmetic (e4m3 codes and scales, fp32 products), not its speed, so no speed is
reported.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time

import torch
import transformers

import codagen
from codagen.demo import CharTokenizer, batches, lr_schedule, make_corpus

#: the model: the demo's corpus, wide enough for several groups of 128 along every K (2 at the hidden size, 5.5 in
#: the down projection, a last partial group), heads of 64
CONFIG = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
              attn_implementation="sdpa")
BATCH, SEQ, LR = 8, 128, 3e-3


def torchao_float8(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model`` with torchao's rowwise Float8 on every projection (not the LM head), or None without torchao."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    config = Float8LinearConfig.from_recipe_name("rowwise")
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: "lm_head" not in name)


def train(model: torch.nn.Module, data: torch.Tensor, steps: int, seed: int, device) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for step, (inputs, targets) in enumerate(batches(data, BATCH, SEQ, steps, seed, device)):
        for group in opt.param_groups:
            group["lr"] = lr_schedule(step, steps, LR)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=inputs, labels=targets, shift_labels=targets.contiguous()).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


#: the runs: how each makes its model from the shared init (None where it cannot run here)
MAKERS = {"bf16": lambda m: m, "codagen bf16": codagen.patch,
          "codagen fp8": lambda m: codagen.patch(m, fp8="blockwise"), "torchao fp8": torchao_float8}


def gradient_errors(base: torch.nn.Module, data: torch.Tensor, seed: int, device) -> dict[str, dict[str, float]]:
    """At the init, on the first batch: each run's loss and every projection's gradient against the float64 model
    (relative, in the norm): the per-step error the curves accumulate."""
    inputs, targets = next(iter(batches(data, BATCH, SEQ, 1, seed, device)))

    def loss_and_grads(model, dtype):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype is None):
            loss = model(input_ids=inputs, labels=targets, shift_labels=targets.contiguous()).loss
        loss.backward()
        return loss.double(), {n: p.grad.double() for n, p in model.named_parameters() if "proj" in n}
    exact_loss, exact = loss_and_grads(copy.deepcopy(base).double(), torch.float64)
    errors = {}
    for name, make in MAKERS.items():
        model = make(copy.deepcopy(base))
        if model is None:
            continue
        loss, grads = loss_and_grads(model, None)
        relative = sorted(((grads[n] - g).norm() / g.norm()).item() for n, g in exact.items())
        errors[name] = {"loss": abs(loss - exact_loss).item() / exact_loss.item(),
                        "projection_grad_median": relative[len(relative) // 2], "projection_grad_max": relative[-1]}
    return errors


def run_seed(seed: int, steps: int, device) -> dict:
    text = make_corpus(400_000, seed=seed)
    tok = CharTokenizer(text)
    data = tok.encode(text)
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=len(tok.chars), **CONFIG)).to(device)
    curves, seconds = {}, {}
    for name, make in MAKERS.items():
        model = make(copy.deepcopy(base))
        if model is None:
            print(f"{name}: skipped (torchao does not import)")
            continue
        start = time.perf_counter()
        curves[name] = train(model, data, steps, seed, device)
        seconds[name] = time.perf_counter() - start
        print(f"seed {seed} {name:14s} done in {seconds[name]:.0f} s: final-20 mean {_mean(curves[name][-20:]):.4f}",
              flush=True)
    reference = curves["bf16"]

    def distance(curve, last=None):
        pairs = list(zip(curve, reference))[-last:] if last else list(zip(curve, reference))
        return _mean([abs(a - b) for a, b in pairs])
    summary = {name: {"first": curve[0], "last_20_mean": _mean(curve[-20:]), "distance_from_bf16": distance(curve),
                      "distance_from_bf16_last_100": distance(curve, 100)} for name, curve in curves.items()}
    return dict(seed=seed, vocab_size=len(tok.chars), parameters=sum(p.numel() for p in base.parameters()),
                gradient_errors_at_init=gradient_errors(base, data, seed, device), seconds=seconds, summary=summary,
                curves=curves)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="write the curves and the summary as JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    seeds = [run_seed(seed, args.steps, device) for seed in args.seeds]
    names = list(seeds[0]["summary"])
    mean = {name: {key: _mean([s["summary"][name][key] for s in seeds]) for key in seeds[0]["summary"][name]}
            for name in names}
    for name in names:
        for key in ("projection_grad_median", "loss"):
            mean[name][f"init_{key}_error"] = _mean([s["gradient_errors_at_init"][name][key] for s in seeds])
    print(f"\nmean over seeds {args.seeds}:")
    print(f"{'run':14s}{'last-20':>9s}{'|d| bf16':>10s}{'last 100':>10s}{'grad err':>10s}")
    for name, s in mean.items():
        print(f"{name:14s}{s['last_20_mean']:9.4f}{s['distance_from_bf16']:10.4f}"
              f"{s['distance_from_bf16_last_100']:10.4f}{s['init_projection_grad_median_error']:10.4f}")
    if args.out:
        try:
            import torchao
            torchao_version = torchao.__version__
        except ImportError:
            torchao_version = None
        record = dict(question=__doc__.splitlines()[0], command=" ".join(["python", *sys.argv]),
                      device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
                      versions=dict(python=platform.python_version(), torch=torch.__version__,
                                    transformers=transformers.__version__, torchao=torchao_version),
                      model=CONFIG, run=dict(steps=args.steps, batch=BATCH, seq=SEQ, lr=LR, seeds=args.seeds,
                                             compute="fp32 parameters, autocast bf16",
                                             backend="reference" if device.type == "cpu" else "triton"),
                      mean=mean, seeds=seeds)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if all(math.isfinite(c[-1]) for s in seeds for c in s["curves"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
