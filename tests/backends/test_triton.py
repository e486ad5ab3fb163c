"""Triton backend against the reference backend.

CPU tests run the generated kernels in the Triton interpreter (tiny shapes, 32x32x32 tiles). GPU tests
(``-m gpu``) run compiled kernels at realistic sizes in bf16 and fp16.

Numerics rule (docs/method.md section 4, the paper's gate): for every output, after finishing partials,
``max |triton - exact| <= 2 * max |pytorch_lowp - exact| + 1e-6`` where ``exact`` is the reference
backend on float64 copies of the same inputs and ``pytorch_lowp`` is the same computation done the
unfused PyTorch way at the input dtype (GEMM output rounded to that dtype, epilogue in fp32). With
float32 operands both sides are fp32 rounding noise, so the rule is a relative one instead:
``max |triton - exact| <= 1e-5 * max(1, max |exact|)``.
"""
from __future__ import annotations

import ast
import os

import pytest
import torch

from codagen.backends import execute
from codagen.backends.triton import INTERPRETER_CONFIG, KernelConfig, TritonBackend, arrivals, program_source
from codagen.backends.triton.configs import candidates
from codagen.backends.triton.targets import TARGETS
from codagen.bench.kernels import random_inputs
from codagen.epilogue import library
from codagen.epilogue.bind import bind
from codagen.epilogue.ir import (
    Accumulator,
    Binary,
    ColPartial,
    ColVector,
    Constant,
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
)

# --------------------------------------------------------------------------------------------------
# Every library program, small and odd shapes, both mainloops (TMA descriptors when aligned)
# --------------------------------------------------------------------------------------------------
SHAPES = [(1, 70, 48), (7, 69, 45), (129, 66, 40), (40, 128, 64)]
#: the library's programs (its options' defaults) and the GeGLU MLP's, by name
PROGRAMS = {**library.PROGRAMS, "rms_gate_up_geglu": lambda: library.rms_gate_up_swiglu(activation="gelu_tanh"),
            "geglu_backward": lambda: library.swiglu_backward("gelu_tanh")}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_library_program(check, name, shape, dtype):
    program = PROGRAMS[name]()
    m, n, k = shape
    if n % 2 and program.needs_even_n():
        n += 1
    check(program, m, n, k, dtype)


@pytest.mark.parametrize("name", ["rms_gate_up_swiglu", "swiglu_backward", "rms_lm_head_cross_entropy_backward",
                                  "rms_gate_up_geglu", "geglu_backward"])
def test_library_program_bf16_interpreter(check, name):
    """bf16 runs in the interpreter with the dot upcast to fp32 (its bf16 dot is wrong)."""
    check(PROGRAMS[name](), 33, 66, 48, torch.bfloat16)


@pytest.mark.parametrize("split,block_n", [(2, 64), (4, 64), (2, 32)])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("name", ["swiglu_backward", "rms_lm_head_cross_entropy", "rms_norm_backward",
                                  "rms_qkv_rope", "residual_rms_stats", "geglu_backward"])
