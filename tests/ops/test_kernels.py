"""codagen.ops on Triton: the row kernels and a fused block, on CPU through the Triton interpreter."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from codagen.backends import triton_available

from .conftest import Config, forward_backward, fused_model, make_inputs, make_params, reference_tiles

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

# Run in a fresh interpreter: TRITON_INTERPRET must be set before the @triton.jit kernels are created.
_KERNEL_SCRIPT = textwrap.dedent("""
    import unittest.mock

    import torch
    from codagen import ops
    from codagen.backends.triton import arrivals
    from codagen.ops import kernels as k

    torch.manual_seed(int(SEED))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for m, n in ((1, 6), (7, 38), (3, 4100)):  # 4100 columns: several blocks per row
            x, y = torch.randn(m, n).to(dtype), torch.randn(m, n).to(dtype)
            gamma = torch.randn(n)
            got, want = k.rms_norm_stats_triton(x, gamma, 1e-5), k.rms_norm_stats_ref(x, gamma, 1e-5)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)
            positions = torch.randint(0, 4096, (m,)).float()
            frequencies = torch.cat((torch.rand(n // 4), torch.zeros(n // 2 - n // 4)))
            want = k.rope_backward_ref([x], y, positions, frequencies, 5)
            # whole, or as three column blocks read in place (one strided, one from a wider buffer)
            q_cols = 2 * (n // 6)
            wide = torch.randn(m, n + 10).to(dtype)
            wide[:, 3:3 + n - 2 * q_cols] = x[:, 2 * q_cols:]
            blocks = [x[:, :q_cols].t().contiguous().t(), x[:, q_cols:2 * q_cols].clone(),
                      wide[:, 3:3 + n - 2 * q_cols]]
            for grad_blocks in ([x], blocks):
                got = k.rope_backward_triton(grad_blocks, y, positions, frequencies, 5)
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, rtol=tol, atol=tol * 10)
            bias = torch.randn(n)  # qkv = rope(z + bias): the bias's share of the statistic taken off
            got = k.rope_backward_triton(blocks, y, positions, frequencies, 5, bias)
            for a, b in zip(got, k.rope_backward_ref([x], y, positions, frequencies, 5, bias)):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol * 10)
            grad_act = torch.randn(m, n // 2).to(dtype)
            for activation in ("silu", "gelu_tanh"):
                got = k.swiglu_backward_triton(grad_act, 3 * x, 3, activation)  # gates well into both tails
                want = k.swiglu_backward_ref(grad_act, 3 * x, 3, activation)
                for a, b in zip(got, want):
                    scale = max(1.0, b.float().abs().max().item())
                    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * scale, msg=activation)
            torch.testing.assert_close(k.mean_row_dot_triton(x, y, 9), k.mean_row_dot_ref(x, y, 9), rtol=tol, atol=tol)
            # the logit soft-cap's backward, logits of a few caps (the tanh saturated and not)
            got, want = k.softcap_backward_triton(y, 3 * x, 2.0, 9), k.softcap_backward_ref(y, 3 * x, 2.0, 9)
            for a, b in zip(got, want):
                torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
            # cross-entropy over stored logits (in place): an ignored row, and a target past the vocabulary;
            # logits near -200 (exp(-lse) overflows fp32 past the row's end, where the last block is masked);
            # uncapped and soft-capped
            target = torch.randint(0, n, (m,))
            target[0] = -100
            target[-1] = n if m > 1 else target[-1]
            for shift, softcap in ((0.0, None), (-200.0, None), (0.0, 2.0), (-200.0, 2.0)):
                logits, row_weight = (3 * x + shift).to(dtype), torch.rand(m)
                got_logits, want_logits = logits.clone(), logits.clone()
                got = k.cross_entropy_logits_grad_triton(got_logits, target, row_weight, 5, softcap)
                want = k.cross_entropy_logits_grad_ref(want_logits, target, row_weight, 5, softcap)
                # the loss (lse - z[target]) and sum z dz cancel terms as large as the logits: rounding errors
                # of that size remain (in fp32 at logits near -200, tens of ulps of 200)
                scale = max(1.0, logits.float().abs().max().item())
                for a, b, atol in zip(got + (got_logits,), want + (want_logits,), (tol * scale, tol * scale, tol)):
                    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=atol)
            # rows of a wider buffer (the LM head's chunk, its rows padded to 16-byte units): its other columns kept
            padded = torch.randn(m, n + 6).to(dtype)
            padded[:, :n] = logits
            columns_after = padded[:, n:].clone()
            got = k.cross_entropy_logits_grad_triton(padded[:, :n], target, row_weight, 5, softcap)
            for a, b in zip(got + (padded[:, :n],), want + (want_logits,)):
                torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * scale)
            assert torch.equal(padded[:, n:], columns_after)
            # the sandwich norm after a GEMM: forward (x, normed, rstd, rstd_y) and backward (grad_y and the
            # post-norm weight's gradient) with one backward program per row, or 16 rows each (the last ragged)
            residual, grad_x = torch.randn(m, n).to(dtype), torch.randn(m, n).to(dtype)
            post_weight = torch.rand(n) + 0.5
            with unittest.mock.patch.object(torch, "empty", poisoned_empty):
                got = k.post_norm_residual_triton(x, residual, post_weight, gamma, 1e-5)
            want = k.post_norm_residual_ref(x, residual, post_weight, gamma, 1e-5)
            for a, b in zip(got, want):
                torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * 10)
            # ... and with no norm next (OLMo 2): x and rstd_y alone, bitwise those of the launch above
            with unittest.mock.patch.object(torch, "empty", poisoned_empty):
                alone = k.post_norm_residual_triton(x, residual, post_weight, None, 1e-5)
            assert alone[1] is None and alone[2] is None
            assert torch.equal(alone[0], got[0]) and torch.equal(alone[3], got[3])
            rstd_y = want[3]
            for rows in (1, 16):
                with unittest.mock.patch.object(torch, "empty", poisoned_empty):
                    got = k.post_norm_backward_triton(x, rstd_y, post_weight, grad_x, rows)
                want = k.post_norm_backward_ref(x, rstd_y, post_weight, grad_x)
                for a, b in zip(got, want):
                    scale = max(1.0, b.float().abs().max().item())
                    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * scale, msg=rows)
            factor = torch.tensor(0.37)
            for out_dtype in (dtype, torch.float32):  # exact in fp32; the interpreter rounds to bf16 by truncation
                exact = out_dtype == torch.float32
                torch.testing.assert_close(k.scale_cast_triton(x, factor, out_dtype),
                                           k.scale_cast_ref(x, factor, out_dtype), rtol=0 if exact else 1e-2, atol=0)
        # embedding backward: repeated ids, unused rows, 600 features (two column blocks, the last ragged)
        for tokens, vocab, features in ((1, 3, 5), (40, 11, 600)):
            grad_out = torch.randn(tokens, features).to(dtype)
            ids = torch.randint(0, vocab, (tokens,))
            ids[: tokens // 2] = vocab - 1
            got = k.embedding_backward_triton(grad_out, ids, vocab)
            want = k.embedding_backward_ref(grad_out, ids, vocab)
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        # finishing a GEMM's fp32 tile partials: more rows than one program takes, more tiles than one step
        # (64 tiles a step), a row stride wider than the tiles
        if dtype == torch.float32:
            for rows, tiles in ((1, 1), (300, 16), (70, 172)):
                partial = 10 * torch.rand(rows, tiles + 3)[:, 1:1 + tiles]
                torch.testing.assert_close(k.finish_rstd_triton(partial, 2048, 1e-5),
                                           k.finish_rstd_ref(partial, 2048, 1e-5))
                torch.testing.assert_close(k.finish_row_mean_triton(partial, 77), k.finish_row_mean_ref(partial, 77))
            # cross-entropy rows: logsumexp of the partials minus the target's; a row of -inf partials (-inf);
            # a row stride wider than the tiles, and target partials transposed (any strides)
            for rows, tiles in ((1, 1), (300, 16), (70, 172)):
                partial_lse = 30 * torch.randn(rows, tiles + 3)[:, 1:1 + tiles]
                partial_lse[rows // 2] = float("-inf")
                partial_target = torch.randn(tiles, rows).t()
                torch.testing.assert_close(k.finish_cross_entropy_triton(partial_lse, partial_target),
                                           k.finish_cross_entropy_ref(partial_lse, partial_target))
            for tiles, cols in ((1, 1), (130, 100)):
                partial = torch.randn(tiles, cols)
                for out_dtype in (torch.float32, torch.float16):
                    torch.testing.assert_close(k.finish_col_sum_triton(partial, out_dtype),
                                               k.finish_col_sum_ref(partial, out_dtype), rtol=1e-3, atol=1e-4)
        # QK-norm backward: 17 rows (two row blocks, the last ragged); head_dim 6 (3 pairs in a 4-wide block) and
        # 16; narrower steps (max_block): one head a step, or 2 heads (6 Q heads in 3 steps, 3 K heads in 2, the
        # last ragged), V's columns in two steps (the last ragged)
        launch = k.QK_NORM_LAUNCH
        # QK-norm over the whole projection (OLMo 2: one group of heads * head_dim columns each for Q and K, of
        # different widths under GQA), given as num_heads = 1 with weights of the projections' widths
        for heads, kv_heads, head_dim, max_block, whole in ((2, 1, 6, 1024, False), (4, 2, 16, 1024, False),
                                                            (4, 2, 6, 8, False), (6, 3, 6, 16, False),
                                                            (4, 2, 6, 1024, True), (3, 3, 8, 16, True),
                                                            (40, 8, 128, 1024, True)):  # OLMo-2-32B's widths
            m, n = 17, (heads + 2 * kv_heads) * head_dim
            grad, preact = torch.randn(m, n).to(dtype), torch.randn(m, n).to(dtype)
            positions = torch.randint(0, 4096, (m,)).float()
            frequencies = ops.rope_frequencies(heads, kv_heads, head_dim)
            q_width, k_width = (heads * head_dim, kv_heads * head_dim) if whole else (head_dim, head_dim)
            q_norm, k_norm = torch.randn(q_width).to(dtype), torch.randn(k_width).to(dtype)
            args = (preact, positions, frequencies, q_norm, k_norm, 1 if whole else heads, 1e-6, 11)
            want = k.rope_qk_norm_backward_ref([grad], *args)
            split = [t.clone() for t in grad.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), 1)]
            for grad_blocks in ([grad], split):
                got = k.rope_qk_norm_backward_triton(grad_blocks, *args, launch=(launch[0], max_block, launch[2]))
                for name, a, b in zip(("grad_z", "mean_z_dz", "grad_q_norm", "grad_k_norm"), got, want):
                    scale = max(1.0, b.float().abs().max().item())
                    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * 10 * scale, msg=name)
        # QK-norm forward (heads no epilogue sub-tile holds): head_dim 256 (4 heads a step), 96 (48 pairs in a 64-wide
        # block); narrower steps: one head a step (192), 2 heads (6 Q heads in 3 steps, 3 K heads in 2, the last
        # ragged), V's columns in two steps (the last ragged); random frequencies on every pair, V's too; no rows
        # ... and over the whole Q and K projections (OLMo 2), GQA and not, in one step or several
        for heads, kv_heads, head_dim, step, whole in ((2, 1, 256, 1024, False), (4, 2, 96, 1024, False),
                                                       (2, 1, 192, 256, False), (6, 3, 6, 16, False),
                                                       (4, 2, 6, 8, False), (4, 2, 16, 1024, True),
                                                       (3, 3, 8, 16, True), (40, 8, 128, 1024, True)):
            m, n = 5, (heads + 2 * kv_heads) * head_dim
            preact = (3 * torch.randn(m, n)).to(dtype)
            positions, frequencies = torch.randint(0, 4096, (m,)).float(), torch.rand(n // 2)
            q_width, k_width = (heads * head_dim, kv_heads * head_dim) if whole else (head_dim, head_dim)
            q_norm, k_norm = (1 + 0.3 * torch.randn(q_width)).to(dtype), (1 + 0.3 * torch.randn(k_width)).to(dtype)
            args = (positions, frequencies, q_norm, k_norm, 1 if whole else heads, 1e-6)
            with unittest.mock.patch.object(torch, "empty", poisoned_empty):
                got = k.qk_norm_rope_triton(preact, *args, launch=(step, 4))
                assert k.qk_norm_rope_triton(preact[:0], *args).shape == (0, n)
            want = k.qk_norm_rope_ref(preact, *args)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # StaticLayer write: q, k, v column views of one QKV row block (row stride wider than each), GQA, a cache
    # length L > 0; keys / values poisoned (NaN), so a slot written in error shows, and the new q too
    heads, kv_heads, max_len = 4, 2, 7
    for dtype in (torch.float32, torch.float16):
        for batch, seq, head_dim, length in ((1, 1, 8, 3), (3, 2, 64, 5), (3, 1, 64, 0), (3, 2, 8, 2), (1, 2, 8, 6)):
            widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
            qkv = torch.randn(batch * seq, sum(widths)).to(dtype)
            q, kk, v = qkv.split(widths, dim=1)
            cache = torch.full((batch, kv_heads, max_len, head_dim), float("nan"), dtype=dtype)
            cache[:, :, :length] = torch.randn(batch, kv_heads, length, head_dim).to(dtype)
            keys, values = cache.clone(), (cache + 1).clone()
            got_length, want_length = torch.tensor(length), torch.tensor(length)
            args = (batch, seq, heads, kv_heads, head_dim)
            want_keys, want_values = keys.clone(), values.clone()
            with unittest.mock.patch.object(torch, "empty", poisoned_empty):
                got_q = k.static_cache_write_triton(q, kk, v, keys, values, got_length, *args)
            if length + seq <= max_len:
                want_q = k.static_cache_write_ref(q, kk, v, want_keys, want_values, want_length, *args)
            else:  # the slots past max_len are dropped: only the first token of each row is written
                first = [t.view(batch, seq, -1)[:, 0] for t in (q, kk, v)]
                k.static_cache_write_ref(*first, want_keys, want_values, want_length.clone(), batch, 1, heads,
                                         kv_heads, head_dim)
                want_length += seq
                want_q = k.half_split_heads(q, batch, seq, heads, head_dim).contiguous()
            assert got_q.shape == (batch, heads, seq, head_dim) and got_q.is_contiguous()
            assert int(got_length) == int(want_length) == length + seq  # advanced once, by the last program
            for name, a, b in (("q", got_q, want_q), ("keys", keys, want_keys), ("values", values, want_values)):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)
    # rowwise e4m3 quantization, bitwise: rows of scales from 1e-3 to 1e3, a zero row, a row whose small values
    # scale to subnormals, and rows of amax 448 (scale 1) holding exact ties (17 and 19 between codes 2 apart, and
    # 0.5 and 1.5 times 2^-9 between subnormal codes) and a -0.0, across one column step and three (5000 columns)
    ties = torch.tensor([448.0, 17.0, -19.0, 0.5 * 2 ** -9, 1.5 * 2 ** -9, -2.5 * 2 ** -9, 2 ** -6, 240.0, -0.0])
    for n in (300, 5000):
        rows = [torch.randn(n) * 10.0 ** torch.empty(1).uniform_(-3, 3) for _ in range(5)]
        rows += [torch.zeros(n), torch.cat((torch.tensor([1000.0]), 1e-3 * torch.randn(n - 1))),
                 torch.cat((ties, torch.zeros(n - ties.numel())))]
        x_rows = torch.stack(rows)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = x_rows.to(dtype)
            with unittest.mock.patch.object(torch, "empty", poisoned_empty):
                got_q, got_scale = k.quantize_rowwise_triton(x)
            want_q, want_scale = k.quantize_rowwise_ref(x)
            assert got_q.dtype == torch.float8_e4m3fn and got_scale.dtype == torch.float32
            assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), (n, dtype)
            assert torch.equal(got_scale, want_scale), (n, dtype)
        tie_codes = got_q[-1, :ties.numel()].float().tolist()
        assert tie_codes == [448.0, 16.0, -20.0, 0.0, 2 ** -8, -2 ** -8, 2 ** -6, 240.0, 0.0], tie_codes
        assert got_q[-1, ties.numel() - 1].view(torch.uint8) == 0x80  # -0.0 keeps its sign, as torch's cast does
    # e4m3 in groups (the blockwise recipe), bitwise: of 32 and 128 columns, rows and square blocks, rows of scales
    # from 1e-3 to 1e3, partial last groups (257 x 130), a zero row
    for along in k.GROUPINGS:
        for group in (32, 128):
            x_groups = torch.randn(257, 130) * 10.0 ** torch.empty(257, 1).uniform_(-3, 3)
            x_groups[5] = 0.0
            for dtype in (torch.float32, torch.bfloat16):
                x = x_groups.to(dtype)
                with unittest.mock.patch.object(torch, "empty", poisoned_empty):
                    got_q, got_scale = k.quantize_groups_triton(x, group, along)
                want_q, want_scale = k.quantize_groups_ref(x, group, along)
                assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), (along, group, dtype)
                assert torch.equal(got_scale, want_scale), (along, group, dtype)
    assert not arrivals.counters(torch.device("cpu"), 1).any()  # left at zero for the next launch
    print("kernels ok")
