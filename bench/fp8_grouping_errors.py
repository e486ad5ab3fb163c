"""Which scale grouping of which FP8 operand sets the gradient error, at which point of training? (CPU)

    PYTHONPATH=. python bench/fp8_grouping_errors.py [--steps 0 60 150] [--seed 1] [--out FILE]

The model and data of ``bench/fp8_loss_curve.py``, trained in bf16 (autocast) for each of ``--steps``; at each
point, on the next batch, every projection's gradient against the float64 model's, with each projection an
emulated FP8 linear: its six operand quantizations (``x`` and ``W`` for the forward, ``dY`` and ``W`` for the input
gradient, ``dY`` and ``x`` along the tokens for the weight gradient) each in groups of its own shape, e4m3 codes
with scale ``amax / 448``, products in fp32. Groupings: codagen's blockwise recipe, all-rowwise (torchao's shapes,
without its power-of-two scales), and the blockwise recipe with one operand's grouping changed at a time.
Reported: the median and largest relative gradient error (in the norm) per grouping and step.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
import transformers

from bench.fp8_loss_curve import BATCH, CONFIG, SEQ, train
from codagen.demo import CharTokenizer, batches, make_corpus

G = 128
#: grouping name -> operand -> (rows, columns) of one scale group (None: the whole dimension)
GROUPINGS = {
    "blockwise (codagen)": dict(x=(1, G), w=(G, G), gy=(1, G), wt=(G, G), gyw=(G, 1), xw=(G, 1)),
    "rowwise (torchao's shapes)": dict(x=(1, None), w=(1, None), gy=(1, None), wt=(None, 1), gyw=(None, 1),
                                       xw=(None, 1)),
    "blockwise, W per row / per column": dict(x=(1, G), w=(1, None), gy=(1, G), wt=(None, 1), gyw=(G, 1),
                                              xw=(G, 1)),
    "blockwise, W 1 x 128 / 128 x 1": dict(x=(1, G), w=(1, G), gy=(1, G), wt=(G, 1), gyw=(G, 1), xw=(G, 1)),
    "blockwise, weight-gradient operands per column": dict(x=(1, G), w=(G, G), gy=(1, G), wt=(G, G),
                                                           gyw=(None, 1), xw=(None, 1)),
    "blockwise, dY per row": dict(x=(1, G), w=(G, G), gy=(1, None), wt=(G, G), gyw=(G, 1), xw=(G, 1)),
}


def quantized(x: torch.Tensor, rows: int | None, cols: int | None) -> torch.Tensor:
    """``x`` [M, K] through e4m3 with one scale per ``rows x cols`` group, back in fp32."""
    m, k = x.shape
    rows, cols = rows or m, cols or k
    padded = torch.nn.functional.pad(x.float(), (0, -k % cols, 0, -m % rows))
    groups = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    scale = groups.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12) / 448
    codes = (groups / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (codes.float() * scale).reshape(padded.shape)[:m, :k]


class EmulatedFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, grouping):
        ctx.save_for_backward(x, weight)
        ctx.grouping = grouping
        return (quantized(x, *grouping["x"]) @ quantized(weight, *grouping["w"]).t()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        g = ctx.grouping
        grad_x = quantized(grad_y, *g["gy"]) @ quantized(weight, *g["wt"])
        grad_w = quantized(grad_y, *g["gyw"]).t() @ quantized(x, *g["xw"])
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


def emulated(model: torch.nn.Module, grouping: dict) -> torch.nn.Module:
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                def forward(x, module=module):
                    y = EmulatedFp8Linear.apply(x.reshape(-1, x.shape[-1]), module.weight, grouping)
                    return y.reshape(*x.shape[:-1], y.shape[-1])
                module.forward = forward
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 60, 150])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    text = make_corpus(400_000, seed=args.seed)
    data = CharTokenizer(text).encode(text)
    records = []
    for steps in args.steps:
        torch.manual_seed(args.seed)
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=len(set(text)), **CONFIG))
        if steps:
            train(base, data, steps, args.seed, torch.device("cpu"))
        inputs, targets = list(batches(data, BATCH, SEQ, steps + 1, args.seed, "cpu"))[-1]

        def gradients(model):
            model(input_ids=inputs, labels=targets, shift_labels=targets.contiguous()).loss.backward()
            return {n: p.grad.double() for n, p in model.named_parameters() if "proj" in n}
        exact = gradients(copy.deepcopy(base).double())
        for name, grouping in GROUPINGS.items():
            got = gradients(emulated(copy.deepcopy(base).bfloat16(), grouping))
            errors = [((got[n] - g).norm() / g.norm()).item() for n, g in exact.items()]
            record = dict(step=steps, grouping=name, median=statistics.median(errors), max=max(errors))
            records.append(record)
            print(f"step {steps:4d}  {name:48s} median {record['median']:.3f}  max {record['max']:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(question=__doc__.splitlines()[0], model=CONFIG, seed=args.seed, torch=torch.__version__,
                           records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