def test_epilogue_split(check, name, split, block_n, tma):
    """The accumulator cut into 2 or 4 column slices (partials merged across slices), TMA or pointer epilogue."""
    cfg = KernelConfig(32, block_n, 32, 1, 4, epilogue_split=split, tma_epilogue=tma, group_m=2)
    outs = check(PROGRAMS[name](), 45, 2 * block_n + 10, 48, torch.float16,
                 backend=TritonBackend(config=cfg, tma=tma))
    program = PROGRAMS[name]()
    for o in program.outputs:
        if isinstance(o, RowPartial):
            assert outs[o.name].shape == (45, -(-(2 * block_n + 10) // block_n))


SPLIT_K_PROGRAMS = {name: PROGRAMS[name] for name in (
    "residual_rms_stats", "rms_qkv_rope", "rms_gate_up_swiglu", "rms_linear", "rms_lm_head_cross_entropy",
    "weight_grad", "input_grad", "rms_norm_backward", "swiglu_backward", "geglu_backward")}
SPLIT_K_PROGRAMS["weight_grad_accumulate"] = lambda: library.weight_grad(True, "float32")


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("name", sorted(SPLIT_K_PROGRAMS))
def test_split_k(check, name, split_k, tma):
    """K cut into 2 or 3 ranges (3 leaves the last range short: 5 K tiles), their partials summed by each
    tile's last range to finish, then the epilogue (accumulated stores included), in one launch: the
    numerics rule holds, RowPartial outputs keep their [M, cdiv(N, BLOCK_N)] layout, and the arrival
    counters are back at zero for the next launch."""
    cfg = KernelConfig(16, 32, 16, 1, 4, epilogue_split=2, group_m=1, split_k=split_k)
    program = SPLIT_K_PROGRAMS[name]()
    backend = TritonBackend(config=cfg, tma=tma)
    outs = check(program, 3, 74, 80, torch.float16, backend=backend)
    assert backend.launches == 1
    assert not arrivals.counters(torch.device("cpu"), 3).any()
    for o in program.outputs:
        if isinstance(o, RowPartial):
            assert outs[o.name].shape == (3, 3)


def test_split_k_deterministic():
    program = library.residual_rms_stats()
    a, b, tensors = random_inputs(program, 5, 66, 96, torch.float16, "cpu")
    backend = TritonBackend(config=KernelConfig(16, 32, 16, 1, 4, group_m=1, split_k=3))
    first, second = (backend.run(bind(program, a, b, dict(tensors))) for _ in range(2))
    for key in first:
        assert torch.equal(first[key].view(torch.uint8), second[key].view(torch.uint8)), key


def test_split_k_refusals():
    with pytest.raises(ValueError, match="split_k"):
        KernelConfig(16, 32, 16, 1, 4, tma_epilogue=True, split_k=2)
    with pytest.raises(ValueError, match="split_k"):
        KernelConfig(16, 32, 16, 1, 4, split_k=0)
    program = library.rms_linear().with_low_rank()  # its generated module has no split-K kernel
    a, b = torch.randn(3, 32, dtype=torch.float16), torch.randn(64, 32, dtype=torch.float16)
    tensors = dict(a2=torch.randn(3, 8, dtype=torch.float16), b2=torch.randn(64, 8, dtype=torch.float16),
                   rstd=torch.rand(3) + 0.5)
    backend = TritonBackend(config=KernelConfig(16, 32, 16, 1, 4, group_m=1, split_k=2))
    with pytest.raises(ProgramError, match="rms_linear: split_k > 1 is not supported with a low-rank"):
        backend.run(bind(program, a, b, tensors))


@pytest.mark.parametrize("inverse", [False, True], ids=["rope", "inverse"])
def test_rope_long_positions(check, llama3_rope_inputs, inverse):
    """RoPE's reduced sin/cos at LLaMA-3 positions up to 16384 (interpreter: the reduction is shared)."""
    program = Program("rope_long", Gemm.linear(), (
        Store("out", Rope(acc, RowVector("positions"), ColVector("frequencies", Width.HALF), inverse=inverse)),))
    check(program, 64, 64, 32, torch.float16, inputs=llama3_rope_inputs(64))


def test_pair_form_consumers(check):
    """A pair map's result kept as (even, odd) halves: elementwise maps with column, row and scalar
    operands, a logsumexp and a sum RowPartial on the halves, a ColPartial and a store of the join."""
    rope = Rope(acc, RowVector("positions"), ColVector("frequencies", Width.HALF))
    y = Unary("exp", rope * ColVector("c") + RowVector("r")) - ScalarInput("s")
    program = Program("pair_form", Gemm.linear(), (
        Store("out", y), RowPartial("lse", rope, "logsumexp"), RowPartial("total", y * rope),
        ColPartial("col_sums", y)))
    for cfg in (INTERPRETER_CONFIG, KernelConfig(32, 64, 32, 1, 4, epilogue_split=2, group_m=2)):
        check(program, 45, 138, 48, torch.float16, backend=TritonBackend(config=cfg))


def test_segment_sum(check):
    """SegmentSum on a full tile, on a pair map's (even, odd) halves (and consumed in that form), at half and
    double width and feeding a row partial; whole-tile and split sub-tiles, TMA and pointer epilogues."""
    rope = Rope(acc, RowVector("positions"), ColVector("frequencies", Width.HALF))
    head_rstd = Unary("rsqrt", SegmentSum(rope * rope, 16) * (1 / 16) + 1e-6)
    program = Program("segments", Gemm.linear(), (
        Store("full", SegmentSum(acc * c, 32)),
        Store("pairs", rope * head_rstd),
        Store("half", SegmentSum(SwiGLU(acc), 16)),
        Store("double", SegmentSum(SwiGLUBackward(TileInput("t2", Width.DOUBLE), acc), 32)),
        RowPartial("total", SegmentSum(acc, 16) * head_rstd)))
    for cfg in (INTERPRETER_CONFIG, KernelConfig(32, 64, 32, 1, 4, epilogue_split=2, tma_epilogue=True, group_m=2),
                KernelConfig(32, 128, 32, 1, 4, epilogue_split=4, group_m=2)):
        check(program, 45, 192, 40, torch.float16, backend=TritonBackend(config=cfg))


INFERENCE_PROGRAMS = {"rms_gate_up_swiglu_inference": lambda: library.rms_gate_up_swiglu(save_preact=False),
                      "rms_gate_up_geglu_inference": lambda: library.rms_gate_up_swiglu(False, "gelu_tanh"),
                      "rms_qkv_rope_qk_norm_inference": lambda: library.rms_qkv_rope(16, 1e-6, save_preact=False)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("name", sorted(INFERENCE_PROGRAMS))
def test_inference_program(check, name, dtype):
    """The forwards without ``preact``: their one output as their training twin computes it."""
    program = INFERENCE_PROGRAMS[name]()
    assert program.name == name and [o.name for o in program.outputs] == [o.name for o in program.outputs
                                                                          if o.name != "preact"]
    assert {o.name for o in program.tuning_stand_in.outputs} == {o.name for o in program.outputs} | {"preact"}
    check(program, 7, 96, 40, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(INFERENCE_PROGRAMS))
def test_gpu_inference_program(check, name):
    check(INFERENCE_PROGRAMS[name](), 1000, 1536, 1024, torch.bfloat16, device="cuda")
    check(INFERENCE_PROGRAMS[name](), 1, 1536, 1024, torch.bfloat16, device="cuda")  # a decode row


#: the LM-head programs with Gemma 2's final logit soft-cap, the cap of the logits' scale (acc ~ N(0, 1), rstd in
#: [0.5, 1.5): the tanh saturated and not)
SOFTCAP_PROGRAMS = {p.name: p for p in (library.rms_linear(1.5), library.rms_linear(1.5, save_preact=False),
                                        library.rms_lm_head_cross_entropy(1.5),
                                        library.rms_lm_head_cross_entropy_backward(1.5))}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(SOFTCAP_PROGRAMS))
def test_soft_capped_program(check, name, shape, dtype):
    check(SOFTCAP_PROGRAMS[name], *shape, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SOFTCAP_PROGRAMS))
def test_gpu_soft_capped_program(check, name):
    check(SOFTCAP_PROGRAMS[name], 1000, 1536, 1024, torch.bfloat16, device="cuda")
    check(SOFTCAP_PROGRAMS[name], 515, 1000, 1000, torch.bfloat16, device="cuda")  # N, K past tile edges


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("head_dim, shape", [(16, (7, 96, 40)), (32, (129, 128, 48)), (16, (1, 64, 24))])
def test_qk_norm_program(check, head_dim, shape, dtype):
    """F4 with QK-norm: per-head rsqrt of a segmented sum of squares inside the RoPE epilogue."""
    check(library.rms_qkv_rope(head_dim, 1e-6), *shape, dtype)


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_qk_norm_program_split_epilogue(check, tma):
    cfg = KernelConfig(32, 128, 32, 1, 4, epilogue_split=2, tma_epilogue=tma, group_m=2)  # sub-tiles of 64: 2 heads
    check(library.rms_qkv_rope(32, 1e-6), 45, 320, 48, torch.float16, backend=TritonBackend(config=cfg, tma=tma))


def test_segment_wider_than_the_tile_is_refused():
    """Heads wider than any sub-tile: the candidate filter names head_dim and the sub-tile widths; a forced
    config narrower than a head fails the kernel's static check (the interpreter's tile widens to whole
    heads: tests/test_robustness.py)."""
    program = library.rms_qkv_rope(128, 1e-6)
    with pytest.raises(ProgramError, match=r"groups of \[128\] columns \(the QK-norm head_dim\).*widths \[64\]"):
        candidates(program, target="sm_90", operand_bytes=4, smem_limit=232448, tma=True)  # the fp32 pool: 64x64 tiles
    kept = candidates(program, target="sm_90", operand_bytes=2, smem_limit=232448, tma=True)
    assert kept and all(cfg.sub_n % 128 == 0 for cfg in kept)
    a, b, tensors = random_inputs(library.rms_qkv_rope(64, 1e-6), 8, 128, 16, torch.float16, "cpu")
    with pytest.raises(Exception, match=r"segment_sum\(size=64\): the epilogue sub-tile"):
        TritonBackend(config=INTERPRETER_CONFIG).run(bind(library.rms_qkv_rope(64, 1e-6), a, b, tensors))  # 32 wide


def test_qk_norm_in_epilogue_where_every_target_has_whole_head_candidates():
    """``codagen.ops.qkv.qk_norm_in_epilogue``, the op's choice of the one-GEMM QK-norm program, holds exactly where
    the Triton backend has candidates for that program on every target, with TMA-aligned operands or not; every
    other even head_dim takes the GEMM and the row kernel. float64 (the reference backend's) follows float32."""
    from codagen.ops.qkv import qk_norm_in_epilogue
    for head_dim in range(2, 514, 2):
        program = library.rms_qkv_rope(head_dim, 1e-6)
        for dtype in (torch.bfloat16, torch.float32):
            fits = []
            for target in TARGETS.values():
                for tma in (True, False):
                    try:
                        candidates(program, target=target.name, operand_bytes=dtype.itemsize,
                                   smem_limit=target.shared_memory, tma=tma, tma_epilogue=tma)
                    except ProgramError:
                        fits.append(False)
                    else:
                        fits.append(True)
            assert qk_norm_in_epilogue(head_dim, dtype) == all(fits), (head_dim, dtype, fits)
        assert qk_norm_in_epilogue(head_dim, torch.float64) == qk_norm_in_epilogue(head_dim, torch.float32)
    assert [hd for hd in range(2, 514, 2) if qk_norm_in_epilogue(hd, torch.float16)] == [2, 4, 8, 16, 32, 64, 128]


def test_pointer_mainloop_forced(check):
    check(library.rms_norm_backward(), 20, 64, 64, torch.float16, backend=TritonBackend(autotune=False, tma=False))


# --------------------------------------------------------------------------------------------------
# Every primitive, alone
# --------------------------------------------------------------------------------------------------
acc = Accumulator()
r = RowVector("r")
c = ColVector("c")
PRIMITIVES = {
    **{f"unary_{op}": (Store("out", Unary(op, acc if op not in ("log", "rsqrt") else Unary("exp", acc))),) for op in
       ("neg", "exp", "log", "sigmoid", "silu", "square", "rsqrt")},
    **{f"binary_{op}": (Store("out", Binary(op, acc, TileInput("t") if op != "div" else Unary("exp", TileInput("t")))),)
       for op in ("add", "sub", "mul", "div", "max")},
    "constant": (Store("out", acc * 0.5 + Constant(2.0)),),
    "row_col_scalar": (Store("out", acc * r + c * ScalarInput("s")),),
    "row_times_col_only": (Store("out", r * c),),
    "col_half_and_tile_double": (Store("out", SwiGLU(TileInput("t2", Width.DOUBLE)) * acc),
                                 Store("half", SwiGLU(acc) * ColVector("ch", Width.HALF), dtype="float32")),
    "onehot": (Store("out", OneHot(RowVector("idx", index=True)) + acc),),
    "swiglu_double": (Store("out", SwiGLU(TileInput("t2", Width.DOUBLE))),),
    "swiglu_backward": (Store("out", SwiGLUBackward(TileInput("t2", Width.DOUBLE), acc)),),
    "rope": (Store("out", Rope(acc, RowVector("positions"), ColVector("frequencies", Width.HALF))),),
    "rope_inverse": (Store("out", Rope(acc, RowVector("positions"), ColVector("frequencies", Width.HALF),
                                       inverse=True)),),
    "row_partials": (RowPartial("lse_half", SwiGLU(acc), "logsumexp"), RowPartial("sum", acc * r)),
    "col_partial_double": (ColPartial("colsum", SwiGLUBackward(TileInput("t2", Width.DOUBLE), acc)),),
    "store_dtypes": (Store("o32", acc, dtype="float32"), Store("o16", acc, dtype="float16"),
                     Store("obf", acc, dtype="bfloat16")),
    "accumulate": (Store("acc_out", acc * 2.0, accumulate=True),),
    "segment_sum_pairs": (Store("out", SegmentSum(acc * r, 2)),),  # N = 70: only 2-column groups divide it
}


@pytest.mark.parametrize("gemm", [Gemm.linear(), Gemm.input_grad(), Gemm.weight_grad()],
                         ids=["mk_nk", "mk_kn", "km_kn"])
@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_primitive(check, name, gemm):
    program = Program(f"prim_{name}", gemm, PRIMITIVES[name])
    check(program, 37, 70, 40, torch.float16)


def test_accumulate_updates_callers_tensor_in_place():
    program = library.weight_grad(accumulate=True, dtype="float32")
    a, b, tensors = random_inputs(program, 33, 40, 24, torch.float16, "cpu")
    before = tensors["grad_weight"].clone()
    outs = TritonBackend().run(bind(program, a, b, tensors))
    assert outs["grad_weight"] is tensors["grad_weight"]
    expected = before + (a.float().t() @ b.float())
    torch.testing.assert_close(tensors["grad_weight"], expected, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# Edges, determinism, source, errors
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n", [(0, 16), (16, 0)])
def test_empty_outputs_without_launch(m, n):
    program = library.residual_rms_stats()
    a, b, tensors = random_inputs(program, m, n, 8, torch.float16, "cpu")
    backend = TritonBackend()
    outs = backend.run(bind(program, a, b, tensors))
    assert backend.launches == 0
    assert outs["residual_out"].shape == (m, n) and outs["partial_sumsq"].shape[0] == m


def test_k_zero_gives_zero_accumulator():
    program = library.residual_rms_stats()
    a, b, tensors = random_inputs(program, 9, 20, 0, torch.float16, "cpu")
    outs = TritonBackend().run(bind(program, a, b, tensors))
    torch.testing.assert_close(outs["residual_out"], tensors["residual"])


@pytest.mark.parametrize("name", ["swiglu_backward", "rms_lm_head_cross_entropy", "rms_norm_backward"])
def test_deterministic(name):
    program = library.PROGRAMS[name]()
    a, b, tensors = random_inputs(program, 70, 66, 48, torch.float16, "cpu")
    first = TritonBackend().run(bind(program, a, b, {k: v.clone() for k, v in tensors.items()}))
    second = TritonBackend().run(bind(program, a, b, {k: v.clone() for k, v in tensors.items()}))
    for key in first:
        assert torch.equal(first[key].view(torch.uint8), second[key].view(torch.uint8)), key


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_source_is_printable_python(name):
    program = PROGRAMS[name]()
    src = program_source(program)
    ast.parse(src)
    assert f"def {name}_kernel(" in src and "tl.dot(" in src and "@triton.jit" in src
    assert str(program).splitlines()[0] in src  # the program's math is in the header


def test_source_cached_on_disk(check, kernel_cache_dir):
    check(library.rms_linear(), 5, 16, 16, torch.float16)
    files = os.listdir(os.path.join(kernel_cache_dir, "triton", "kernels"))
    assert any(f.startswith("rms_linear_") and f.endswith(".py") for f in files)


def test_execute_selects_triton_on_cpu():
    program = library.rms_linear()
    a, b, tensors = random_inputs(program, 5, 16, 16, torch.float16, "cpu")
    out = execute(program, a, b, backend="triton", **tensors)["out"]
    ref = execute(program, a, b, backend="reference", **tensors)["out"]
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)


def test_float64_is_refused_clearly():
    program = library.linear()
    a, b = torch.randn(4, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    with pytest.raises(ProgramError, match="float16, bfloat16, float32 or float8_e4m3fn operands, got a: "
                                           "torch.float64"):
        TritonBackend().run(bind(program, a, b, {}))


def test_interpreter_leaves_triton_language_as_it_found_it(check):
    """An interpreted launch swaps triton.language builtins for numpy ones; all must be back afterwards,
    or a later compile for the GPU in the same process fails (seen: the ping-pong kernel's sm_90 compile
    inside ``tl.cdiv`` after the interpreter tests)."""
    import triton.language as tl

    namespaces = (tl, tl.core, tl.math, tl.tensor, tl.core.tensor_descriptor_base)
    before = {(ns, name): value for ns in namespaces for name, value in vars(ns).items()}
    check(library.rms_linear(), 7, 69, 45, torch.float16)  # its kernel calls tl.cdiv, a jit helper of tl.core
    changed = sorted(f"{ns.__name__}.{name}" for (ns, name), value in before.items() if vars(ns).get(name) is not value)
    assert not changed, f"left swapped by the interpreter: {changed}"


def test_interpreter_config_is_small():
    assert INTERPRETER_CONFIG.block_m * INTERPRETER_CONFIG.block_n <= 32 * 32


def test_kernel_code_hash_ignores_docstrings_and_comment_lines(tmp_path):
    from codagen.backends.triton.tuning import _code_of
    module = tmp_path / "m.py"
    module.write_text('"""Module doc."""\nimport math\n\n\n'
                      'def f(x):\n    """Doc."""\n    # why\n    return math.exp(x)\n')
    code = _code_of(module)
    module.write_text('"""Another\ndoc."""\nimport math\n# new comment\n\n'
                      'def f(x):\n    """Other doc."""\n    return math.exp(x)\n')
    assert _code_of(module) == code
    module.write_text('"""Module doc."""\nimport math\n\n\ndef f(x):\n    """Doc."""\n    return math.exp(-x)\n')
    assert _code_of(module) != code


def test_shipped_tuning_covers_the_kernel_benchmark():
    """tuned.json has a choice for every fused kernel of ``codagen bench kernels`` (bf16, the H200). Its
    keys hash each kernel's code (``kernel_hash``): a change to a kernel's generated source, to
    ``device_math.py`` or to ``pingpong.py`` drops that program's entries, and this test names them; retune
    on the GPU (``bench/tune_buckets.py``, or ``CODAGEN_TRITON_RETUNE=1 codagen bench kernels``) and merge."""
    import json

    from codagen.backends.triton.configs import TuningCache
    from codagen.backends.triton.tuning import tuning_key
    from codagen.bench.kernels import MODELS, kernel_cases
    shipped = json.loads(TuningCache.SHIPPED.read_text())
    versions = {key.split("|")[1] for key in shipped if key.startswith("NVIDIA H200|")}
    assert len(versions) == 1, f"the shipped table mixes versions: {versions}"
    (measured_with,) = versions
    backend, missing = TritonBackend(), []
    for model in MODELS.values():
        for case in kernel_cases(model):
            a, b, tensors = random_inputs(case.program, case.m, case.n, case.k, torch.bfloat16, "meta")
            bound = bind(case.program, a, b, tensors)
            launch = backend._prepare(bound, False, TARGETS["sm_90"])
            key = tuning_key("NVIDIA H200", bound, launch.tma_mainloop, launch.tma_epilogue_ok, measured_with)
            if key not in shipped:
                missing.append(f"{model.name} {case.name}: {key.split('|', 2)[2]}")
    assert not missing, "no shipped choice for:\n" + "\n".join(missing)


# --------------------------------------------------------------------------------------------------
# GPU: compiled kernels at realistic sizes (run on the H200: bench/gpu_kernels.sh)
# --------------------------------------------------------------------------------------------------
def _gpu_configs():
    from codagen.backends.triton.configs import _SM90
    return list(_SM90)


def _is_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_gpu_program(check, name, dtype):
    program = PROGRAMS[name]()
    check(program, 1000, 1536, 1024, dtype, device="cuda")       # M past a tile edge
    check(program, 515, 1000, 1000, dtype, device="cuda")        # N, K past tile edges


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _gpu_configs(), ids=lambda c: c.short().replace(" ", "_"))
@pytest.mark.parametrize("name", ["linear", "weight_grad", "residual_rms_stats", "rms_gate_up_swiglu", "rms_qkv_rope",
                                  "rms_lm_head_cross_entropy", "rms_lm_head_cross_entropy_backward",
                                  "rms_norm_backward", "swiglu_backward"])
def test_gpu_every_config(check, name, cfg):
    if not _is_hopper():
        pytest.skip("Hopper configurations")
    program = library.PROGRAMS[name]()
    backend = TritonBackend(config=cfg)
    try:
        check(program, 1000, 2000, 512, torch.bfloat16, device="cuda", backend=backend)
    except Exception as e:  # a config that does not fit is pruned by the tuner, not a wrong answer
        if "OutOfResources" in type(e).__name__ or "out of resource" in str(e):
            pytest.skip(f"{cfg.short()}: {e}")
        raise


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [None] + _gpu_configs(), ids=lambda c: c.short().replace(" ", "_") if c else "tuned")
def test_gpu_rope_long_positions(check, llama3_rope_inputs, cfg):
    """The hardware sin/cos after the 2 pi reduction: LLaMA-3 frequencies, positions up to 16384."""
    if cfg is not None and not _is_hopper():
        pytest.skip("Hopper configurations")
    backend = TritonBackend(config=cfg) if cfg else TritonBackend()
    check(library.rms_qkv_rope(), 16384, 1024, 256, torch.bfloat16, device="cuda", backend=backend,
          inputs=llama3_rope_inputs(1024))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["linear", "rms_norm_backward", "swiglu_backward"])
