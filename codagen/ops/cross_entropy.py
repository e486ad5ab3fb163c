"""Final RMSNorm + LM head + cross-entropy, fused, never materializing fp32 logits.

Forward, per chunk of tokens: one GEMM ``z = rstd[m] * (normed @ W^T)`` whose epilogue keeps per-tile
partial logsumexps and picks the target logit (``rms_lm_head_cross_entropy``); finished:
``lse[m] = logsumexp_t(partial_lse)``, ``loss[m] = lse[m] - z[m, target[m]]``. No logits are stored.

Backward, per chunk: the GEMM recomputes ``z`` and writes ``grad_logits = (softmax(z) - onehot(target)) *
row_weight * grad_loss`` in the activation dtype plus partials of ``sum z dz``
(``rms_lm_head_cross_entropy_backward``); then the RMSNorm-backward GEMM ``grad_logits @ W`` (fills the
chunk's rows of ``grad_x``, the norm-weight partials and ``n = RMSNorm(x)``) and ``grad_W += grad_logits^T @ n``.
Chunking bounds the only vocabulary-sized buffer, ``grad_logits``, to :data:`CHUNK_BYTES`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from codagen.backends import execute
from codagen.epilogue import finish, library

from . import _checks as check
from ._checks import stats_dtype

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


@torch.library.custom_op("codagen::rms_lm_head_cross_entropy", mutates_args=())
def _ce_op(normed: Tensor, rstd: Tensor, lm_head_weight: Tensor, target: Tensor, ignore_index: int, mean: bool,
           rows_per_chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    m = normed.shape[0]
    cd = stats_dtype(normed.dtype)
    lse = normed.new_empty(m, dtype=cd)
    target_logit = normed.new_empty(m, dtype=cd)
    for start in range(0, m, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        out = execute(library.rms_lm_head_cross_entropy(), normed[rows], lm_head_weight, rstd=rstd[rows],
                      target=target[rows])
        lse[rows] = finish.logsumexp_from_partials(out["partial_lse"])
        target_logit[rows] = finish.sum_row_partials(out["partial_target"])
    valid = target != ignore_index
    row_weight = valid.to(cd)
    if mean:  # a device tensor: no host sync; all targets ignored gives nan, as torch's cross_entropy does
        row_weight = row_weight / row_weight.sum()
    loss = (row_weight * torch.where(valid, lse - target_logit, 0.0)).sum()
    return loss, lse, row_weight


@_ce_op.register_fake
def _(normed, rstd, lm_head_weight, target, ignore_index, mean, rows_per_chunk):
    cd = stats_dtype(normed.dtype)
    m = normed.shape[0]
    return normed.new_empty((), dtype=cd), normed.new_empty(m, dtype=cd), normed.new_empty(m, dtype=cd)


@torch.library.custom_op("codagen::rms_lm_head_cross_entropy_backward", mutates_args=())
def _ce_backward_op(grad_loss: Tensor, x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor,
                    lm_head_weight: Tensor, target: Tensor, lse: Tensor, row_weight: Tensor,
                    rows_per_chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    m, d = x.shape
    cd = stats_dtype(x.dtype)
    grad_x = torch.zeros_like(x)  # each chunk accumulates into its own rows
    grad_norm_weight = norm_weight.new_zeros(d, dtype=cd)
    # several chunks accumulate grad_W: keep it in fp32 then (one rounding to the weight dtype at the end)
    several = rows_per_chunk < m
    wide = several and lm_head_weight.dtype in (torch.float16, torch.bfloat16)
    grad_weight = None
    for start in range(0, m, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        ce = execute(library.rms_lm_head_cross_entropy_backward(), normed[rows], lm_head_weight, rstd=rstd[rows],
                     lse=lse[rows], target=target[rows], row_weight=row_weight[rows], grad_scale=grad_loss)
        mean_z_dz = finish.sum_row_partials(ce["partial_z_dz"]) / d
        norm = execute(library.rms_norm_backward("accumulate"), ce["grad_logits"], lm_head_weight, residual=x[rows],
                       rstd=rstd[rows], norm_weight=norm_weight, mean_z_dz=mean_z_dz, grad_residual=grad_x[rows])
        grad_norm_weight += finish.sum_col_partials(norm["partial_grad_norm_weight"])
        if grad_weight is None:
            grad_weight = execute(library.weight_grad(dtype="float32" if wide else "input"), ce["grad_logits"],
                                  norm["normed"])["grad_weight"]
        else:
            execute(library.weight_grad(accumulate=True), ce["grad_logits"], norm["normed"], grad_weight=grad_weight)
    if grad_weight is None:  # no tokens
        grad_weight = torch.zeros_like(lm_head_weight)
    return grad_x, grad_norm_weight.to(norm_weight.dtype), grad_weight.to(lm_head_weight.dtype)


@_ce_backward_op.register_fake
def _(grad_loss, x, normed, rstd, norm_weight, lm_head_weight, target, lse, row_weight, rows_per_chunk):
    return torch.empty_like(x), torch.empty_like(norm_weight), torch.empty_like(lm_head_weight)


class _RmsLmHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normed, rstd, norm_weight, lm_head_weight, target, ignore_index, mean, rows_per_chunk):
        loss, lse, row_weight = _ce_op(normed, rstd, lm_head_weight, target, ignore_index, mean, rows_per_chunk)
        ctx.save_for_backward(x, normed, rstd, norm_weight, lm_head_weight, target, lse, row_weight)
        ctx.rows_per_chunk = rows_per_chunk
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_norm_weight, grad_weight = _ce_backward_op(grad_loss.contiguous(), *ctx.saved_tensors,
                                                                ctx.rows_per_chunk)
        return grad_x, None, None, grad_norm_weight, grad_weight, None, None, None, None


def rms_lm_head_cross_entropy(x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor, lm_head_weight: Tensor,
                              target: Tensor, *, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """``cross_entropy(RMSNorm(x) @ lm_head_weight^T, target)`` without storing logits.

    ``loss = sum_m w[m] (lse[m] - z[m, target[m]])`` with ``w[m] = 0`` where ``target[m] == ignore_index``,
    else 1 (``"sum"``) or ``1 / #non-ignored`` (``"mean"``, a device tensor: no host sync). The loss is
    float32 (float64 for float64 inputs). Targets outside ``[0, vocab)`` other than ``ignore_index`` are
    not detected (that would need a host sync) and contribute ``lse``.

    Saved: ``x``, ``normed``, ``rstd``, ``lse`` [M], ``row_weight`` [M]; the logits are recomputed chunk
    by chunk in backward.
    """
    x = check.activation("x", x)
    m, d = x.shape
    normed = check.normed("normed", normed, x)
    rstd = check.rstd("rstd", rstd, x)
    norm_weight = check.vector("norm_weight", norm_weight, d, "[features]", x)
    lm_head_weight = check.weight("lm_head_weight", lm_head_weight, (None, d), "[vocab, features]", x)
    target = check.index_vector("target", target, m, x)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index: expected an int, got {ignore_index!r}")
    rows = chunk_rows(m, lm_head_weight.shape[0], x.element_size())
    return _RmsLmHeadCrossEntropy.apply(x, normed.detach(), rstd.detach(), norm_weight, lm_head_weight,
                                        target.detach(), ignore_index, reduction == "mean", rows)
