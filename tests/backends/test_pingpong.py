"""The warp-specialized ping-pong kernels (``codagen.backends.triton.pingpong``).

CPU: every program the schedule takes compiles for sm_90 (shared memory as estimated, wgmma present),
the generator refuses what it cannot take, the tuner is offered the kernels exactly where they can run,
and forcing one where it cannot run gives a clear error. GPU (Hopper): the numerics rule of
``test_triton`` for every program on ragged and realistic shapes in bf16 and fp16 with both
piece widths, one launch, bitwise-identical repeats.
"""
from __future__ import annotations

import math

import pytest
import torch

from codagen.backends.triton import TritonBackend, load_kernel, pingpong, program_source, sass
from codagen.backends.triton.configs import PINGPONG, KernelConfig, TuningCache, candidates, smem_estimate
from codagen.bench.kernels import random_inputs
from codagen.epilogue import library
from codagen.epilogue.bind import bind
from codagen.epilogue.ir import ProgramError

SPLIT4, SPLIT8 = PINGPONG
H200_SMEM = 232448

#: every program variant the schedule takes (the library's defaults, the other residual-gradient modes and the
#: QKV program with a bias, the GeGLU MLP's and the LM-head programs with Gemma 2's final logit soft-cap)
PROGRAMS = {name: factory() for name, factory in library.PROGRAMS.items() if pingpong.supports(factory()) is None}
PROGRAMS.update({"rms_norm_backward_accumulate": library.rms_norm_backward("accumulate"),
                 "rms_norm_backward_none": library.rms_norm_backward("none"),
                 "rms_qkv_rope_bias": library.rms_qkv_rope(bias=True),
                 "rms_gate_up_geglu": library.rms_gate_up_swiglu(activation="gelu_tanh"),
                 "geglu_backward": library.swiglu_backward("gelu_tanh")})
PROGRAMS.update({p.name: p for p in (library.rms_linear(30.0), library.rms_linear(30.0, save_preact=False),
                                     library.rms_lm_head_cross_entropy(30.0),
                                     library.rms_lm_head_cross_entropy_backward(30.0))})


def _pool(program, **overrides):
    args = dict(target="sm_90", operand_bytes=2, smem_limit=H200_SMEM, tma=True, tma_epilogue=True)
    return candidates(program, **{**args, **overrides})


def _largest_piece(program) -> KernelConfig:
    return next(cfg for cfg in PINGPONG if smem_estimate(program, cfg, 2) <= H200_SMEM)


# --------------------------------------------------------------------------------------------------
# CPU
# --------------------------------------------------------------------------------------------------
def test_supported_programs():
    assert set(PROGRAMS) == {"linear", "input_grad", "rms_linear", "residual_rms_stats", "rms_gate_up_swiglu",
                             "rms_qkv_rope", "rms_lm_head_cross_entropy", "rms_lm_head_cross_entropy_backward",
                             "rms_norm_backward", "swiglu_backward", "rms_norm_backward_accumulate",
                             "rms_norm_backward_none", "rms_qkv_rope_bias", "rms_gate_up_geglu", "geglu_backward",
                             "rms_linear_softcap", "rms_linear_softcap_inference",
                             "rms_lm_head_cross_entropy_softcap", "rms_lm_head_cross_entropy_backward_softcap"}
    assert "A must be [M, K]" in pingpong.supports(library.weight_grad())
    assert "segment sums" in pingpong.supports(library.rms_qkv_rope(qk_norm_head_dim=64))
    with pytest.raises(ValueError, match="cannot take this program: A must be"):
        pingpong.generate(library.weight_grad())


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_compiles_for_sm90(name):
    program = PROGRAMS[name]
    cfg = _largest_piece(program)
    kernel = load_kernel(program, dtypes="test", arch="sm_90", interpret=False, schedule="pingpong")
    compiled = pingpong.compile_sm90(kernel, program, cfg.sub_n, torch.bfloat16)
    estimate = smem_estimate(program, cfg, 2)
    assert estimate - 4096 < compiled.metadata.shared <= estimate   # a tight upper bound
    assert "wgmma.mma_async" in compiled.asm["ptx"]
    # two consumer warpgroups and the producer's warp, which Triton pads to a warpgroup of its own
    assert compiled.metadata.num_warps == 3 * pingpong.CONSUMER_WARPS


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_turn_passes_before_the_epilogue(name):
    """Each consumer frees its last ring slot and passes the tensor cores on before its epilogue runs:
    at most a few hundred cycles of epilogue arithmetic scheduled ahead of the hand-off (else the other
    consumer's mainloop waits for this epilogue)."""
    program = PROGRAMS[name]
    kernel = load_kernel(program, dtypes="test", arch="sm_90", interpret=False, schedule="pingpong")
    compiled = pingpong.compile_sm90(kernel, program, _largest_piece(program).sub_n, torch.bfloat16)
    counts = sass.arithmetic_before_handoff(sass.instructions(compiled.asm["cubin"]))
    assert len(counts) == 2 and max(counts) <= sass.HANDOFF_LIMIT, f"arithmetic ahead of the hand-off: {counts}"