def test_gpu_pointer_path_for_unaligned_rows(check, name):
    """K = 1001 (bf16 rows of 2002 bytes) cannot use TMA: the pointer mainloop runs instead."""
    check(library.PROGRAMS[name](), 300, 512, 1001, torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["residual_rms_stats", "rms_gate_up_swiglu", "swiglu_backward",
                                  "rms_lm_head_cross_entropy"])
def test_gpu_one_launch_and_bitwise_deterministic(name):
    program = library.PROGRAMS[name]()
    a, b, tensors = random_inputs(program, 2048, 4096, 1024, torch.bfloat16, "cuda")
    backend = TritonBackend(autotune=False)
    # Compile outside the profile; the clones are copy kernels, so they stay outside it too.
    first = backend.run(bind(program, a, b, {k: v.clone() for k, v in tensors.items()}))
    bound = bind(program, a, b, {k: v.clone() for k, v in tensors.items()})
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        second = backend.run(bound)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ours = [k for k in kernels if f"{name}_kernel" in k]
    others = [k for k in kernels if f"{name}_kernel" not in k and "fill" not in k.lower()]
    assert len(ours) == 1, kernels
    assert not others, f"unexpected kernels besides the fused one and output poisoning: {others}"
    for key in first:
        assert torch.equal(first[key].view(torch.uint8), second[key].view(torch.uint8)), key


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("cfg", [None] + _gpu_configs(), ids=lambda c: c.short().replace(" ", "_") if c else "tuned")
def test_gpu_qk_norm_program(check, cfg, head_dim):
    """F4 with QK-norm at a realistic size (16 Q heads, 4 KV heads) on every Hopper config with whole-head sub-tiles."""
    if cfg is not None and not _is_hopper():
        pytest.skip("Hopper configurations")
    if cfg is not None and cfg.sub_n % head_dim:
        pytest.skip("the tuner never offers it: heads would straddle epilogue sub-tiles")
    backend = TritonBackend(config=cfg) if cfg else TritonBackend()
    check(library.rms_qkv_rope(head_dim, 1e-6), 2048, (16 + 2 * 4) * head_dim, 1024, torch.bfloat16, device="cuda",
          backend=backend)


