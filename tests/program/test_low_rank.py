"""Programs with the GEMM's low-rank operand pair ``acc = op(A) @ op(B) + op(A2) @ op(B2)``: printed, bound,
computed by the reference backend (against float64 math) and by the generated Triton kernel (interpreter,
every layout the ops use, and an sm_90 compile); the ping-pong schedule refuses them."""
from __future__ import annotations

import pytest
import torch

from codagen.backends import execute
from codagen.epilogue import library
from codagen.epilogue.bind import bind
from codagen.epilogue.ir import Gemm, ProgramError

pytest.importorskip("triton")

M, N, K, R = 37, 24, 40, 5


def low_rank_operands(gemm: Gemm, dtype, m=M, n=N, k=K, r=R):
    """(a, b, a2, b2) in the gemm's layouts and the float64 accumulator they define."""
    (a_shape, b_shape), (a2_shape, b2_shape) = gemm.shapes(m, n, k), gemm.shapes(m, n, r)
    a, b, a2, b2 = (torch.randn(s, dtype=torch.float64).to(dtype) for s in (a_shape, b_shape, a2_shape, b2_shape))

    def op_a(t):
        return t.double() if gemm.a_layout == "mk" else t.double().t()

    def op_b(t):
        return t.double().t() if gemm.b_layout == "nk" else t.double()
    return a, b, a2, b2, op_a(a) @ op_b(b) + op_a(a2) @ op_b(b2)


def test_program_prints_and_caches_the_low_rank_term():
    p = library.rms_gate_up_swiglu().with_low_rank()
    assert p is library.rms_gate_up_swiglu().with_low_rank()
    assert "acc[M, N] = a[M, K] @ b[N, K]^T + a2[M, R] @ b2[N, R]^T" in str(p)
    assert "a2[M, R] @ b2[R, N]" in str(library.input_grad().with_low_rank())
    assert p != library.rms_gate_up_swiglu() and p.outputs == library.rms_gate_up_swiglu().outputs


@pytest.mark.parametrize("name", ["rms_gate_up_swiglu", "residual_rms_stats", "rms_norm_backward", "swiglu_backward",
                                  "rms_qkv_rope", "input_grad", "weight_grad"])
def test_reference_backend_adds_the_low_rank_product(name):
    """Every library program's accumulator includes op(A2) @ op(B2): the epilogue outputs equal those of
    the base program run on an accumulator that already holds the sum (float64, exact up to rounding)."""
    base = library.PROGRAMS[name]()
    program = base.with_low_rank()
    gemm = program.gemm
    n = 2 * N if name == "swiglu_backward" else N  # its N is the ffn width of a [M, 2N] preact
    a, b, a2, b2, acc = low_rank_operands(gemm, torch.float64, n=n)
    tensors = _inputs(base, acc.shape[0], n)
    got = execute(program, a, b, a2=a2, b2=b2, backend="reference", **tensors)
    # the same epilogue with the sum as a plain GEMM's accumulator: acc @ I (I symmetric: either B layout)
    eye = torch.eye(acc.shape[1], dtype=torch.float64)
    want = execute(base, acc if gemm.a_layout == "mk" else acc.t().contiguous(), eye, backend="reference", **tensors)
    if name == "rms_gate_up_swiglu":  # and against the formula itself: preact = rstd * (a b^T + a2 b2^T)
        torch.testing.assert_close(got["preact"], tensors["rstd"][:, None] * acc, rtol=1e-12, atol=1e-12)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=1e-12, msg=lambda m: f"{key}: {m}")


def _inputs(program, m, n):
    """Random named inputs for ``program`` at [m, n] (positive rstd, integer targets where needed)."""
    from codagen.epilogue.ir import ColVector, RowVector, ScalarInput, TileInput
    tensors = {}
    for name, e in program.inputs.items():
        if isinstance(e, RowVector):
            tensors[name] = torch.randint(0, n, (m,)) if e.index else torch.rand(m, dtype=torch.float64) + 0.5
        elif isinstance(e, ColVector):
            tensors[name] = torch.randn(e.width.columns(n), dtype=torch.float64)
        elif isinstance(e, ScalarInput):
            tensors[name] = torch.rand(1, dtype=torch.float64)
        elif isinstance(e, TileInput):
            tensors[name] = torch.randn(m, e.width.columns(n), dtype=torch.float64)
    return tensors


