"""Argument validation for the public ops: every error names the argument and what was expected."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

from codagen.epilogue.library import ACTIVATIONS

from ._quantized import GROUP, Quantized
from .low_rank import LowRank

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of row statistics (rstd): float32, or float64 for float64 activations (the test oracle)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Like(NamedTuple):
    """The argument whose dtype and device the others must match, by its name in the op's signature."""
    name: str
    tensor: torch.Tensor


def tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _shape(name: str, t: torch.Tensor, shape: tuple, desc: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {desc} = {tuple(shape)}, got {tuple(t.shape)}")


def _dtype(name: str, t: torch.Tensor, like: Like) -> None:
    if t.dtype != like.tensor.dtype:
        raise ValueError(f"{name}: expected dtype {like.tensor.dtype} (that of {like.name}), got {t.dtype}")


def _device(name: str, t: torch.Tensor, like: Like) -> None:
    if t.device != like.tensor.device:
        raise ValueError(f"{name}: expected device {like.tensor.device} (that of {like.name}), got {t.device}")


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())} for shape "
                         f"{tuple(t.shape)}; call .contiguous() first")


def activation(name: str, t, *, cols: int | None = None, rows: int | None = None, like: Like | None = None,
               desc: str = "[tokens, features]") -> torch.Tensor:
    """A 2-D contiguous float matrix; ``like`` fixes its dtype and device."""
    t = tensor(name, t)
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor {desc} (flatten batch and sequence first), "
                         f"got shape {tuple(t.shape)}")
    if t.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name}: expected one of {[str(d) for d in ACTIVATION_DTYPES]}, got {t.dtype}")
    if like is not None:
        _dtype(name, t, like)
        _device(name, t, like)
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} rows {desc}, got shape {tuple(t.shape)}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name}: expected {cols} columns {desc}, got shape {tuple(t.shape)}")
    _contiguous(name, t)
    return t


def weight(name: str, t, shape: tuple, desc: str, like: Like, *, even_rows: bool = False) -> torch.Tensor:
    """A contiguous weight matrix of the activations' dtype and device; ``None`` in ``shape`` matches any size."""
    t = tensor(name, t)
    _dtype(name, t, like)
    _device(name, t, like)
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        shown = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name}: expected shape {desc} = {shown}, got {tuple(t.shape)}")
    if even_rows and t.shape[0] % 2:
        raise ValueError(f"{name}: expected an even number of rows (adjacent column pairs), got shape {tuple(t.shape)}")
    _contiguous(name, t)
    return t


def vector(name: str, t, length: int, desc: str, like: Like, *, dtypes=None) -> torch.Tensor:
    """A contiguous 1-D float vector (norm weight, frequencies); ``dtypes`` narrows the accepted dtypes."""
    t = tensor(name, t)
    _shape(name, t, (length,), desc)
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if dtypes is None and not t.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating-point vector, got {t.dtype}")
    _device(name, t, like)
    _contiguous(name, t)
    return t


def rstd(name: str, t, like: Like) -> torch.Tensor:
    """rstd [M] in the statistics dtype of the activations (float32; float64 for float64 ones)."""
    x = like.tensor
    return vector(name, t, x.shape[0], "[tokens]", like, dtypes=(stats_dtype(x.dtype),))