@pytest.mark.gpu
def test_gpu_retune_times_the_candidates_over_a_cached_choice(monkeypatch, tmp_path):
    """A cached choice is reused; CODAGEN_TRITON_RETUNE=1 tunes again anyway."""
    monkeypatch.setenv("CODAGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CODAGEN_TRITON_RETUNE", raising=False)
    program = library.residual_rms_stats()
    a, b, tensors = random_inputs(program, 777, 1536, 320, torch.bfloat16, "cuda")  # a bucket nobody ships
    tuned_keys = []

    def fake_tune(self, bound, launch, pool, key):  # records the call and caches the first candidate
        tuned_keys.append(key)
        self.tuning.put(key, pool[0], {})
        return pool[0]
    monkeypatch.setattr(TritonBackend, "_tune", fake_tune)
    TritonBackend(autotune=True).run(bind(program, a, b, {k: v.clone() for k, v in tensors.items()}))
    # A fresh backend (fresh plans) takes the cached choice instead of tuning again.
    TritonBackend(autotune=True).run(bind(program, a, b, {k: v.clone() for k, v in tensors.items()}))
    assert len(tuned_keys) == 1
    monkeypatch.setenv("CODAGEN_TRITON_RETUNE", "1")
    TritonBackend(autotune=True).run(bind(program, a, b, {k: v.clone() for k, v in tensors.items()}))
    assert len(tuned_keys) == 2 and tuned_keys[0] == tuned_keys[1]


