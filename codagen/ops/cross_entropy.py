"""Final RMSNorm + LM head + cross-entropy, fused, never materializing fp32 logits.

Training (an input needs a gradient): the gradient is computed in the forward pass, one chunk of tokens
at a time, so each logit is made once and never recomputed (the order of Liger-Kernel's fused linear
cross-entropy):

1. ``z = rstd[m] * (normed @ W^T)``, the chunk's logits in the activation dtype (program ``rms_linear``);
2. one row kernel (:func:`codagen.ops.kernels.cross_entropy_logits_grad`): ``lse``, each row's loss
   ``lse - z[target]`` and, over ``z`` in place, ``dz = (softmax(z) - onehot(target)) * row_weight`` with
   the RMSNorm-backward statistic ``mean_z_dz = sum z dz / d``;
3. the RMSNorm-backward GEMM ``dz @ W`` (fills the chunk's rows of ``grad_x``, the norm-weight partials
   and ``n = RMSNorm(x)``) and ``grad_W (+)= dz^T @ n``.

Backward only scales the three saved gradients by the incoming loss gradient
(:func:`codagen.ops.kernels.scale_cast`: one kernel each, fp32 product, one rounding). The loss is then PyTorch's
low-precision computation: logits rounded to the activation dtype, the rest in fp32.

Evaluation (no gradient): one GEMM per chunk whose epilogue keeps per-tile partial logsumexps of the
fp32 logits and picks the target logit (``rms_lm_head_cross_entropy``); finished in one launch
(:func:`codagen.ops.kernels.finish_cross_entropy`): ``loss[m] = logsumexp_t(partial_lse) - z[m, target[m]]``.
No logits are stored.

Chunking bounds the only vocabulary-sized buffer, one chunk of logits, to :data:`CHUNK_BYTES`. Its rows are whole
16-byte units: step 3's GEMMs read it as an operand, and TMA (with the 16-byte vectors of the pointer-load path)
needs aligned row strides, which a vocabulary such as Granite's 49155 does not give. Training then runs steps 1 and 3
on the weight padded with zero rows (:func:`padded_head`): those columns' logits are 0, and so is what they add.

With a soft-cap (Gemma 2's ``final_logit_softcapping``) the loss is that of ``y = cap * tanh(z / cap)``. Training
stores the uncapped ``z`` (step 1 unchanged) and the row kernel caps it as it reads it: its ``dz`` is the
gradient of ``z`` (``dy * (1 - tanh(z / cap)^2)``) and its statistic ``sum z dz``, what step 3 needs.
Evaluation runs ``rms_lm_head_cross_entropy_softcap``, whose epilogue caps the fp32 logits.
"""
from __future__ import annotations

import torch
from torch import Tensor

from codagen.backends import execute
from codagen.epilogue import library

from . import _checks as check
from . import kernels
from ._checks import stats_dtype
from ._custom_op import custom_op, named_gradients

__all__ = ["rms_lm_head_cross_entropy", "CHUNK_BYTES", "chunk_rows"]

#: byte budget of one chunk's ``grad_logits`` [rows, vocab] in the activation dtype
CHUNK_BYTES = 512 * 2**20


