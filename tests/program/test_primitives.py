"""Every primitive's example programs (``Expr.examples``), one parametrized test each way they run:

- the reference backend on float64 tensors against the example's float64 math;
- the Triton interpreter in every GEMM layout (fp16; fp32 in ``nn.Linear``'s), by the numerics rule;
- the ping-pong kernel compiled for sm_90 where its schedule takes the program, else the schedule's
  refusal is the primitive's stated reason.

A new primitive module brings its examples and is tested here with no other edit.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from codagen.backends import execute
from codagen.backends.triton import TritonBackend, load_kernel, pingpong
from codagen.bench.kernels import eager_epilogue, gemm, random_inputs
from codagen.epilogue import primitives
from codagen.epilogue.bind import bind
from codagen.epilogue.ir import PRIMITIVES, Gemm, Program

from ..conftest import finished

EXAMPLES = {f"{cls.__name__}-{example.program.name}": example
            for cls in PRIMITIVES.values() for example in cls.examples()}
LAYOUTS = {"linear": Gemm.linear(), "input_grad": Gemm.input_grad(), "weight_grad": Gemm.weight_grad()}
M, K = 21, 24


@pytest.fixture(scope="module", autouse=True)
def kernel_cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CODAGEN_CACHE_DIR", str(tmp_path_factory.mktemp("kernels")))
        yield


def relaid(program: Program, gemm: Gemm) -> Program:
    return Program(program.name, gemm, program.outputs, doc=program.doc)


def oracle(example, program: Program, a, b, tensors) -> dict[str, torch.Tensor]:
    """The example's float64 math on the float64 accumulator of these operands."""
    a64 = a.double() if program.gemm.a_layout == "mk" else a.double().T
    b64 = b.double().T if program.gemm.b_layout == "nk" else b.double()
    up = {name: (t.double() if t.dtype.is_floating_point else t) for name, t in tensors.items()}
    return example.oracle(a64 @ b64, up)


def test_every_primitive_has_examples():
    assert {name.split("-")[0] for name in EXAMPLES} == set(PRIMITIVES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_reference_is_the_float64_math(name):
    example = EXAMPLES[name]
    program = example.program
    a, b, tensors = random_inputs(program, M, example.n, K, torch.float64, "cpu")
    got = finished(program, execute(program, a, b, backend="reference", **tensors))
    want = oracle(example, program, a, b, tensors)
    assert set(got) == set(want)
    for out in got:
        torch.testing.assert_close(got[out], want[out], rtol=1e-10, atol=1e-10, msg=f"{name}: {out}")


@pytest.mark.parametrize("dtype,layout", [(torch.float16, "linear"), (torch.float16, "input_grad"),
                                          (torch.float16, "weight_grad"), (torch.float32, "linear")],
                         ids=["fp16-linear", "fp16-input_grad", "fp16-weight_grad", "fp32-linear"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_interpreter_in_every_layout(name, layout, dtype):
    """Error against the float64 math at most twice that of the same computation in PyTorch at the
    operand dtype (the GEMM rounded to it, the epilogue in fp32), plus 1e-6; fp32: 1e-5 relative."""
    example = EXAMPLES[name]
    program = relaid(example.program, LAYOUTS[layout])
    a, b, tensors = random_inputs(program, M, example.n, K, dtype, "cpu")
    got = finished(program, TritonBackend(autotune=False).run(bind(program, a, b, {k: v.clone() for k, v in
                                                                                    tensors.items()})))
    want = oracle(example, program, a, b, tensors)
    torch_at_dtype = finished(program, eager_epilogue(program, gemm(program, a, b), {k: v.clone() for k, v in
                                                                                       tensors.items()}))
    for out, w in want.items():
        g = got[out]
        assert not torch.isnan(g).any(), f"{name}.{out}: an element was not written"
        err = (g - w).abs().max().item()
        if dtype == torch.float32:
            bound = 1e-5 * max(1.0, w.abs().max().item())
        else:
            bound = 2 * (torch_at_dtype[out].reshape(w.shape) - w).abs().max().item() + 1e-6
        assert err <= bound, f"{name}.{out} ({layout}, {dtype}): error {err:.3g} > {bound:.3g}"


@pytest.mark.skipif(not pingpong.RUNTIME, reason="the installed Triton has no Gluon runtime for the ping-pong kernels")
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_pingpong_compiles_for_sm90_or_states_why_not(name):
    program = EXAMPLES[name].program
    refusals = [r for e in program.expressions() if (r := e.pingpong_refusal()) is not None]
    if refusals:
        assert pingpong.refusal(program) == refusals[0]
        with pytest.raises(ValueError, match="cannot take this program"):
            pingpong.generate(program)
        return
    assert pingpong.refusal(program) is None
    kernel = load_kernel(program, dtypes="test", arch="sm_90", interpret=False, schedule="pingpong")
    compiled = pingpong.compile_sm90(kernel, program, pingpong.PIECE_WIDTHS[0], torch.bfloat16)
    assert "wgmma.mma_async" in compiled.asm["ptx"]


def test_a_primitive_is_one_module():
    """Every module of ``codagen.epilogue.primitives`` registers exactly one primitive, and every primitive
    lives in a module of its own there (so a new primitive is one new file)."""
    modules = {}
    for cls in PRIMITIVES.values():
        modules.setdefault(cls.__module__, []).append(cls.__name__)
    assert all(module.startswith("codagen.epilogue.primitives.") for module in modules)
    assert all(len(names) == 1 for names in modules.values()), modules
    files = {p.stem for p in Path(primitives.__file__).parent.glob("*.py")} - {"__init__"}
    assert {module.rsplit(".", 1)[1] for module in modules} == files