def test_timeline_variant():
    """``generate(timeline=True)`` (bench/pingpong_timeline.py): the production source has no stamps; the
    timeline kernel takes ``timeline_ptr`` right after ``K`` (where the script inserts it) and each
    consumer stamps four times per tile, the turn being waited for just before its stamp."""
    program = library.rms_lm_head_cross_entropy()
    assert "stamp" not in pingpong.generate(program)
    source = pingpong.generate(program, timeline=True)
    assert ("_kernel(a_desc, b_desc, rstd_ptr, target_ptr, partial_lse_ptr, partial_target_ptr, M, N, K, "
            "timeline_ptr, B_NK") in source
    assert [f"stamp(timeline_ptr + stamp_slot{k}, local)" in source for k in ("", " + 1", " + 2", " + 3")] == [True] * 4
    waited = source.index("mbarrier.wait(turn.index(WHICH), (local // 2) & 1)")
    assert waited < source.index("stamp_slot + 1,") < source.index("acc = mainloop(") < source.index("stamp_slot + 2,")


def test_ab_builds_kernels_on_a_saved_copy(tmp_path):
    """``bench/pingpong_ab.py`` (GPU A/B of a ``pingpong.py`` change): a saved copy loads as a sibling
    module and the generated kernel built on it takes its fixed parts from the copy, and compiles."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "pingpong_ab", Path(__file__).resolve().parents[2] / "bench" / "pingpong_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    saved_path = tmp_path / "pingpong_saved_for_test.py"
    saved_path.write_text(Path(pingpong.runtime.__file__).read_text())
    saved = ab.baseline_module(str(saved_path))
    program = library.residual_rms_stats()
    kernel = ab.kernel_on(saved, program)
    assert kernel.fn.__globals__["mainloop"] is saved.mainloop is not pingpong.mainloop
    assert "wgmma.mma_async" in saved.compile_sm90(kernel, program, SPLIT4.sub_n).asm["ptx"]


def test_every_piece_prefetched_where_it_fits():
    """The o-projection's residual: one slot per piece (all its loads requested when a tile starts)."""
    program = library.residual_rms_stats()
    a, b, tensors = random_inputs(program, 256, 512, 256, torch.bfloat16, "cpu")
    bound = bind(program, a, b, tensors)
    assert pingpong.input_slots(bound, SPLIT8.sub_n, H200_SMEM) == 8
    assert pingpong.input_slots(bound, SPLIT4.sub_n, H200_SMEM) == 2  # four slots of 32 columns do not fit
    kernel = load_kernel(program, dtypes="test", arch="sm_90", interpret=False, schedule="pingpong")
    compiled = pingpong.compile_sm90(kernel, program, SPLIT8.sub_n, torch.bfloat16, in_slots=8)
    assert compiled.metadata.shared <= pingpong.shared_memory(program, SPLIT8.sub_n, 2, None, 8) <= H200_SMEM


def test_compiles_in_fp16_with_eight_pieces():
    program = library.swiglu_backward()
    kernel = load_kernel(program, dtypes="test", arch="sm_90", interpret=False, schedule="pingpong")
    compiled = pingpong.compile_sm90(kernel, program, SPLIT8.sub_n, torch.float16)
    assert compiled.metadata.shared <= smem_estimate(program, SPLIT8, 2) <= H200_SMEM


