"""The IR: construction rules, validation errors, widths, the printout."""
import pytest

from codagen.epilogue import (
    Accumulator,
    Binary,
    ColPartial,
    ColVector,
    Constant,
    GeGLU,
    GeGLUBackward,
    Gemm,
    OneHot,
    Program,
    ProgramError,
    Rope,
    RowPartial,
    RowVector,
    SegmentSum,
    Store,
    SwiGLU,
    SwiGLUBackward,
    TileInput,
    Unary,
    Width,
    library,
)

acc = Accumulator()


def test_operators_build_nodes_and_numbers_become_constants():
    e = (acc + 1) * RowVector("r") - 2.5 / ColVector("g")
    assert isinstance(e, Binary) and e.op == "sub"
    assert e.a == Binary("mul", Binary("add", acc, Constant(1.0)), RowVector("r"))
    assert e.b == Binary("div", Constant(2.5), ColVector("g"))
    assert (-acc) == Unary("neg", acc)
    assert e.kind == "tile" and e.width == Width.FULL


def test_expressions_compare_and_hash_by_value():
    assert acc * RowVector("rstd") == Accumulator() * RowVector("rstd")
    assert len({acc * RowVector("rstd"), Accumulator() * RowVector("rstd")}) == 1
    assert library.rms_gate_up_swiglu() is library.rms_gate_up_swiglu()


def test_kinds_and_widths_broadcast():
    assert (RowVector("r") * ColVector("c")).kind == "tile"
    assert (RowVector("r") * 2).kind == "row"
    assert (ColVector("c", Width.HALF) + 1).width == Width.HALF
    assert SwiGLU(acc).width == Width.HALF
    assert SwiGLU(TileInput("z", Width.DOUBLE)).width == Width.FULL
    assert SwiGLUBackward(TileInput("z", Width.DOUBLE), acc).width == Width.DOUBLE
    assert GeGLU(acc).width == Width.HALF and GeGLU(TileInput("z", Width.DOUBLE)).width == Width.FULL
    assert GeGLUBackward(TileInput("z", Width.DOUBLE), acc).width == Width.DOUBLE
    assert Rope(acc, RowVector("p"), ColVector("f", Width.HALF)).width == Width.FULL
    assert SegmentSum(acc, 16).width == Width.FULL and SegmentSum(SwiGLU(acc), 4).width == Width.HALF
    assert Unary("rsqrt", SegmentSum(acc, 16)).kind == "tile"


@pytest.mark.parametrize("build, match", [
    (lambda: acc + TileInput("h", Width.HALF), "different widths"),
    (lambda: acc * ColVector("g", Width.HALF), "different widths"),
    (lambda: Unary("cosh", acc), "unknown unary op 'cosh'"),
    (lambda: Binary("pow", acc, acc), "unknown binary op 'pow'"),
    (lambda: acc * RowVector("target", index=True), "index RowVector can only feed OneHot"),
    (lambda: OneHot(RowVector("target")), r"OneHot needs a RowVector\(..., index=True\)"),
    (lambda: SwiGLU(TileInput("h", Width.HALF)), "FULL or DOUBLE"),
    (lambda: SwiGLU(RowVector("r")), "needs a tile value"),
    (lambda: SwiGLUBackward(acc, acc), "preact twice as wide as grad"),
    (lambda: GeGLU(TileInput("h", Width.HALF)), "GeGLU input must be FULL or DOUBLE"),
    (lambda: GeGLU(RowVector("r")), "GeGLU needs a tile value"),
    (lambda: GeGLUBackward(acc, acc), "GeGLUBackward needs preact twice as wide as grad"),
    (lambda: GeGLUBackward(TileInput("z", Width.DOUBLE), ColVector("c")), r"GeGLUBackward\(grad\) needs a tile"),
    (lambda: Rope(acc, RowVector("p"), ColVector("f")), "width N/2"),
    (lambda: Rope(acc, RowVector("p", index=True), ColVector("f", Width.HALF)), "float RowVector"),
    (lambda: SegmentSum(ColVector("c"), 16), "SegmentSum needs a tile value"),
    (lambda: SegmentSum(acc, 7), "even int >= 2"),
    (lambda: SegmentSum(acc, 0), "even int >= 2"),
    (lambda: SegmentSum(acc, 16.0), "even int >= 2"),
    (lambda: library.rms_qkv_rope(15), "qk_norm_head_dim must be an even int"),
    (lambda: library.rms_qkv_rope(16, 0.0), "qk_norm_eps must be a positive float"),
    (lambda: Constant(float("inf")), "finite"),
    (lambda: RowVector("not a name"), "identifier"),
    (lambda: Store("out", RowVector("r")), "needs a tile value"),
    (lambda: Store("out", acc, dtype="int8"), "dtype must be one of"),
    (lambda: RowPartial("p", acc, "max"), "'sum' or 'logsumexp'"),
    (lambda: ColPartial("p", ColVector("c")), "needs a tile value"),
    (lambda: Gemm("nm", "nk"), "a_layout"),
    (lambda: Gemm("mk", "mn"), "b_layout"),
    (lambda: Program("p", Gemm.linear(), ()), "no outputs"),
    (lambda: Program("p", Gemm.linear(), (Store("o", acc), Store("o", acc * 2))), "output names repeat"),
    (lambda: Program("p", Gemm.linear(), (Store("o", acc + TileInput("o")),)), "both an input and an output"),
    (lambda: Program("p", Gemm.linear(), (Store("o", acc + TileInput("a")),)), "reserved"),
    (lambda: Program("p", Gemm.linear(), (Store("o", acc * RowVector("x") + TileInput("x")),)), "declared twice"),
    (lambda: acc + "residual", "expected an epilogue expression or a number"),
])
def test_malformed_programs_are_refused_with_a_named_reason(build, match):
    with pytest.raises(ProgramError, match=match):
        build()