""")


# what every interpreter script can use: torch.empty that returns NaN (floating) or -1 (integer) tensors
_POISONED_EMPTY = textwrap.dedent("""
    import torch
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)
""")


# what a script run with ``launches`` records: each distinct launch of a row kernel (codagen.backends.triton.ahead's
# launch_kernel, through which every row kernel launches), its tensors as dtype and address modulo 16
_RECORD_LAUNCHES = textwrap.dedent("""
    import atexit, json, os
    import torch
    from codagen.backends.triton import ahead

    recorded, real_launch = {}, ahead.launch_kernel

    def described(value):
        if isinstance(value, torch.Tensor):
            return {"tensor": str(value.dtype).removeprefix("torch."), "offset": value.data_ptr() % 16}
        assert isinstance(value, (bool, int, float, str)) or value is None, type(value)
        return value

    def recording_launch(kernel, grid, *args, **meta):
        launch = {"kernel": f"{kernel.fn.__module__}:{kernel.fn.__name__}", "args": [described(a) for a in args],
                  "meta": {name: described(value) for name, value in meta.items()}}
        recorded[json.dumps(launch, sort_keys=True)] = launch
        return real_launch(kernel, grid, *args, **meta)

    ahead.launch_kernel = recording_launch
    atexit.register(lambda: json.dump(list(recorded.values()), open(os.environ["RECORDED_LAUNCHES"], "w")))