def test_generated_source_is_readable():
    source = program_source(library.rms_norm_backward(), schedule="pingpong")
    for text in ("def rms_norm_backward_piece(", "def rms_norm_backward_consumer(", "def rms_norm_backward_kernel(",
                 "def rms_norm_backward_load_inputs(", "gl.warp_specialize(", "partial_grad_norm_weight"):
        assert text in source, text
    compile(source, "<pingpong>", "exec")


def test_offered_only_where_it_runs():
    swiglu_backward = library.swiglu_backward()
    assert SPLIT4 not in _pool(swiglu_backward)      # its buffers need 8 pieces to fit 227 KiB
    assert SPLIT8 in _pool(swiglu_backward)
    residual = library.residual_rms_stats()
    assert SPLIT4 in _pool(residual) and SPLIT8 in _pool(residual)
    for where in (dict(tma_epilogue=False), dict(tma=False), dict(target="sm_80"), dict(target="sm_100"),
                  dict(operand_bytes=4),
                  dict(smem_limit=smem_estimate(residual, SPLIT8, 2) - 1)):
        assert not any(cfg.schedule == "pingpong" for cfg in _pool(residual, **where)), where
    for program in (library.weight_grad(), library.rms_qkv_rope(qk_norm_head_dim=64)):
        assert all(cfg.schedule == "persistent" for cfg in _pool(program)), program.name
    # the untuned default (the first viable candidate) stays a persistent kernel
    assert all(_pool(p)[0].schedule == "persistent" for p in PROGRAMS.values())


def test_config_schedule():
    assert SPLIT8.short() == "128x128x64 s4 w4 pingpong split8"
    assert KernelConfig.from_json(SPLIT4.to_json()) == SPLIT4
    without_schedule = {k: v for k, v in SPLIT4.to_json().items() if k != "schedule"}
    assert KernelConfig.from_json(without_schedule).schedule == "persistent"
    with pytest.raises(ValueError, match="schedule must be 'persistent' or 'pingpong'"):
        KernelConfig(128, 128, 64, 4, 4, schedule="cooperative")
    with pytest.raises(ValueError, match="epilogue_split of a persistent configuration must be one of"):
        KernelConfig(128, 256, 64, 3, 8, epilogue_split=8)


def test_fastest_of_a_pool_from_recorded_timings(tmp_path, monkeypatch):
    """A call that cannot run its bucket's choice takes the fastest it can, by the recorded times."""
    monkeypatch.setenv("CODAGEN_CACHE_DIR", str(tmp_path))
    cache = TuningCache()
    pool = _pool(library.swiglu_backward(), tma_epilogue=False)
    timings = {cfg.short(): 1.0 + i for i, cfg in enumerate(reversed(pool))}
    timings[SPLIT8.short()] = 0.5
    timings[pool[0].short()] = math.nan  # out of resources when tuned
    cache.put("key", SPLIT8, timings)
    assert cache.fastest("key", pool) == pool[-1]
    assert cache.fastest("missing", pool) is None


def test_refusals_by_tensors():
    program = library.residual_rms_stats()
    a, b, tensors = random_inputs(program, 8, 16, 16, torch.float16, "cpu")
    assert pingpong.refuses(bind(program, a, b, tensors), 32, H200_SMEM) is None
    tensors["residual"] = tensors["residual"].float()  # fp32 tile buffers: twice the shared memory
    assert "bytes of shared memory" in pingpong.refuses(bind(program, a, b, tensors), 32, H200_SMEM)
    assert pingpong.refuses(bind(program, a, b, tensors), 16, H200_SMEM) is None
    a, b, tensors = random_inputs(program, 8, 16, 16, torch.float32, "cpu")
    assert "bfloat16 or float16" in pingpong.refuses(bind(program, a, b, tensors), 16, H200_SMEM)


def test_forcing_it_where_it_cannot_run_is_refused():
    program = library.swiglu_backward()
    a, b, tensors = random_inputs(program, 8, 16, 16, torch.float16, "cpu")
    with pytest.raises(ProgramError, match="ping-pong kernel runs on sm_90"):
        TritonBackend(config=SPLIT8).run(bind(program, a, b, tensors))
    program = library.weight_grad()
    a, b, tensors = random_inputs(program, 8, 16, 16, torch.float16, "cpu")
    with pytest.raises(ProgramError, match="ping-pong kernel cannot compute this program: A must be"):
        TritonBackend(config=SPLIT8).run(bind(program, a, b, tensors))