def normed(name: str, t, like: Like, *, fp8: bool = False) -> torch.Tensor | Quantized:
    """A norm's ``normed`` output: ``like``'s shape, dtype and device; with ``fp8`` also a :class:`Quantized` one, e4m3
    codes of that shape with fp32 scales per row and 128 columns (what an FP8 producer op returns)."""
    if not isinstance(t, Quantized):
        t = activation(name, t, like=like)
        _shape(name, t, tuple(like.tensor.shape), f"{like.name}.shape")
        return t
    if not fp8:
        raise ValueError(f"{name}: an e4m3 {name} (codagen.ops._fp8.Quantized, an FP8 op's output) needs fp8=True")
    codes, scale = (tensor(f"{name}.{field}", v) for field, v in zip(Quantized._fields, t))
    m, d = like.tensor.shape
    if codes.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise ValueError(f"{name}: expected e4m3 codes and float32 scales, got {codes.dtype} and {scale.dtype}")
    _shape(f"{name}.codes", codes, (m, d), f"{like.name}.shape")
    _shape(f"{name}.scale", scale, (m, -(-d // GROUP)), f"[tokens, cdiv({like.name} features, {GROUP})]")
    for field, v in zip(Quantized._fields, t):
        _device(f"{name}.{field}", v, like)
        _contiguous(f"{name}.{field}", v)
    return t


INDEX_DTYPES = (torch.int32, torch.int64)


def index_vector(name: str, t, length: int, like: Like, *, allow_float: bool = False) -> torch.Tensor:
    """A 1-D int32/int64 vector [tokens] (targets, positions); positions may also be float."""
    t = tensor(name, t)
    _shape(name, t, (length,), "[tokens]")
    if not (t.dtype in INDEX_DTYPES or allow_float and t.dtype.is_floating_point):
        kind = "an int32, int64 or float" if allow_float else "an int32 or int64"
        raise ValueError(f"{name}: expected {kind} vector, got {t.dtype}")
    _device(name, t, like)
    _contiguous(name, t)
    return t


def reads_values(t: torch.Tensor) -> bool:
    """Whether a check may read ``t``'s values on the host: a real CPU tensor outside ``torch.compile``
    (elsewhere reading them is a host sync, or impossible)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and not is_fake(t)


def index_range(name: str, t: torch.Tensor, high: int, ignore_index: int | None = None) -> None:
    """Every value of ``t`` in ``[0, high)`` (or equal to ``ignore_index``), checked without a host sync on
    CUDA: a CPU tensor raises ``ValueError`` here; a CUDA one (or any under ``torch.compile``, or a fake one) gets a
    device-side assert (as ``F.embedding`` and ``F.cross_entropy`` do there), which surfaces at the next
    synchronization as a CUDA error (a ``RuntimeError`` with this message on CPU)."""
    if t.numel() == 0:
        return
    bad = (t < 0) | (t >= high)
    if ignore_index is not None:
        bad &= t != ignore_index
    if not reads_values(t):
        torch._assert_async(~bad.any(), f"{name}: values must lie in [0, {high})")
        return
    if bool(bad.any()):
        allowed = f"[0, {high})" + (f" or ignore_index = {ignore_index}" if ignore_index is not None else "")
        first = t[bad][:4].tolist()
        raise ValueError(f"{name}: expected values in {allowed}, got {first}"
                         f"{' and more' if int(bad.sum()) > len(first) else ''}")


def eps(value, name: str = "eps") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: expected a positive float, got {value!r}")
    return float(value)


def gated_activation(name: str, value) -> str:
    """The MLP's gated activation by name: one of ``codagen.epilogue.library.ACTIVATIONS``."""
    allowed = " or ".join(repr(a) for a in ACTIVATIONS)
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected {allowed}, got {value!r}")
    if value not in ACTIVATIONS:
        raise ValueError(f"{name}: expected {allowed}, got {value!r}")
    return value


def softcap(value, name: str = "softcap") -> float | None:
    """A logit soft-cap ``cap`` (``cap * tanh(logits / cap)``, Gemma 2's ``final_logit_softcapping``) or None:
    a positive finite float."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected None or a positive finite float, got {value!r}")
    if not 0 < value < math.inf:
        raise ValueError(f"{name}: expected None or a positive finite float, got {value!r}")
    return float(value)


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def split_sizes(name: str, value, total: int, expected: tuple[int, int, int] | None = None):
    """``value`` as a tuple of three positive even ints summing to ``total`` (exactly ``expected`` when
    given), or None."""
    if value is None:
        return None
    sizes = tuple(value) if isinstance(value, (tuple, list)) else ()
    if (len(sizes) != 3 or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 and c % 2 == 0
                                   for c in sizes) or sum(sizes) != total
            or (expected is not None and sizes != expected)):
        want = (f"q, k, v column counts {expected}" if expected is not None
                else f"three even column counts summing to {total} (qkv_weight's rows)")
        raise ValueError(f"{name}: expected {want}, got {value!r}")
    return sizes


def head_vector(name: str, t, like: Like) -> torch.Tensor:
    """A per-head-channel weight [head_dim] (QK-norm), head_dim even (whole RoPE pairs)."""
    t = tensor(name, t)
    if t.dim() != 1 or t.shape[0] < 2 or t.shape[0] % 2:
        raise ValueError(f"{name}: expected a vector [head_dim] with an even head_dim, got shape {tuple(t.shape)}")
    return vector(name, t, t.shape[0], "[head_dim]", like)


def low_rank(name: str, value, in_features: int, out_features: int, like: Like) -> LowRank | None:
    """A :class:`LowRank` update of a ``[out_features, in_features]`` weight (or None): ``a`` [r, in],
    ``b`` [out, r] contiguous, of the activations' dtype and device, ``scale`` a finite float."""
    if value is None:
        return None
    if not isinstance(value, LowRank):
        raise TypeError(f"{name}: expected a codagen.ops.LowRank(a, b, scale) or None, got {type(value).__name__}")
    a = weight(f"{name}.a", value.a, (None, in_features), "[r, in features]", like)
    r = a.shape[0]
    if r < 1:
        raise ValueError(f"{name}.a: expected a rank r >= 1, got shape {tuple(a.shape)}")
    weight(f"{name}.b", value.b, (out_features, r), f"[out features, r] with r = {r} (a's rows)", like)
    scale = value.scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale or abs(scale) == float("inf"):
        raise ValueError(f"{name}.scale: expected a finite float, got {scale!r}")
    return value