@pytest.mark.gpu
def test_gpu_float64_refused():
    a = torch.randn(16, 16, dtype=torch.float64, device="cuda")
    with pytest.raises(ProgramError, match="float16, bfloat16 or float32"):
        TritonBackend().run(bind(library.linear(), a, a, {}))


def test_reserved_names_cover_the_generated_kernels():
    """Every identifier of the generated sources (both schedules) in a scope where the program's own
    names become variables (module level, and every function but the fixed helpers) is reserved in the
    by the generators (``names.RESERVED_NAMES``, ``names.TEMPORARY``) or derived from those names, so
    mangling exactly the names that collide with them keeps every input and output off a kernel variable."""
    import ast

    from codagen.backends.triton import persistent, pingpong
    from codagen.backends.triton.names import RESERVED_NAMES, TEMPORARY
    fixed_helpers = {"tile_coords", "column_halves", "cast_for_store", "merge_logsumexp", "stamp"}  # own scopes
    programs = [f() for f in PROGRAMS.values()] + [
        library.rms_norm_backward("accumulate"), library.rms_norm_backward("none"),
        library.rms_qkv_rope(qk_norm_head_dim=64), library.weight_grad(True, "float32"),
        library.rms_gate_up_swiglu().with_low_rank(), library.weight_grad().with_low_rank()]
    operands = {"a", "b", "a2", "b2"}
    for program in programs:
        own = set(program.inputs) | {o.name for o in program.outputs} | {program.name} | operands
        sources = [persistent.generate(program)]
        if pingpong.refusal(program) is None:
            sources += [pingpong.generate(program), pingpong.generate(program, timeline=True)]
        for source in sources:
            tree = ast.parse(source)
            ids = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}
            ids |= {(a.asname or a.name).split(".")[0] for n in tree.body
                    if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
            for f in tree.body:
                if isinstance(f, ast.FunctionDef) and f.name not in fixed_helpers:
                    ids |= {n.id for n in ast.walk(f) if isinstance(n, ast.Name)}
                    ids |= {a.arg for a in ast.walk(f) if isinstance(a, ast.arg)}
            stray = sorted(i for i in ids if i not in RESERVED_NAMES and not TEMPORARY.fullmatch(i)
                           and not any(i == u or i.startswith(u + "_") for u in own))
            assert not stray, f"{program.name}: add to names.RESERVED_NAMES: {stray}"


@pytest.mark.parametrize("name", ["rows", "acc", "v_3", "N", "tl", "_rows"])
def test_names_of_the_generated_kernels_are_mangled(name):
    """An input or output named like a generated kernel's own variable is mangled (``_rows``) in the
    kernel and keeps its name everywhere else; the kernel computes the program."""
    from codagen.backends.triton.names import kernel_names
    partner = "_rows" if name == "rows" else "rows"  # a user name that is also a mangled name
    program = Program("p", Gemm.linear(), (Store(name, Accumulator() * RowVector(partner) + TileInput("x")),))
    ids = kernel_names(program)
    assert len(set(ids.values())) == 3 and ids["x"] == "x"
    assert ids[name] != name or name == "_rows"
    a, b = torch.randn(20, 16), torch.randn(24, 16)
    tensors = {partner: torch.randn(20), "x": torch.randn(20, 24)}
    out = TritonBackend().run(bind(program, a, b, tensors))
    assert set(out) == {name}
    torch.testing.assert_close(out[name], (a @ b.T) * tensors[partner][:, None] + tensors["x"])
    assert f"{ids[name]}_ptr" in program_source(program)


@pytest.mark.parametrize("name", ["residual_rms_stats", "rms_qkv_rope"])
def test_split_k_kernel_compiles_for_sm90(name):
    """The one-launch split-K kernel compiles for Hopper without a GPU (TMA mainloop, PDL, bf16); its PTX
    arrives with one acquire-release atomic at GPU scope and reads the partials past L1."""
    from tests.sm90 import sm90_ptx
    constexprs = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, EPILOGUE_SPLIT=1, SUB_N=64,
                      TMA_MAINLOOP=True, TMA_EPILOGUE=False, UPCAST_OPERANDS=False, DOT_PRECISION="tf32",
                      FLATTEN=True, PORTABLE=False, PDL=True, PREFETCH_K=512)
    leading = {"a_ptr": "*bf16", "b_ptr": "*bf16", "partial_ptr": "*fp32", "arrivals_ptr": "*i32"}
    ptx = sm90_ptx(library.PROGRAMS[name](), "split_k_kernel", leading, ("M", "N", "K"), constexprs, 4, 4)
    assert ptx.count("atom.global.gpu.acq_rel.add") == 1, \
        [line for line in ptx.splitlines() if "atom" in line]
    assert "ld.global.cg" in ptx
    assert "griddepcontrol.wait" in ptx


@pytest.mark.parametrize("value, on_by_default, off_by_default", [
    (None, True, False), ("", True, False), ("0", False, False), (" False ", False, False), ("no", False, False),
    ("1", True, True), ("YES", True, True), ("true", True, True), ("2", True, False), ("off", True, False)])
def test_env_flag(monkeypatch, value, on_by_default, off_by_default):
    """A switch on by default turns off only for 0/false/no; one off by default turns on only for 1/true/yes."""
    from codagen.backends.triton.switches import env_flag
    if value is None:
        monkeypatch.delenv("CODAGEN_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("CODAGEN_TEST_SWITCH", value)
    assert env_flag("CODAGEN_TEST_SWITCH", default=True) is on_by_default
    assert env_flag("CODAGEN_TEST_SWITCH", default=False) is off_by_default