# --------------------------------------------------------------------------------------------------
# GPU (Hopper)
# --------------------------------------------------------------------------------------------------
def _is_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _need_hopper():
    if not _is_hopper():
        pytest.skip("the ping-pong kernels are for sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("split", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_gpu_program(check, name, dtype, split):
    _need_hopper()
    program = PROGRAMS[name]
    cfg = SPLIT4 if split == 4 else SPLIT8
    if smem_estimate(program, cfg, 2) > H200_SMEM:
        pytest.skip(f"{name}: {split} pieces do not fit shared memory")
    backend = TritonBackend(config=cfg)
    # TMA-aligned (the tuner offers the kernel nowhere else): bf16 rows of N / 2, N, 2N and K multiples of 16 bytes
    for shape in ((1, 16, 16), (1000, 2000, 512), (515, 1008, 1000), (128, 128, 64)):
        check(program, *shape, dtype, device="cuda", backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["residual_rms_stats", "rms_norm_backward", "swiglu_backward",
                                  "rms_lm_head_cross_entropy"])
def test_gpu_realistic_shape(check, name):
    """Many tiles per consumer: every buffer slot and barrier phase turns over many times."""
    _need_hopper()
    program = PROGRAMS[name]
    check(program, 4096, 8192, 2048, torch.bfloat16, device="cuda",
          backend=TritonBackend(config=_largest_piece(program)))


@pytest.mark.gpu
def test_gpu_rope_long_positions(check, llama3_rope_inputs):
    """The hardware sin/cos after the 2 pi reduction: LLaMA-3 frequencies, positions up to 16384."""
    _need_hopper()
    check(library.rms_qkv_rope(), 16384, 1024, 256, torch.bfloat16, device="cuda", backend=TritonBackend(config=SPLIT4),
          inputs=llama3_rope_inputs(1024))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["swiglu_backward", "rms_norm_backward", "rms_lm_head_cross_entropy_backward"])
def test_gpu_one_launch_and_bitwise_deterministic(name):
    _need_hopper()
    program = PROGRAMS[name]
    a, b, tensors = random_inputs(program, 2048, 4096, 1024, torch.bfloat16, "cuda")
    backend = TritonBackend(config=_largest_piece(program))
    first = backend.run(bind(program, a, b, {k: v.clone() for k, v in tensors.items()}))
    bound = bind(program, a, b, {k: v.clone() for k, v in tensors.items()})
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        second = backend.run(bound)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert [k for k in kernels if "fill" not in k.lower()] == [f"{program.name}_kernel"], kernels
    for key in first:
        assert torch.equal(first[key].view(torch.uint8), second[key].view(torch.uint8)), key


@pytest.mark.gpu
def test_gpu_fp32_tile_operand_takes_eight_pieces(check):
    """An fp32 residual doubles its buffers: four pieces no longer fit, eight do."""
    _need_hopper()
    program = library.residual_rms_stats()
    a, b, tensors = random_inputs(program, 256, 512, 256, torch.bfloat16, "cuda")
    tensors["residual"] = tensors["residual"].float()
    with pytest.raises(ProgramError, match="bytes of shared memory"):
        TritonBackend(config=SPLIT4).run(bind(program, a, b, tensors))
    check(program, 256, 512, 256, torch.bfloat16, device="cuda", backend=TritonBackend(config=SPLIT8),
          inputs={"residual": lambda m, device: torch.randn(m, 512, device=device)})


@pytest.mark.gpu
def test_gpu_unaligned_rows_are_refused_when_forced():
    """K = 1001 (rows of 2002 bytes): no TMA, so no ping-pong; the tuner never offers it there."""
    _need_hopper()
    program = library.swiglu_backward()
    a, b, tensors = random_inputs(program, 300, 512, 1001, torch.bfloat16, "cuda")
    with pytest.raises(ProgramError, match="TMA-aligned"):
        TritonBackend(config=SPLIT8).run(bind(program, a, b, tensors))
