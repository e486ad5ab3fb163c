"""Cross-entropy over a chunk of stored logits: each row's loss, its gradient in place, its row statistic.

``row_loss[m] = logsumexp(z[m]) - z[m, target[m]]``; ``logits`` becomes ``dz = (softmax(z) - onehot(target))
* row_weight[m]``; ``mean_z_dz[m] = sum_k z dz / width``. One program per row, two passes over it: a
logsumexp kept per group of 8 logits, then softmax minus one-hot (``docs/notes/cross-entropy-row-kernel.md``).

With a soft-cap (Gemma 2's final logit soft-cap) the loss is that of ``y = cap * t``, ``t = tanh(z / cap)``:
``row_loss[m] = logsumexp(y[m]) - y[m, target[m]]``, ``dz = (softmax(y) - onehot(target)) * row_weight[m] * (1 -
t^2)`` and still ``mean_z_dz = sum_k z dz / width`` (z, which the norm feeds). The stored logits stay ``z``:
the kernel caps them as it reads them (with the epilogues' tanh, :func:`.softcap.softcap_tanh`).
"""
from __future__ import annotations

import torch

from .._checks import stats_dtype
from ._launch import dispatcher, launch_kernel, launcher, next_power_of_2, portable_math, tl, triton
from .softcap import softcap_tanh

__all__ = ["cross_entropy_logits_grad", "cross_entropy_logits_grad_ref", "cross_entropy_logits_grad_triton",
           "CROSS_ENTROPY_LAUNCH", "CROSS_ENTROPY_GROUP"]

#: (BLOCK, num_warps) of the row kernel (``bench/cross_entropy_rows.py``)
CROSS_ENTROPY_LAUNCH = (4096, 8)
#: logits per running max in its pass 1: 16 bytes of bf16, one thread's vector load
CROSS_ENTROPY_GROUP = 8