@pytest.mark.parametrize("layouts", ["mk,nk", "mk,kn", "km,kn", "km,nk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_interpreter_every_layout(layouts, dtype):
    """The generated kernel's R loop in every operand layout, R not a multiple of the step (masked), several
    tiles per program (M, N, K past the 32-wide interpreter tiles): against float64, within the 2x rule of
    the same sum computed in ``dtype`` by PyTorch."""
    a_layout, b_layout = layouts.split(",")
    gemm = Gemm(a_layout, b_layout, low_rank=True)
    from codagen.epilogue.ir import Accumulator, Program, Store
    program = Program("low_rank_gemm", gemm, (Store("out", Accumulator(), dtype="float32"),))
    a, b, a2, b2, acc = low_rank_operands(gemm, dtype, m=70, n=40, k=50, r=19)
    got = execute(program, a, b, a2=a2, b2=b2, backend="triton")["out"]
    assert not got.isnan().any()
    lower = (a.float() if a_layout == "mk" else a.float().t()) @ (b.float().t() if b_layout == "nk" else b.float())
    lower = lower + (a2.float() if a_layout == "mk" else a2.float().t()) @ (
        b2.float().t() if b_layout == "nk" else b2.float())
    torch_err = (lower.double() - acc).abs().max().item()
    assert (got.double() - acc).abs().max().item() <= 2 * torch_err + 1e-6 + 1e-6 * acc.abs().max().item()


@pytest.mark.parametrize("name", ["rms_gate_up_swiglu", "rms_norm_backward", "swiglu_backward", "rms_qkv_rope"])
def test_triton_interpreter_library_programs_fp16(name):
    """Library programs with the pair on the interpreter (fp16 operands, outputs NaN-poisoned first) equal the
    reference backend on the same operands."""
    base = library.PROGRAMS[name]()
    program = base.with_low_rank()
    n = 2 * N if name == "swiglu_backward" else N
    a, b, a2, b2, _ = low_rank_operands(program.gemm, torch.float16, m=M, n=n, k=K, r=R)
    tensors = {k: (v.float() if v.dtype == torch.float64 else v) for k, v in _inputs(base, M, n).items()}
    if "residual" in tensors:
        tensors["residual"] = tensors["residual"].half()
    got = execute(program, a, b, a2=a2, b2=b2, backend="triton", **tensors)
    want = execute(program, a, b, a2=a2, b2=b2, backend="reference", **tensors)
    from codagen.epilogue.ir import ColPartial, RowPartial
    for out in program.outputs:  # partials are per tile, and tiles differ between backends: compare their sums
        key = out.name
        g, w = got[key].float(), want[key].float()
        assert not g.isnan().any(), key
        if isinstance(out, (ColPartial, RowPartial)):
            axis = 0 if isinstance(out, ColPartial) else 1
            g, w = g.sum(axis), w.sum(axis)
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2, msg=lambda m: f"{key}: {m}")


def test_bind_refuses_bad_low_rank_operands():
    program = library.rms_gate_up_swiglu().with_low_rank()
    a, b, a2, b2, _ = low_rank_operands(program.gemm, torch.float32)
    rstd = torch.rand(M)
    with pytest.raises(ProgramError, match=r"missing tensor\(s\) \['a2', 'b2'\]"):
        bind(program, a, b, {"rstd": rstd})
    with pytest.raises(ProgramError, match=r"unexpected tensor\(s\) \['a2', 'b2'\]"):
        bind(library.rms_gate_up_swiglu(), a, b, {"rstd": rstd, "a2": a2, "b2": b2})
    with pytest.raises(ProgramError, match=r"a2: expected shape \[M, R\]"):
        bind(program, a, b, {"rstd": rstd, "a2": a2[:, :3].contiguous(), "b2": b2})
    with pytest.raises(ProgramError, match=r"b2: expected shape \[N, R\]"):
        bind(program, a, b, {"rstd": rstd, "a2": a2, "b2": b2[1:]})
    with pytest.raises(ProgramError, match="a2: expected dtype torch.float32"):
        bind(program, a, b, {"rstd": rstd, "a2": a2.half(), "b2": b2})
    with pytest.raises(ProgramError, match="b2: expected a 2-D matrix"):
        bind(program, a, b, {"rstd": rstd, "a2": a2, "b2": b2[:, 0]})
    with pytest.raises(ProgramError, match="b2: expected a contiguous tensor"):
        bind(program, a, b, {"rstd": rstd, "a2": a2, "b2": torch.randn(R, N).t()})
    with pytest.raises(ProgramError, match="a2: expected a torch.Tensor"):
        bind(program, a, b, {"rstd": rstd, "a2": 1.0, "b2": b2})
    assert bind(program, a, b, {"rstd": rstd, "a2": a2, "b2": b2}).r == R


def test_pingpong_refuses_low_rank_programs():
    from codagen.backends.triton import pingpong
    from codagen.backends.triton.configs import candidates
    program = library.rms_gate_up_swiglu().with_low_rank()
    assert pingpong.refusal(library.rms_gate_up_swiglu()) is None
    assert "low-rank" in pingpong.refusal(program)
    with pytest.raises(ValueError, match="low-rank operand pair"):
        pingpong.generate(program)
    kw = dict(target="sm_90", operand_bytes=2, smem_limit=232448, tma=True, tma_epilogue=True)
    assert any(cfg.schedule == "pingpong" for cfg in candidates(library.rms_gate_up_swiglu(), **kw))
    assert all(cfg.schedule != "pingpong" for cfg in candidates(program, **kw))


@pytest.mark.parametrize("name", ["rms_gate_up_swiglu", "rms_norm_backward"])
def test_persistent_kernel_compiles_for_sm90(name):
    """The generated ``tl`` kernel with the R loop compiles for Hopper (TMA mainloop and epilogue, bf16)
    without a GPU, and its PTX holds the tensor-core instructions of both loops."""
    from tests.sm90 import sm90_ptx
    constexprs = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, BLOCK_R=16, EPILOGUE_SPLIT=2, SUB_N=64,
                      TMA_MAINLOOP=True, TMA_EPILOGUE=True, UPCAST_OPERANDS=False, DOT_PRECISION="tf32",
                      FLATTEN=True, PORTABLE=False, PDL=False, PREFETCH_K=0)
    leading = {"a_ptr": "*bf16", "b_ptr": "*bf16", "a2_ptr": "*bf16", "b2_ptr": "*bf16"}
    ptx = sm90_ptx(library.PROGRAMS[name]().with_low_rank(), "kernel", leading, ("M", "N", "K", "R"), constexprs,
                   8, 3)
    assert "wgmma.mma_async" in ptx or "mma.sync" in ptx