def chunk_rows(tokens: int, vocab: int, element_size: int, budget: int | None = None) -> int:
    """Tokens per chunk so that ``rows * vocab * element_size <= budget`` (multiple of 128 when large)."""
    budget = CHUNK_BYTES if budget is None else budget
    rows = max(1, budget // max(1, vocab * element_size))
    if rows >= 256:
        rows -= rows % 128  # whole M-tiles per chunk
    return max(1, min(rows, tokens))


def _row_weight(target: Tensor, ignore_index: int, mean: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(valid, row_weight): 0 on ignored rows, else 1 (sum) or 1 / #valid (mean: a device tensor, no host
    sync; with no valid row every weight is 0, so the gradients are zeros: :func:`_reduce` makes the loss
    nan)."""
    valid = target != ignore_index
    row_weight = valid.to(dtype)
    if mean:
        row_weight = row_weight / row_weight.sum().clamp_min(1)
    return valid, row_weight


def _reduce(row_loss: Tensor, valid: Tensor, row_weight: Tensor, mean: bool) -> Tensor:
    """``sum_m row_weight[m] row_loss[m]`` over the valid rows; a mean over no valid row is nan (as
    torch's cross_entropy)."""
    loss = (row_weight * torch.where(valid, row_loss, 0.0)).sum()
    return torch.where(valid.any(), loss, float("nan")) if mean else loss


@custom_op("rms_lm_head_cross_entropy", fake=lambda normed, **_: normed.new_empty((), dtype=stats_dtype(normed.dtype)))
def _ce_op(normed: Tensor, rstd: Tensor, lm_head_weight: Tensor, target: Tensor, ignore_index: int, mean: bool,
           rows_per_chunk: int, softcap: float | None) -> Tensor:
    """The loss alone: fused epilogue partials, no logits stored."""
    m = normed.shape[0]
    cd = stats_dtype(normed.dtype)
    row_loss = normed.new_empty(m, dtype=cd)
    for start in range(0, m, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        out = execute(library.rms_lm_head_cross_entropy(softcap), normed[rows], lm_head_weight, rstd=rstd[rows],
                      target=target[rows])
        row_loss[rows] = kernels.finish_cross_entropy(out["partial_lse"], out["partial_target"])
    valid, row_weight = _row_weight(target, ignore_index, mean, cd)
    return _reduce(row_loss, valid, row_weight, mean)


def padded_head(lm_head_weight: Tensor, logits_dtype: torch.dtype) -> Tensor:
    """``lm_head_weight`` [V, d] with zero rows appended so that a row of logits in ``logits_dtype`` fills whole
    16-byte units (itself when it does already; one copy of the weight otherwise)."""
    per_unit = max(1, 16 // torch.empty((), dtype=logits_dtype).element_size())
    missing = -lm_head_weight.shape[0] % per_unit
    return lm_head_weight if missing == 0 else torch.nn.functional.pad(lm_head_weight, (0, 0, 0, missing))


def _accumulates_wide(m: int, rows_per_chunk: int, lm_head_weight: Tensor) -> bool:
    """Several chunks accumulate grad_W: keep it in fp32 then (one rounding, in backward)."""
    return rows_per_chunk < m and lm_head_weight.dtype in (torch.float16, torch.bfloat16)


def _fake_ce_with_grad(x, norm_weight, lm_head_weight, rows_per_chunk, weight_grad, **_):
    cd = stats_dtype(x.dtype)
    wide = _accumulates_wide(x.shape[0], rows_per_chunk, lm_head_weight)
    grad_weight = (torch.empty_like(lm_head_weight, dtype=torch.float32 if wide else None) if weight_grad
                   else lm_head_weight.new_empty(0))
    return (x.new_empty((), dtype=cd), torch.empty_like(x), norm_weight.new_empty(norm_weight.shape, dtype=cd),
            grad_weight)


@custom_op("rms_lm_head_cross_entropy_with_grad", fake=_fake_ce_with_grad)
def _ce_with_grad_op(x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor, lm_head_weight: Tensor,
                     target: Tensor, ignore_index: int, mean: bool, rows_per_chunk: int, weight_grad: bool,
                     softcap: float | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, grad_x, grad_norm_weight, grad_weight)`` for a loss gradient of 1 (module docstring, steps 1-3).

    ``grad_norm_weight`` is fp32 (the stats dtype), ``grad_weight`` fp32 when chunks accumulate it: the
    backward rounds them once, after scaling. Without ``weight_grad`` (a frozen head) no weight-gradient
    GEMM runs and ``grad_weight`` is an empty tensor."""
    m, d = x.shape
    cd = stats_dtype(x.dtype)
    valid, row_weight = _row_weight(target, ignore_index, mean, cd)
    row_loss = x.new_empty(m, dtype=cd)
    grad_x = torch.zeros_like(x)  # each chunk accumulates into its own rows
    grad_norm_weight = norm_weight.new_zeros(d, dtype=cd)
    wide = weight_grad and _accumulates_wide(m, rows_per_chunk, lm_head_weight)
    vocab = lm_head_weight.shape[0]
    head = padded_head(lm_head_weight, x.dtype)  # aligned rows of logits (module docstring)
    grad_weight = None
    for start in range(0, m, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        grad_logits = execute(library.rms_linear(), normed[rows], head, rstd=rstd[rows])["out"]
        row_loss[rows], mean_z_dz = kernels.cross_entropy_logits_grad(grad_logits[:, :vocab], target[rows],
                                                                      row_weight[rows], d, softcap)
        norm = execute(library.rms_norm_backward("accumulate"), grad_logits, head, residual=x[rows],
                       rstd=rstd[rows], norm_weight=norm_weight, mean_z_dz=mean_z_dz, grad_residual=grad_x[rows])
        grad_norm_weight += kernels.finish_col_sum(norm["partial_grad_norm_weight"], cd)
        if not weight_grad:
            continue
        if grad_weight is None:
            grad_weight = execute(library.weight_grad(dtype="float32" if wide else "input"), grad_logits,
                                  norm["normed"])["grad_weight"]
        else:
            execute(library.weight_grad(accumulate=True), grad_logits, norm["normed"], grad_weight=grad_weight)
    if not weight_grad:
        grad_weight = lm_head_weight.new_empty(0)
    elif grad_weight is None:  # no tokens
        grad_weight = torch.zeros_like(lm_head_weight)
    else:
        grad_weight = grad_weight[:vocab]  # the padded rows' gradients, zeros, dropped (a contiguous view)
    return _reduce(row_loss, valid, row_weight, mean), grad_x, grad_norm_weight, grad_weight


@custom_op("scale_cast", fake=lambda src, dtype, **_: src.new_empty(src.shape, dtype=dtype))
def _scale_cast_op(src: Tensor, factor: Tensor, dtype: torch.dtype) -> Tensor:
    return kernels.scale_cast(src, factor, dtype)


class _RmsLmHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normed, rstd, norm_weight, lm_head_weight, target, ignore_index, mean, rows_per_chunk,
                with_grad, softcap):
        if not with_grad:
            return _ce_op(normed, rstd, lm_head_weight, target, ignore_index, mean, rows_per_chunk, softcap)
        weight_grad = lm_head_weight.requires_grad
        loss, grad_x, grad_norm_weight, grad_weight = _ce_with_grad_op(
            x, normed, rstd, norm_weight, lm_head_weight, target, ignore_index, mean, rows_per_chunk, weight_grad,
            softcap)
        ctx.save_for_backward(grad_x, grad_norm_weight, grad_weight if weight_grad else None)
        ctx.dtypes = (x.dtype, norm_weight.dtype, lm_head_weight.dtype)
        return loss

    @staticmethod
    @named_gradients(forward)
    def backward(ctx, _needs, grad_loss):
        # every gradient is linear in the loss gradient: scaled in fp32, rounded once (one kernel each)
        grad_x, grad_norm_weight, grad_weight = (None if g is None else _scale_cast_op(g, grad_loss, dtype)
                                                 for g, dtype in zip(ctx.saved_tensors, ctx.dtypes))
        return dict(x=grad_x, norm_weight=grad_norm_weight, lm_head_weight=grad_weight)


def rms_lm_head_cross_entropy(x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor, lm_head_weight: Tensor,
                              target: Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                              softcap: float | None = None) -> Tensor:
    """``cross_entropy(RMSNorm(x) @ lm_head_weight^T, target)`` without storing logits.

    ``loss = sum_m w[m] (lse[m] - z[m, target[m]])`` with ``w[m] = 0`` where ``target[m] == ignore_index``,
    else 1 (``"sum"``) or ``1 / #non-ignored`` (``"mean"``, a device tensor: no host sync). The loss is
    float32 (float64 for float64 inputs). ``"mean"`` over no counted target (no tokens, or all ignored) is
    nan, as in torch, and the gradients are zeros (a fully padded micro-batch leaves the weights alone).
    ``target``: int32 or int64, each in ``[0, vocab)`` or ``ignore_index``; any other value raises
    ``ValueError`` for CPU tensors and is a device-side assert on CUDA (no host sync:
    :func:`codagen.ops._checks.index_range`).

    With gradients (training) they are computed here, in the forward pass (module docstring), and saved
    (``grad_x`` [M, d], ``grad_norm_weight``, ``grad_W``); the backward scales them by the loss gradient.
    Without (``torch.no_grad()`` or nothing requiring grad), one fused GEMM per chunk and no logits.

    ``softcap = cap`` (Gemma 2's ``final_logit_softcapping``): the loss of the capped logits ``y = cap *
    tanh(z / cap)``, ``z = RMSNorm(x) @ lm_head_weight^T``, i.e. ``cross_entropy(cap * tanh(z / cap), target)``
    (module docstring); ``lse`` and the target logit above are those of ``y``.
    """
    x = check.activation("x", x)
    like = check.Like("x", x)
    m, d = x.shape
    normed = check.normed("normed", normed, like)
    rstd = check.rstd("rstd", rstd, like)
    norm_weight = check.vector("norm_weight", norm_weight, d, "[features]", like)
    lm_head_weight = check.weight("lm_head_weight", lm_head_weight, (None, d), "[vocab, features]", like)
    target = check.index_vector("target", target, m, like)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index: expected an int, got {ignore_index!r}")
    check.index_range("target", target, lm_head_weight.shape[0], ignore_index)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
    softcap = check.softcap(softcap)
    rows = chunk_rows(m, lm_head_weight.shape[0], x.element_size())
    with_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, norm_weight, lm_head_weight))
    return _RmsLmHeadCrossEntropy.apply(x, normed.detach(), rstd.detach(), norm_weight, lm_head_weight,
                                        target.detach(), ignore_index, reduction == "mean", rows, with_grad, softcap)
