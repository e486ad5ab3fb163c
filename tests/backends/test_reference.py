"""Every primitive on the reference backend against explicit float64 math, on odd shapes."""
import math

import pytest
import torch

from codagen.backends.reference import ReferenceBackend
from codagen.epilogue import (
    Accumulator,
    ColPartial,
    ColVector,
    GeGLU,
    GeGLUBackward,
    Gemm,
    OneHot,
    Program,
    ProgramError,
    Rope,
    RowPartial,
    RowVector,
    ScalarInput,
    SegmentSum,
    Store,
    SwiGLU,
    SwiGLUBackward,
    TileInput,
    Unary,
    Width,
    bind,
)

acc = Accumulator()
F64 = torch.float64
LINEAR = Gemm.linear()


def run(program, a, b, block_m=16, block_n=8, **tensors):
    return ReferenceBackend(block_m, block_n).run(bind(program, a, b, tensors))


def operands(m, n, k, gemm=LINEAR, dtype=F64):
    a_shape, b_shape = gemm.shapes(m, n, k)
    return torch.randn(*a_shape, dtype=dtype), torch.randn(*b_shape, dtype=dtype)


@pytest.mark.parametrize("gemm, expected", [
    (Gemm.linear(), lambda a, b: a @ b.T),
    (Gemm.input_grad(), lambda a, b: a @ b),
    (Gemm.weight_grad(), lambda a, b: a.T @ b),
])
@pytest.mark.parametrize("m, n, k", [(1, 6, 3), (7, 10, 5), (33, 18, 0)])
def test_gemm_layouts(gemm, expected, m, n, k):
    a, b = operands(m, n, k, gemm)
    out = run(Program("p", gemm, (Store("out", acc),)), a, b)["out"]
    torch.testing.assert_close(out, expected(a, b), rtol=1e-12, atol=1e-12)


def test_vector_tile_and_scalar_loads_broadcast():
    m, n, k = 9, 6, 4
    a, b = operands(m, n, k)
    row, col, tile, scalar = torch.randn(m, dtype=F64), torch.randn(n, dtype=F64), torch.randn(m, n), torch.randn(1)
    value = (acc + TileInput("tile")) * RowVector("row") - ColVector("col") / ScalarInput("scalar")
    out = run(Program("p", Gemm.linear(), (Store("out", value),)), a, b, row=row, col=col, tile=tile,
              scalar=scalar)["out"]
    expected = (a @ b.T + tile.double()) * row[:, None] - col[None, :] / scalar.double()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op, fn", [
    ("neg", torch.neg), ("exp", torch.exp), ("sigmoid", torch.sigmoid), ("square", torch.square),
    ("silu", lambda x: x / (1 + torch.exp(-x))), ("log", lambda x: torch.log(x.abs() + 1)),
    ("rsqrt", lambda x: 1 / torch.sqrt(x)),
])
def test_unary_ops(op, fn):
    a, b = operands(5, 4, 3)
    positive = op in ("log", "rsqrt")
    x = Unary("square", acc) + 1 if positive else acc     # log and rsqrt need a positive argument
    inner = (a @ b.T).square() + 1 if positive else a @ b.T
    out = run(Program("p", Gemm.linear(), (Store("out", Unary(op, x)),)), a, b)["out"]
    expected = torch.log(inner) if op == "log" else fn(inner)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_binary_max_and_div():
    a, b = operands(5, 4, 3)
    tile = torch.randn(5, 4, dtype=F64)
    from codagen.epilogue import Binary
    out = run(Program("p", Gemm.linear(), (Store("mx", Binary("max", acc, TileInput("t"))),
                                           Store("dv", acc / (Unary("square", TileInput("t")) + 1)))), a, b, t=tile)
    torch.testing.assert_close(out["mx"], torch.maximum(a @ b.T, tile))
    torch.testing.assert_close(out["dv"], (a @ b.T) / (tile.square() + 1))


def test_one_hot_picks_the_target_column_and_ignores_out_of_range():
    m, n = 6, 10
    a, b = operands(m, n, 3)
    target = torch.tensor([0, 9, 3, -100, 5, 10])
    out = run(Program("p", Gemm.linear(), (Store("out", acc * OneHot(RowVector("target", index=True))),)), a, b,
              target=target)["out"]
    expected = torch.zeros(m, n, dtype=F64)
    for i, t in enumerate(target.tolist()):
        if 0 <= t < n:
            expected[i, t] = (a @ b.T)[i, t]
    torch.testing.assert_close(out, expected)