def test_tuning_falls_back_to_the_base_programs_choice(monkeypatch, tmp_path):
    """Untimed (the default), a low-rank program without a tuned choice of its own takes its base program's;
    a base choice the persistent schedule cannot take (ping-pong) gives the base program's fastest
    persistent config; with no base choice, the untimed heuristic (the first persistent candidate)."""
    from codagen.backends.triton.backend import TritonBackend
    from codagen.backends.triton.configs import KernelConfig, TuningCache
    persistent = [KernelConfig(128, 128, 64, 3, 8, 2), KernelConfig(128, 256, 64, 3, 8, 2)]
    pingpong_cfg = KernelConfig(128, 128, 64, 3, 8, 4, schedule="pingpong")

    backend = TritonBackend(autotune=False)
    monkeypatch.setattr(backend, "_candidates", lambda bound, launch: list(persistent))
    monkeypatch.setattr(backend, "_tuning_key", lambda bound, launch: f"{bound.program.name}:{bound.program.gemm!r}")
    monkeypatch.setattr(backend, "_tune", lambda *args: pytest.fail("timed without being asked"))
    program = library.rms_gate_up_swiglu().with_low_rank()
    a, b, a2, b2, _ = low_rank_operands(program.gemm, torch.float32)
    bound = bind(program, a, b, {"rstd": torch.rand(M), "a2": a2, "b2": b2})
    base_key = f"{program.name}:{library.rms_gate_up_swiglu().gemm!r}"

    def table(name, entries):
        tuning = TuningCache(tmp_path / f"{name}.json")
        for cfg, timings in entries:
            tuning.put(base_key, cfg, {c.short(): ms for c, ms in timings.items()})
        return tuning
    backend.tuning = table("base", [(persistent[1], {})])
    assert backend._choose(bound, None, interpret=False) == persistent[1]
    backend.tuning = table("pingpong", [(pingpong_cfg, {persistent[0]: 2.0, persistent[1]: 1.0})])
    assert backend._choose(bound, None, interpret=False) == persistent[1]
    backend.tuning = table("empty", [])
    assert backend._choose(bound, None, interpret=False) == persistent[0]