""")


def run_under_interpreter(script: str, seed: int, done: str, launches: Path | None = None) -> None:
    """``script`` (its ``SEED`` replaced by ``seed``, after ``poisoned_empty``'s definition) in a fresh interpreter
    with ``TRITON_INTERPRET=1`` (set before Triton is imported), from the repository root; it must exit 0 and print
    ``done``. With ``launches``, its row-kernel launches are written there (JSON)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    prelude = _POISONED_EMPTY
    if launches is not None:
        env["RECORDED_LAUNCHES"], prelude = str(launches), _RECORD_LAUNCHES + prelude
    result = subprocess.run([sys.executable, "-c", prelude + script.replace("SEED", str(seed))], env=env,
                            capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0 and done in result.stdout, f"seed {seed}: " + result.stdout + result.stderr


@pytest.fixture(scope="module")
def interpreter_launches(tmp_path_factory) -> dict[str, list[dict]]:
    """The row-kernel scripts, each run once under the interpreter with a fresh seed (shown on failure): their
    launches, by script."""
    seed = int.from_bytes(os.urandom(4), "little")
    launches = {}
    for name, (script, done) in {"kernels": (_KERNEL_SCRIPT, "kernels ok"),
                                 "greedy": (_GREEDY_SCRIPT, "greedy ok")}.items():
        path = tmp_path_factory.mktemp("launches") / f"{name}.json"
        run_under_interpreter(script, seed, done, launches=path)
        launches[name] = json.loads(path.read_text())
    return launches


def test_row_kernels_under_interpreter(interpreter_launches):
    assert interpreter_launches["kernels"]


# Greedy append: logits a column of a [batch, 2, vocab] tensor (row stride 2 * vocab), vocab not a multiple of the
# chunk; special rows (ties across chunks and within one, NaN after +inf, all equal, all -inf, the max in the
# tail); tokens, generated and the partials poisoned; two calls in a row (the counters reset in between).
_GREEDY_SCRIPT = textwrap.dedent("""
    import unittest.mock

    import torch
    from codagen.backends.triton import arrivals
    from codagen.ops import kernels as k
    from codagen.ops.kernels.greedy import CHUNK

    torch.manual_seed(int(SEED))

    def column(rows):  # rows [batch, vocab] -> the same values as logits[:, -1] of a [batch, 2, vocab] tensor
        wide = torch.randn(rows.shape[0], 2, rows.shape[1]).to(rows.dtype)
        wide[:, -1] = rows
        return wide[:, -1]

    vocab, max_len, nan, inf = 2 * CHUNK + 5, 5, float("nan"), float("inf")
    tie, nan_row, equal, minus_inf, tail = (torch.randn(vocab) for _ in range(5))
    tie[[CHUNK + 7, CHUNK + 9, 2 * CHUNK + 1]] = 10.0      # in two chunks, twice in the first
    nan_row[[3, CHUNK + 1, 2 * CHUNK]] = torch.tensor([inf, nan, nan])
    equal.fill_(0.5)
    minus_inf.fill_(-inf)
    tail[vocab - 1] = 10.0
    special = {tie: CHUNK + 7, nan_row: CHUNK + 1, equal: 0, minus_inf: 0, tail: vocab - 1}
    for dtype in (torch.float32, torch.float16):
        cases = [torch.randn(1, 5), torch.randn(1, CHUNK), torch.randn(3, vocab), torch.stack([tie, nan_row, equal]),
                 torch.stack([minus_inf, tail, tie])]
        for rows in cases:
            batch = rows.shape[0]
            got = (torch.full((batch, 1), -1), torch.full((batch, max_len), -1), torch.zeros(1, dtype=torch.long))
            want = tuple(t.clone() for t in got)
            for step in range(2):  # the second call: counters reset by the first, the token at column 1
                logits = column(rows.to(dtype) if step == 0 else torch.randn(rows.shape).to(dtype))
                with unittest.mock.patch.object(torch, "empty", poisoned_empty):
                    k.greedy_append_triton(logits, *got)
                k.greedy_append_ref(logits, *want)
                for name, a, b in zip(("tokens", "generated", "step_index"), got, want):
                    assert torch.equal(a, b), (dtype, tuple(rows.shape), step, name, a, b)
                assert int(got[2]) == step + 1
                assert not arrivals.counters(torch.device("cpu"), batch + 1)[:batch + 1].any()
            assert (got[1][:, 2:] == -1).all()
        for row, token in special.items():  # the index itself, not only the twin's
            got = (torch.full((1, 1), -1), torch.full((1, max_len), -1), torch.zeros(1, dtype=torch.long))
            k.greedy_append_triton(column(row.to(dtype)[None]), *got)
            assert int(got[0]) == int(got[1][0, 0]) == token, (dtype, token, got)
    print("greedy ok")
""")


def test_greedy_append_under_interpreter(interpreter_launches):
    assert interpreter_launches["greedy"]


def _row_kernels() -> set[str]:
    """Every row kernel of codagen.ops.kernels: its module-level ``@triton.jit`` functions named ``_*_kernel`` (the
    others are device functions they call)."""
    import importlib
    import pkgutil

    import triton

    import codagen.ops.kernels as package
    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names |= {f"{module.__name__}:{name}" for name, value in vars(module).items()
                  if isinstance(value, triton.runtime.JITFunction) and name.endswith("_kernel")
                  and value.fn.__module__ == module.__name__}
    return names


def _specialized_alike(launch: dict) -> str:
    """What Triton specializes a launch on: the kernel, its constexprs, each tensor's dtype and 16-byte alignment,
    each integer's class (1, a multiple of 16, other)."""
    def kind(value):
        if isinstance(value, dict):
            return value["tensor"], value["offset"] == 0
        if isinstance(value, bool) or not isinstance(value, int):
            return value if not isinstance(value, float) else "float"
        return 1 if value == 1 else 16 if value % 16 == 0 else "int"
    return json.dumps([launch["kernel"], [kind(a) for a in launch["args"]], sorted(launch["meta"].items())])


def _compile_cases(interpreter_launches) -> list[tuple[str, dict]]:
    """(target, launch): on sm_90, the measured target, every distinct launch; elsewhere each kernel's widest (the
    largest constexprs, the most 16-bit tensors), to keep CI's time."""
    from codagen.backends.triton.targets import TARGETS
    distinct = {}
    for launch in (launch for launches in interpreter_launches.values() for launch in launches):
        distinct.setdefault(_specialized_alike(launch), launch)
    widest = {}
    for launch in distinct.values():
        size = (sum(v for v in launch["meta"].values() if isinstance(v, int) and not isinstance(v, bool)),
                sum(isinstance(a, dict) and a["tensor"] in ("bfloat16", "float16") for a in launch["args"]))
        if launch["kernel"] not in widest or size > widest[launch["kernel"]][0]:
            widest[launch["kernel"]] = (size, launch)
    return [(name, launch) for name in TARGETS
            for launch in (distinct.values() if name == "sm_90" else [w for _, w in widest.values()])]


def compile_report(target_name: str, launch: dict) -> dict:
    """One recorded launch compiled for a target: its shared memory and (NVIDIA) spilled bytes per thread, or its
    error (run in a worker process)."""
    import importlib

    from codagen.backends.triton.cross_compile import Pointer, compile_row_kernel, cubin_resources
    from codagen.backends.triton.targets import TARGETS
    module, name = launch["kernel"].split(":")
    kernel = getattr(importlib.import_module(module), name)
    args = [Pointer(getattr(torch, a["tensor"]), a["offset"]) if isinstance(a, dict) else a for a in launch["args"]]
    target = TARGETS[target_name]
    try:
        compiled = compile_row_kernel(kernel, args, launch["meta"], target)
    except Exception as error:  # noqa: BLE001 - reported by the test of its target
        return {"error": f"{type(error).__name__}: {str(error)[-1500:]}"}
    stack = cubin_resources(compiled.asm["cubin"])[1] if target.backend == "cuda" else 0
    return {"shared": compiled.metadata.shared, "stack": stack}


def test_every_row_kernel_is_launched_by_an_interpreter_script(interpreter_launches):
    launched = {launch["kernel"] for launches in interpreter_launches.values() for launch in launches}
    assert launched == _row_kernels()


@pytest.fixture(scope="module")
def compile_reports(interpreter_launches) -> dict[str, list[tuple[dict, dict]]]:
    """Every compile case, compiled once in worker processes: ``{target: [(launch, report)]}``."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    cases = _compile_cases(interpreter_launches)
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1,
                             mp_context=multiprocessing.get_context("spawn")) as workers:
        reports = list(workers.map(compile_report, *zip(*cases)))
    by_target = {}
    for (target, launch), facts in zip(cases, reports):
        by_target.setdefault(target, []).append((launch, facts))
    return by_target


def _target_names() -> list[str]:
    if not triton_available():
        return []
    from codagen.backends.triton.targets import TARGETS
    return list(TARGETS)


#: spilled bytes per thread a row kernel may have on NVIDIA: the widest launches hold their whole row in registers
#: (the post-norm backward's 16384 columns: 48 bytes with 16 warps), a few registers spill
ROW_KERNEL_STACK_BYTES = 64


@pytest.mark.parametrize("target_name", _target_names())
def test_row_kernel_launches_compile_for_every_target(target_name, compile_reports):
    """The interpreter scripts' launches compile for ``target_name`` as its launches would (PORTABLE and PDL as the
    target takes them), within its shared memory, spilling at most a few registers on NVIDIA."""
    from codagen.backends.triton.targets import TARGETS
    target = TARGETS[target_name]
    for launch, facts in compile_reports[target_name]:
        what = f"{target_name} {launch['kernel']} {launch['meta']}"
        assert "error" not in facts, f"{what}: {facts.get('error')}"
        assert facts["shared"] <= target.shared_memory, f"{what}: {facts['shared']} bytes of shared memory"
        assert facts["stack"] <= ROW_KERNEL_STACK_BYTES, f"{what}: {facts['stack']} stack bytes per thread"


def test_greedy_append_refuses_what_it_cannot_take():
    """Shapes, dtypes, strides and devices the append cannot take are refused before any launch, naming the
    argument (float64 logits by the launch only: its fp32 partials would round them)."""
    from codagen.ops import kernels as k

    batch, vocab, max_len = 3, 10, 4
    logits, tokens = torch.randn(batch, vocab), torch.zeros(batch, 1, dtype=torch.long)
    generated, step = torch.zeros(batch, max_len, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    for bad, match in (((logits[0], tokens, generated, step), r"logits: expected a floating-point \[batch, vocab\]"),
                       ((logits[:, :0], tokens, generated, step), r"logits: expected .* vocab >= 1"),
                       ((logits.long(), tokens, generated, step), r"logits: expected a floating-point"),
                       ((logits, tokens[:, 0], generated, step), r"tokens: expected a torch.int64 tensor of shape "
                                                                 r"\[batch, 1\] \(batch 3"),
                       ((logits, tokens.int(), generated, step), r"tokens: expected a torch.int64"),
                       ((logits, tokens, generated[:2], step), r"generated: expected .* \[batch, max_len\]"),
                       ((logits, tokens, generated.t().contiguous().t(), step), r"generated: expected a contiguous"),
                       ((logits, tokens, generated, step[0]), r"step_index: expected a torch.int64 tensor of shape "
                                                              r"\[1\]"),
                       ((logits, tokens, generated, step.int()), r"step_index: expected a torch.int64"),
                       ((logits, tokens, generated, step.to("meta")), r"step_index: expected device cpu")):
        for append in (k.greedy_append_ref, k.greedy_append_triton):
            with pytest.raises(ValueError, match=match):
                append(*bad)
    with pytest.raises(ValueError, match=r"logits: expected torch.float16, torch.bfloat16 or torch.float32"):
        k.greedy_append_triton(logits.double(), tokens, generated, step)
    with pytest.raises(ValueError, match=r"logits: expected column stride 1 \(any row stride\), got strides \(1, 3\)"):
        k.greedy_append_triton(logits.t().contiguous().t(), tokens, generated, step)
    assert not generated.any() and not step.any()


def test_greedy_append_compiles_for_sm90():
    """The kernel compiles for Hopper without a GPU (bf16 logits, Llama 3's 32 chunks): its PTX holds the
    two arrivals (a row's chunks, the rows) as GPU-scope acquire-release atomics and the partials' L2 loads."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from codagen.ops.kernels import greedy
    from codagen.ops.kernels._launch import triton

    pointers = {"logits_ptr": "*bf16", "tokens_ptr": "*i64", "generated_ptr": "*i64", "step_ptr": "*i64",
                "chunk_max_ptr": "*fp32", "chunk_argmax_ptr": "*i32", "counters_ptr": "*i32"}
    scalars = dict.fromkeys(("logits_row_stride", "tokens_row_stride", "vocab", "max_len"), "i32")
    constexprs = {"CHUNK": greedy.CHUNK, "CHUNKS": 32}
    signature = {**pointers, **scalars, **dict.fromkeys(constexprs, "constexpr")}
    compiled = triton.compile(ASTSource(fn=greedy._greedy_append_kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    assert ptx.count("atom.global.gpu.acq_rel.add") == 2
    assert ptx.count("ld.global.cg") == 2

def test_qk_norm_rope_compiles_for_sm90():
    """The QK-norm forward row kernel compiles for Hopper without a GPU (bf16, Gemma 3's head_dim 256: 4 heads of
    128 pairs a step), specialized as a launch specializes it (pointers, the row width and head_dim multiples of
    16): every store of qkv is 16 bytes wide, nothing spills (the cubin's stack), no atomics (deterministic), the
    hardware cos/sin."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from codagen.backends.triton.cross_compile import cubin_resources
    from codagen.ops.kernels._launch import triton
    from codagen.ops.kernels.qk_norm_rope import _qk_norm_rope_kernel

    pointers = {"preact_ptr": "*bf16", "positions_ptr": "*fp32", "frequencies_ptr": "*fp32",
                "q_norm_weight_ptr": "*bf16", "k_norm_weight_ptr": "*bf16", "qkv_ptr": "*bf16"}
    scalars = {**dict.fromkeys(("n_cols", "q_width", "k_width", "q_groups", "k_groups"), "i32"), "eps": "fp32"}
    constexprs = {"Q_HEADS": 4, "Q_BLOCK": 128, "K_HEADS": 4, "K_BLOCK": 128, "BLOCK": 1024, "PORTABLE": False}
    signature = {**pointers, **scalars, **dict.fromkeys(constexprs, "constexpr")}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers) + 3)}  # + n_cols, q_width, k_width
    compiled = triton.compile(ASTSource(fn=_qk_norm_rope_kernel, signature=signature, constexprs=constexprs,
                                        attrs=aligned), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    stores = re.findall(r"st\.global\S*", ptx)
    assert stores and all(store == "st.global.v4.b32" for store in stores), stores
    assert cubin_resources(compiled.asm["cubin"])[1] == 0
    assert not re.search(r"\b(atom|red)\.", ptx)
    assert "cos.approx.f32" in ptx and "sin.approx.f32" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_greedy_append_matches_ref_and_replays_in_a_cuda_graph(batch):
    """bf16 logits of Llama 3's vocabulary on CUDA: the launch writes the twin's tokens (bitwise; a tie across
    chunks, at batch 64 a NaN row too) eagerly, then in a captured CUDA graph replayed 3 times on fresh logits:
    step_index advances once a replay and each replay's column of ``generated`` is written."""
    from codagen.ops import kernels as k

    vocab, max_len = 128256, 8
    wide = torch.randn(batch, 2, vocab, device="cuda").bfloat16()
    logits = wide[:, -1]
    logits[0, [5000, 9000]] = 100.0  # the max in two chunks: the first wins
    if batch > 1:  # NaN after +inf: the first NaN wins
        logits[-1, [0, 70000, 100000]] = torch.tensor([float("inf"), float("nan"), float("nan")]).bfloat16().cuda()
    got = (torch.full((batch, 1), -1, device="cuda"), torch.full((batch, max_len), -1, device="cuda"),
           torch.zeros(1, dtype=torch.long, device="cuda"))
    want = tuple(t.clone() for t in got)
    k.greedy_append_triton(logits, *got)
    k.greedy_append_ref(logits, *want)
    assert int(got[0][0]) == 5000 and (batch == 1 or int(got[0][-1]) == 70000)
    for a, b in zip(got, want):
        assert torch.equal(a, b)

    side = torch.cuda.Stream()  # warm-up on a side stream, as GreedyDecoder captures
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        k.greedy_append_triton(logits, *(t.clone() for t in got))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k.greedy_append_triton(logits, *got)
    for replay in range(3):
        wide.copy_(torch.randn(wide.shape, device="cuda"))
        graph.replay()
        k.greedy_append_ref(logits, *want)
        for name, a, b in zip(("tokens", "generated", "step_index"), got, want):
            assert torch.equal(a, b), (replay, name)
    assert int(got[2]) == 4 and (got[1][:, :4] >= 0).all() and (got[1][:, 4:] == -1).all()


def test_rope_backward_launchers_refuse_blocks_they_cannot_read():
    """B1 takes 1-3 column blocks of even widths (a pair never straddles two); with QK-norm, the whole
    gradient or exactly its q, k, v blocks. Refused before any launch, naming ``grad_blocks``."""
    from codagen import ops
    from codagen.ops import kernels as k

    m, heads, kv_heads, head_dim = 3, 2, 1, 4
    n = (heads + 2 * kv_heads) * head_dim
    grad, qkv = torch.randn(m, n), torch.randn(m, n)
    positions, frequencies = torch.arange(m).float(), ops.rope_frequencies(heads, kv_heads, head_dim)
    for blocks in ([grad[:, :3], grad[:, 3:]], list(grad.split(4, dim=1)), []):
        with pytest.raises(ValueError, match="grad_blocks: expected 1 to 3 column blocks of even widths"):
            k.rope_backward_triton(blocks, qkv, positions, frequencies, 5)
    norm = torch.randn(head_dim)
    with pytest.raises(ValueError, match=r"grad_blocks: expected \[grad_qkv\] \(16 columns\) or \[grad_q, grad_k, "
                                         r"grad_v\] \(\(8, 4, 4\) columns\), got widths \[4, 8, 4\]"):
        k.rope_qk_norm_backward_triton(list(grad.split((4, 8, 4), dim=1)), qkv, positions, frequencies, norm, norm,
                                       heads, 1e-6, 5)


def test_finish_cross_entropy_refuses_partials_of_two_shapes():
    from codagen.ops import kernels as k

    with pytest.raises(ValueError, match=r"partial_target: expected the shape of partial_lse \(5, 3\), got \(5, 4\)"):
        k.finish_cross_entropy_triton(torch.zeros(5, 3), torch.zeros(5, 4))


@pytest.mark.parametrize("qk_norm, activation", [(False, "silu"), (True, "silu"), (False, "gelu_tanh")],
                         ids=["plain", "qk_norm", "geglu"])
def test_block_on_triton_backend_matches_reference(qk_norm, activation):
    try:
        import codagen.backends.triton  # noqa: F401
    except Exception as error:  # the backend is built concurrently
        pytest.skip(f"codagen.backends.triton does not import yet: {error!r}")
    from codagen.backends import use_backend

    # QK-norm needs heads that fit the interpreter's 32-wide tiles whole: head_dim 16
    cfg = Config(batch=1, seq=7, hidden=16, heads=2, kv_heads=1, head_dim=16 if qk_norm else 8, ffn=16, vocab=24,
                 layers=1, qk_norm=qk_norm, activation=activation)
    params = make_params(cfg, dtype=torch.float32)
    x, positions, target, probe = make_inputs(cfg, dtype=torch.float32)
    with reference_tiles():
        want = forward_backward(fused_model, params, x, positions, target, probe, cfg)
    with use_backend("triton"):
        got = forward_backward(fused_model, params, x, positions, target, probe, cfg)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    for key in want[2]:
        torch.testing.assert_close(got[2][key], want[2][key], rtol=1e-4, atol=1e-4, msg=lambda m: f"{key}: {m}")


# --------------------------------------------------------------------------------------------------
# The gated MLP ops, SwiGLU and GeGLU, on both backends: the numerics rule in fp16 (the interpreter's fp16 dot is
# right, its bf16 one is not)
# --------------------------------------------------------------------------------------------------
MLP_TOKENS, MLP_D, MLP_FFN, MLP_EPS = 37, 48, 40, 1e-6  # 37 rows: a ragged last tile


def _mlp_leaves(dtype):
    """x, the two norm weights, gate_up (interleaved) and down, fresh and random, as leaves of ``dtype``."""
    x = torch.randn(MLP_TOKENS, MLP_D)
    gammas = [1 + 0.2 * torch.randn(MLP_D) for _ in range(2)]
    gate_up = torch.randn(2 * MLP_FFN, MLP_D) / MLP_D ** 0.5
    down = torch.randn(MLP_D, MLP_FFN) / MLP_FFN ** 0.5
    return [t.to(dtype).requires_grad_() for t in (x, *gammas, gate_up, down)]


def _mlp_run(op, activation, leaves, probe, fused: bool):
    """The op's output and the gradients of ``sum(output * probe)`` for every leaf it reads, fused (codagen.ops on
    the selected backend) or eager at the leaves' dtype."""
    from codagen import ops

    from .conftest import GATE_ACTIVATIONS, rms_norm
    x, gamma, next_gamma, gate_up, down = leaves
    if fused:
        normed, rstd = ops.rms_norm_stats(x, gamma, MLP_EPS)
        if op == "rms_gate_up_swiglu":
            out = ops.rms_gate_up_swiglu(x, normed, rstd, gamma, gate_up, activation=activation)
        else:
            out = ops.swiglu_mlp_residual_rms(x, normed, rstd, gamma, gate_up, down, next_gamma, MLP_EPS,
                                              activation=activation)[0]
    else:
        z = rms_norm(x, gamma, MLP_EPS) @ gate_up.t()
        out = GATE_ACTIVATIONS[activation](z[:, 0::2]) * z[:, 1::2]
        out = out if op == "rms_gate_up_swiglu" else x + out @ down.t()
    read = [x, gamma, gate_up] + ([down] if op == "swiglu_mlp_residual_rms" else [])
    return [out.detach(), *torch.autograd.grad((out * probe).sum(), read)]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("op", ["rms_gate_up_swiglu", "swiglu_mlp_residual_rms"])
def test_gated_mlp_ops_keep_the_numerics_rule_on_both_backends(op, activation, backend):
    """Output and every gradient in fp16: max error against float32 math on the same fp16 values at most twice
    that of eager PyTorch in fp16, + 1e-6 (the standalone op's backward: the row kernel's twin on CPU)."""
    from codagen.backends import use_backend

    leaves = _mlp_leaves(torch.float16)
    as32 = [t.detach().float().requires_grad_() for t in leaves]
    probe = torch.randn(MLP_TOKENS, MLP_FFN if op == "rms_gate_up_swiglu" else MLP_D)
    want = _mlp_run(op, activation, as32, probe, fused=False)
    eager = _mlp_run(op, activation, leaves, probe.half(), fused=False)
    with reference_tiles(), use_backend(backend):
        got = _mlp_run(op, activation, leaves, probe.half(), fused=True)
    names = ["out", "grad x", "grad norm_weight", "grad gate_up_weight", "grad down_weight"]
    for name, g, e, w in zip(names, got, eager, want):
        assert g.dtype == torch.float16, name
        error, bound = (g.float() - w).abs().max().item(), 2 * (e.float() - w).abs().max().item() + 1e-6
        assert error <= bound, f"{op} ({activation}, {backend}) {name}: error {error:.3e} > {bound:.3e}"