def test_swiglu_pairs_and_widths():
    m, n = 7, 10
    a, b = operands(m, n, 4)
    z = a @ b.T
    out = run(Program("p", Gemm.linear(), (Store("out", SwiGLU(acc)),)), a, b)["out"]
    assert out.shape == (m, n // 2)
    for j in range(n // 2):
        g, u = z[:, 2 * j], z[:, 2 * j + 1]
        torch.testing.assert_close(out[:, j], g * torch.sigmoid(g) * u)
    # DOUBLE -> FULL: a saved [M, 2N] pre-activation
    preact = torch.randn(m, 2 * n, dtype=F64)
    act = run(Program("p", Gemm.linear(), (Store("act", SwiGLU(TileInput("z", Width.DOUBLE)) * acc),)), a, b,
              z=preact)["act"]
    torch.testing.assert_close(act, torch.nn.functional.silu(preact[:, 0::2]) * preact[:, 1::2] * z)


def test_swiglu_backward_matches_autograd():
    m, n = 5, 6
    a, b = operands(m, n, 4)
    preact = torch.randn(m, 2 * n, dtype=F64, requires_grad=True)
    grad = a @ b.T
    (torch.nn.functional.silu(preact[:, 0::2]) * preact[:, 1::2]).backward(grad)
    out = run(Program("p", Gemm.linear(), (Store("d", SwiGLUBackward(TileInput("z", Width.DOUBLE), acc)),)), a, b,
              z=preact.detach())["d"]
    torch.testing.assert_close(out, preact.grad, rtol=1e-12, atol=1e-12)


def test_geglu_pairs_and_widths():
    m, n = 7, 10
    a, b = operands(m, n, 4)
    z = a @ b.T
    out = run(Program("p", Gemm.linear(), (Store("out", GeGLU(acc)),)), a, b)["out"]
    assert out.shape == (m, n // 2)
    for j in range(n // 2):
        g, u = z[:, 2 * j], z[:, 2 * j + 1]
        tanh_gelu = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
        torch.testing.assert_close(out[:, j], tanh_gelu * u)
    # DOUBLE -> FULL: a saved [M, 2N] pre-activation
    preact = torch.randn(m, 2 * n, dtype=F64)
    act = run(Program("p", Gemm.linear(), (Store("act", GeGLU(TileInput("z", Width.DOUBLE)) * acc),)), a, b,
              z=preact)["act"]
    gelu = torch.nn.functional.gelu(preact[:, 0::2], approximate="tanh")
    torch.testing.assert_close(act, gelu * preact[:, 1::2] * z)


def test_geglu_backward_matches_autograd():
    """Against autograd of torch's tanh GELU, on gates out to both tails (where the sigmoid saturates)."""
    m, n = 5, 6
    a, b = operands(m, n, 4)
    preact = (4 * torch.randn(m, 2 * n, dtype=F64)).requires_grad_()
    grad = a @ b.T
    (torch.nn.functional.gelu(preact[:, 0::2], approximate="tanh") * preact[:, 1::2]).backward(grad)
    out = run(Program("p", Gemm.linear(), (Store("d", GeGLUBackward(TileInput("z", Width.DOUBLE), acc)),)), a, b,
              z=preact.detach())["d"]
    torch.testing.assert_close(out, preact.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_rotates_pairs_by_position_times_frequency(inverse):
    m, n = 7, 8
    a, b = operands(m, n, 4)
    positions, freqs = torch.arange(m, dtype=torch.float32) * 3, torch.rand(n // 2, dtype=F64)
    out = run(Program("p", Gemm.linear(), (Store("y", Rope(acc, RowVector("pos"), ColVector("f", Width.HALF),
                                                           inverse)),)), a, b, pos=positions, f=freqs)["y"]
    z = a @ b.T
    sign = -1 if inverse else 1
    for i in range(m):
        for j in range(n // 2):
            theta = sign * positions[i].item() * freqs[j].item()
            x0, x1 = z[i, 2 * j].item(), z[i, 2 * j + 1].item()
            assert out[i, 2 * j].item() == pytest.approx(x0 * math.cos(theta) - x1 * math.sin(theta), abs=1e-12)
            assert out[i, 2 * j + 1].item() == pytest.approx(x0 * math.sin(theta) + x1 * math.cos(theta), abs=1e-12)


@pytest.mark.parametrize("m, n, block_n", [(7, 20, 8), (1, 8, 8), (129, 6, 4)])
def test_row_partials_sum_and_logsumexp_per_tile(m, n, block_n):
    a, b = operands(m, n, 5)
    out = run(Program("p", Gemm.linear(), (RowPartial("s", acc), RowPartial("l", acc, "logsumexp"))), a, b,
              block_n=block_n)
    z = a @ b.T
    tiles = -(-n // block_n)
    assert out["s"].shape == out["l"].shape == (m, tiles)
    for t in range(tiles):
        cols = z[:, t * block_n:(t + 1) * block_n]
        torch.testing.assert_close(out["s"][:, t], cols.sum(1))
        torch.testing.assert_close(out["l"][:, t], torch.logsumexp(cols, 1))
    # merging partials gives the full-row statistics
    torch.testing.assert_close(torch.logsumexp(out["l"], 1), torch.logsumexp(z, 1))


def test_row_partials_of_half_and_double_width_values_use_the_same_tiles():
    m, n, block_n = 4, 12, 8
    a, b = operands(m, n, 3)
    preact = torch.randn(m, 2 * n, dtype=F64)
    out = run(Program("p", Gemm.linear(), (RowPartial("half", SwiGLU(acc)),
                                           RowPartial("double", TileInput("z", Width.DOUBLE)))), a, b, z=preact,
              block_n=block_n)
    swiglu = torch.nn.functional.silu((a @ b.T)[:, 0::2]) * (a @ b.T)[:, 1::2]
    torch.testing.assert_close(out["half"], torch.stack([swiglu[:, :4].sum(1), swiglu[:, 4:].sum(1)], 1))
    torch.testing.assert_close(out["double"], torch.stack([preact[:, :16].sum(1), preact[:, 16:].sum(1)], 1))


@pytest.mark.parametrize("m, block_m", [(7, 4), (129, 16), (1, 16)])
def test_col_partials_per_row_tile(m, block_m):
    n = 6
    a, b = operands(m, n, 3)
    out = run(Program("p", Gemm.linear(), (ColPartial("c", acc),)), a, b, block_m=block_m)["c"]
    z = a @ b.T
    assert out.shape == (-(-m // block_m), n)
    for t in range(out.shape[0]):
        torch.testing.assert_close(out[t], z[t * block_m:(t + 1) * block_m].sum(0))


def test_store_dtypes_and_accumulate():
    a, b = operands(6, 4, 3, dtype=torch.float32)
    target = torch.randn(6, 4, dtype=torch.bfloat16)
    before = target.clone()
    out = run(Program("p", Gemm.linear(), (Store("lo", acc), Store("hi", acc, dtype="float32"),
                                           Store("h16", acc, dtype="float16"),
                                           Store("acc_out", acc, accumulate=True))), a, b, acc_out=target)
    assert out["lo"].dtype == torch.float32 and out["h16"].dtype == torch.float16
    assert out["acc_out"] is target                       # updated in place
    torch.testing.assert_close(target, (before.float() + a @ b.T).bfloat16())


def test_low_precision_operands_compute_in_float32():
    a, b = operands(8, 6, 64, dtype=torch.bfloat16)
    out = run(Program("p", Gemm.linear(), (Store("o", acc, dtype="float32"),)), a, b)["o"]
    torch.testing.assert_close(out, a.float() @ b.float().T, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("m, n", [(0, 6), (5, 0), (0, 0)])
def test_empty_problems_give_empty_outputs(m, n):
    a, b = operands(m, n, 3)
    out = run(Program("p", Gemm.linear(), (Store("o", acc), RowPartial("s", acc), ColPartial("c", acc))), a, b)
    assert out["o"].shape == (m, n)
    assert out["s"].shape == (m, -(-n // 8))
    assert out["c"].shape == (-(-m // 16), n)


def test_outputs_are_allocated_poisoned():
    a, b = operands(3, 4, 2)
    outs = bind(Program("p", Gemm.linear(), (Store("o", acc),)), a, b, {}).allocate_outputs(16, 8)
    assert torch.isnan(outs["o"]).all()


def test_odd_block_n_is_refused():
    with pytest.raises(ValueError, match="block_n must be even"):
        ReferenceBackend(16, 7)


@pytest.mark.parametrize("m", [1, 7, 129])
@pytest.mark.parametrize("size", [2, 6, 16])
def test_segment_sum(m, size):
    """Each column gets its aligned group's sum, written out with explicit loops over the groups; also on a
    pair map's output and at half width."""
    n = 4 * size if size != 2 else 10
    a, b = operands(m, n, 5)
    positions, frequencies = torch.arange(m, dtype=F64), torch.rand(n // 2, dtype=F64)
    rope = Rope(acc, RowVector("positions"), ColVector("frequencies", Width.HALF))
    program = Program("p", Gemm.linear(), (Store("full", SegmentSum(acc, size)),
                                           Store("rotated", SegmentSum(rope * rope, size))))
    out = run(program, a, b, positions=positions, frequencies=frequencies)
    z = a @ b.T
    theta = positions[:, None] * frequencies[None, :]
    rotated = torch.stack((z[:, 0::2] * theta.cos() - z[:, 1::2] * theta.sin(),
                           z[:, 0::2] * theta.sin() + z[:, 1::2] * theta.cos()), -1).flatten(1)
    for name, x in (("full", z), ("rotated", rotated.square())):
        expected = torch.empty_like(x)
        for group in range(n // size):
            cols = slice(group * size, (group + 1) * size)
            expected[:, cols] = x[:, cols].sum(1, keepdim=True)
        torch.testing.assert_close(out[name], expected, rtol=1e-12, atol=1e-12, msg=lambda msg: f"{name}: {msg}")
    if n % (2 * size) == 0:
        half = run(Program("p", Gemm.linear(), (Store("half", SegmentSum(SwiGLU(acc), size)),)), a, b)["half"]
        act = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
        torch.testing.assert_close(half, act.view(m, -1, size).sum(-1).repeat_interleave(size, 1))


def test_segment_sum_needs_whole_groups():
    a, b = operands(3, 24, 5)
    program = Program("p", Gemm.linear(), (Store("out", SegmentSum(acc, 16)),))
    with pytest.raises(ProgramError, match=r"segment_sum\(size=16\) needs whole groups of 16 columns, got 24 columns"):
        run(program, a, b)