@triton.jit
def _cross_entropy_logits_grad_kernel(logits_ptr, target_ptr, row_weight_ptr, row_loss_ptr, mean_z_dz_ptr,
                                      n_cols, row_stride, inv_width, softcap, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                                      SOFTCAP: tl.constexpr, PORTABLE: tl.constexpr):
    """One row per program, two passes over it.

    Pass 1 keeps a running max and ``sum exp(y - max)`` per group of GROUP adjacent logits (a thread's
    own 16-byte vector): one exp per logit plus one per group, and no exchange between threads until
    the row's end. Pass 2 walks the blocks backwards, so it starts on the ones pass 1 read last (still
    in L2), and writes ``dz`` over the logits. ``y`` is ``z``, or with ``SOFTCAP`` ``softcap * tanh(z /
    softcap)``."""
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * row_stride
    inv_softcap = 1.0 / softcap
    target = tl.load(target_ptr + row)
    # an ignored (negative) target, or one past the vocabulary, has no logit
    target_logit = tl.load(logits_row + target, mask=(target >= 0) & (target < n_cols), other=0.0).to(tl.float32)
    if SOFTCAP:
        target_logit = softcap * softcap_tanh(target_logit, inv_softcap, PORTABLE)
    group_max = tl.full([BLOCK // GROUP], float("-inf"), tl.float32)
    group_sum = tl.zeros([BLOCK // GROUP], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(logits_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        if SOFTCAP:  # past the row's end -inf, not the -softcap that tanh makes of it
            z = tl.where(cols < n_cols, softcap * softcap_tanh(z, inv_softcap, PORTABLE), float("-inf"))
        z = tl.reshape(z, [BLOCK // GROUP, GROUP])
        new_max = tl.maximum(group_max, tl.max(z, axis=1))
        # shift = max where finite, else 0: no finite logit yet keeps the sum 0, a +inf one makes it +inf
        shift = tl.where(tl.abs(new_max) == float("inf"), 0.0, new_max)
        group_sum = group_sum * tl.exp(group_max - shift) + tl.sum(tl.exp(z - shift[:, None]), axis=1)
        group_max = new_max
    row_max = tl.max(group_max, axis=0)
    row_shift = tl.where(tl.abs(row_max) == float("inf"), 0.0, row_max)
    lse = row_shift + tl.log(tl.sum(group_sum * tl.exp(group_max - row_shift), axis=0))
    # pass 2: dz = (softmax(y) - onehot(target)) * row_weight [* (1 - t^2)]
    weight = tl.load(row_weight_ptr + row).to(tl.float32)
    z_dz = tl.zeros([BLOCK], dtype=tl.float32)
    last = tl.cdiv(n_cols, BLOCK) - 1
    for block in range(0, last + 1):
        cols = (last - block) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            t = softcap_tanh(z, inv_softcap, PORTABLE)
            dz = (tl.exp(softcap * t - lse) - tl.where(cols == target, 1.0, 0.0)) * weight * (1.0 - t * t)
        else:
            dz = (tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)) * weight
        z_dz += tl.where(mask, z * dz, 0.0)  # past the row's end dz = exp(-lse) may overflow
        tl.store(logits_row + cols, dz.to(logits_ptr.dtype.element_ty), mask=mask)
    tl.store(row_loss_ptr + row, lse - target_logit)
    tl.store(mean_z_dz_ptr + row, tl.sum(z_dz, axis=0) * inv_width)


def cross_entropy_logits_grad_ref(logits: torch.Tensor, target: torch.Tensor, row_weight: torch.Tensor,
                                  width: int, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of each row of ``logits`` [rows, V] and its gradient, written over ``logits``.

    ``row_loss[m] = logsumexp(z[m]) - z[m, target[m]]`` (just ``logsumexp`` where the target is outside
    ``[0, V)``, e.g. ignore_index); ``logits`` becomes ``dz = (softmax(z) - onehot(target)) * row_weight[m]``
    (in its dtype); returns ``(row_loss, mean_z_dz = sum_k z dz / width)`` (fp32; fp64 for fp64 logits).
    With ``softcap``: the same of ``y = softcap * t``, ``t = tanh(z / softcap)``, in place of z, and ``dz``
    times ``1 - t^2`` (the gradient of z; ``mean_z_dz`` sums ``z dz``).
    """
    cd = stats_dtype(logits.dtype)
    z = logits.to(cd)
    vocab = z.shape[1]
    valid = (target >= 0) & (target < vocab)
    index = target.clamp(0, max(vocab - 1, 0)).long()[:, None]
    if softcap is None:
        y = z
    else:
        t = torch.tanh(z / softcap)
        y = softcap * t
    lse = torch.logsumexp(y, dim=-1)
    target_logit = torch.where(valid, y.gather(1, index)[:, 0], 0.0)
    onehot = torch.zeros_like(z).scatter_(1, index, valid[:, None].to(cd))
    dz = (torch.exp(y - lse[:, None]) - onehot) * row_weight.to(cd)[:, None]
    if softcap is not None:
        dz = dz * (1 - t * t)
    mean_z_dz = (z * dz).sum(dim=-1) / width
    logits.copy_(dz)  # last: z may be logits itself
    return lse - target_logit, mean_z_dz


@launcher
def cross_entropy_logits_grad_triton(logits: torch.Tensor, target: torch.Tensor, row_weight: torch.Tensor,
                                     width: int, softcap: float | None = None, *,
                                     launch: tuple[int, int] = CROSS_ENTROPY_LAUNCH
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cross_entropy_logits_grad_ref` as one kernel launch (fp16/bf16/fp32; logits with contiguous rows, at
    any row stride: the LM head pads its chunks' rows to whole 16-byte units).
    ``launch``: (logits per step, warps), :data:`CROSS_ENTROPY_LAUNCH` by default."""
    if logits.stride(1) != 1:
        raise ValueError(f"logits: expected contiguous rows (stride 1 along the vocabulary), got strides "
                         f"{tuple(logits.stride())}")
    m, vocab = logits.shape
    row_loss = torch.empty(m, dtype=torch.float32, device=logits.device)
    mean_z_dz = torch.empty(m, dtype=torch.float32, device=logits.device)
    if m:
        block, warps = launch
        launch_kernel(_cross_entropy_logits_grad_kernel, (m,),
                      logits, target, row_weight, row_loss, mean_z_dz, vocab, logits.stride(0), 1.0 / width,
                      1.0 if softcap is None else softcap,
                      BLOCK=max(min(block, next_power_of_2(vocab)), CROSS_ENTROPY_GROUP), GROUP=CROSS_ENTROPY_GROUP,
                      SOFTCAP=softcap is not None, PORTABLE=portable_math(), num_warps=warps)
    return row_loss, mean_z_dz


cross_entropy_logits_grad = dispatcher(cross_entropy_logits_grad_ref, cross_entropy_logits_grad_triton)