def test_inputs_are_collected_in_first_use_order():
    p = library.rms_norm_backward("add")
    assert list(p.inputs) == ["grad_residual", "rstd", "norm_weight", "residual", "mean_z_dz"]
    assert p.accumulated_outputs() == []
    assert library.rms_norm_backward("accumulate").accumulated_outputs() == ["grad_residual"]
    with pytest.raises(ValueError, match="residual_grad"):
        library.rms_norm_backward("replace")


def test_printout_reads_like_the_math():
    text = str(library.residual_rms_stats())
    assert "acc[M, N] = a[M, K] @ b[N, K]^T" in text
    assert "t0 = (acc + residual[m, n])" in text          # shared subexpression named once
    assert "normed[m, n] <- (t0 * norm_weight[n])  (input)" in text
    assert "partial_sumsq[m, tile_n] <- sum_n(square(t0))  (float32 partial)" in text
    assert "grad_preact[m, n:2N] <- t0" in str(library.swiglu_backward())
    assert "t0 = geglu_backward(preact[m, n:2N], acc)" in str(library.swiglu_backward("gelu_tanh"))
    assert "out[m, n:N/2] <- geglu(t0)" in str(library.rms_gate_up_swiglu(activation="gelu_tanh"))
    assert "a[K, M]^T @ b[K, N]" in str(library.weight_grad())
    assert repr(library.rms_qkv_rope()) == ("<Program rms_qkv_rope: 1 outputs, "
                                            "inputs ['rstd', 'positions', 'frequencies']>")


def test_segment_sum_printout_and_qk_norm_program():
    assert str(SegmentSum(acc * acc, 64)) == "segment_sum((acc * acc), size=64)"
    p = library.rms_qkv_rope(64, 1e-6)
    assert p is library.rms_qkv_rope(64, 1e-6) and p.name == "rms_qkv_rope_qk_norm"
    assert p.column_groups() == (SegmentSum(Unary("square", acc * RowVector("rstd")), 64),)
    assert library.rms_qkv_rope().column_groups() == ()
    assert list(p.inputs) == ["rstd", "qk_norm_weight", "qk_passthrough", "positions", "frequencies"]
    text = str(p)
    assert "t0 = (acc * rstd[m])" in text and "segment_sum(square(t0), size=64)" in text and "rsqrt(" in text
    assert "preact[m, n] <- t0  (input)" in text
    assert "qk_norm_weight[n]" in text and "qk_passthrough[n]" in text


def test_every_library_program_has_a_formula_docstring():
    for name, factory in library.PROGRAMS.items():
        program = factory()
        assert program.name == name
        assert program.doc and ("=" in program.doc), name
