"""A fused op's GEMM in FP8: any library program on e4m3 operands with blockwise scales.

The recipe is DeepSeek-V3's (``docs/notes/fp8-quantizing-epilogue.md``): every operand is quantized in groups of
:data:`GROUP` along the GEMM's K, a weight in ``GROUP x GROUP`` blocks (one quantization serves ``x @ W^T`` and
``dY @ W``). :func:`blockwise` quantizes ``a`` and ``b`` by the quantize kernel (:func:`codagen.ops.kernels.
quantize_groups`) and runs ``program.with_blockwise_scales``: the K loop scales each group's product into the fp32
accumulator, and the epilogue (the norm's ``rstd``, RoPE, SwiGLU, the residual add, the next norm's statistics)
sees the dequantized product, as in bf16. What the program stores as ``"input"`` is bf16.

Which axis is K follows from the program's layouts: the columns of an ``"mk"`` A or ``"nk"`` B, the rows (the
tokens, in a weight gradient) of a ``"km"`` A or ``"kn"`` B.

An operand reaches the GEMM through one quantize launch, unless the GEMM that produced it stored it quantized
(``Program.with_quantized_store``, a :class:`Quantized` operand here). The block ops' backward does that where
producer and reader are in one op: the recomputed normed input of each norm consumer and the recomputed SwiGLU
output are stored in e4m3 along the tokens, as the weight gradients read them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from codagen.backends import execute
from codagen.epilogue import Program

from . import kernels
from ._quantized import GROUP, Quantized

__all__ = ["GROUP", "RECIPES", "Quantized", "blockwise", "check_fp8", "checked_recipe", "op_operand",
           "consumer_operand"]

#: the FP8 recipes a model takes (``codagen.patch(model, fp8=...)``, ``LlamaConfig.fp8``): ``"blockwise"``,
#: DeepSeek-V3's scaling. A rowwise scale (torchao's ``"rowwise"``) needs a row's amax over every column before any
#: element is rounded, which no GEMM's epilogue has (``docs/notes/fp8-quantizing-epilogue.md``).
RECIPES = ("blockwise",)


def checked_recipe(fp8) -> str | None:
    """A model's ``fp8`` setting: None (no FP8) or one of :data:`RECIPES`."""
    if fp8 is None or fp8 in RECIPES:
        return fp8
    if fp8 == "rowwise":
        raise ValueError("fp8: 'rowwise' scales need each row's amax over all its columns before any element is "
                         "rounded, which a GEMM epilogue does not have; codagen's recipe is 'blockwise' (groups of 128 "
                         "along K, 128 x 128 weight blocks: docs/notes/fp8-quantizing-epilogue.md)")
    raise ValueError(f"fp8: expected None or one of {list(RECIPES)}, got {fp8!r}")


def blockwise(program: Program, a: Tensor | Quantized, b: Tensor | Quantized, *, b_block: bool,
              **tensors: Tensor) -> dict[str, Tensor]:
    """``execute(program, a, b, **tensors)`` on e4m3 ``a`` and ``b`` scaled per group of :data:`GROUP` along K;
    ``b_block``: ``b`` is a weight, quantized in ``GROUP x GROUP`` blocks. An operand given as :class:`Quantized`
    is taken as it is (an epilogue stored it so); the others are quantized here, one launch each."""
    gemm = program.gemm
    a_codes, a_scale = _quantized(a, "n" if gemm.a_layout == "mk" else "m")
    b_codes, b_scale = _quantized(b, "blocks" if b_block else "n" if gemm.b_layout == "nk" else "m")
    return execute(program.with_blockwise_scales(GROUP, b_block=b_block), a_codes, b_codes, a_scale=a_scale,
                   b_scale=b_scale, **tensors)


def op_operand(normed: Tensor | Quantized) -> tuple[Tensor, Tensor | None]:
    """A consumer's ``normed`` as its custom ops take it: ``(normed, None)``, or for a :class:`Quantized` one its codes
    as their bits (uint8: the ops' schema checks cannot compare float8 on CPU) and its scales."""
    if isinstance(normed, Quantized):
        return normed.codes.view(torch.uint8), normed.scale
    return normed, None


def consumer_operand(normed: Tensor, normed_scale: Tensor | None) -> Tensor | Quantized:
    """Inside a custom op, the inverse of :func:`op_operand`: the GEMM's A operand."""
    if normed_scale is None:
        return normed
    return Quantized(normed.view(torch.float8_e4m3fn), normed_scale)


def _quantized(operand: Tensor | Quantized, along: str) -> Quantized:
    if isinstance(operand, Quantized):
        return operand
    return Quantized(*kernels.quantize_groups(operand, GROUP, along))


def check_fp8(fp8, x: Tensor, low_rank) -> bool:
    """A block op's ``fp8`` argument: a bool; with it, ``x`` is bf16 (the FP8 GEMMs store bf16) and no low-rank
    update is given (the low-rank operand pair has no FP8 form)."""
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8: expected a bool, got {type(fp8).__name__}")
    if fp8 and isinstance(x, Tensor) and x.dtype != torch.bfloat16:  # a non-tensor x: the op's own check names it
        raise ValueError(f"fp8: FP8 GEMMs store bfloat16 activations, so x must be torch.bfloat16, got {x.dtype}")
    if fp8 and low_rank is not None:
        raise NotImplementedError("fp8: a low-rank update (LoRA) with FP8 GEMMs is not supported yet")
    return fp8
