"""The warp-specialized SwiGLU-backward kernel (``codagen.backends.triton.pingpong``).

CPU: it compiles for sm_90 (shared memory as pruned, wgmma present), it is offered to the tuner exactly
where it can run, and forcing it where it cannot gives a clear error. GPU (Hopper): the numerics rule of
``test_triton_backend`` on ragged and realistic shapes in bf16 and fp16, one launch, bitwise-identical
repeats.
"""
from __future__ import annotations

import math

import pytest
import torch

from codagen.backends.triton import TritonBackend, pingpong
from codagen.backends.triton.configs import PINGPONG, KernelConfig, TuningCache, candidates, smem_estimate
from codagen.bench.kernels import random_inputs
from codagen.epilogue import library
from codagen.epilogue.bind import bind
from codagen.epilogue.ir import ProgramError

from .test_triton_backend import _clone, _is_hopper, check, kernel_cache_dir  # noqa: F401 - fixture


def _pool(program, **overrides):
    args = dict(major=9, operand_bytes=2, smem_limit=232448, tma=True, tma_epilogue=True)
    return candidates(program, **{**args, **overrides})


# --------------------------------------------------------------------------------------------------
# CPU
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_compiles_for_sm90(dtype):
    kernel = pingpong.compile_sm90(dtype)
    assert kernel.metadata.shared == pingpong.SHARED_MEMORY == smem_estimate(library.swiglu_backward(), PINGPONG, 2)
    assert "wgmma.mma_async" in kernel.asm["ptx"]
    # two consumer warpgroups and the producer's warp, which Triton pads to a warpgroup of its own
    assert kernel.metadata.num_warps == 3 * pingpong.CONSUMER_WARPS


def test_offered_only_where_it_runs():
    program = library.swiglu_backward()
    assert PINGPONG in _pool(program)
    for where in (dict(tma_epilogue=False), dict(tma=False), dict(major=8), dict(major=10), dict(operand_bytes=4),
                  dict(smem_limit=pingpong.SHARED_MEMORY - 1)):
        assert PINGPONG not in _pool(program, **where), where
    for name in sorted(set(library.PROGRAMS) - {"swiglu_backward"}):
        assert all(cfg.schedule == "persistent" for cfg in _pool(library.PROGRAMS[name]())), name
    assert pingpong.implements(library.swiglu_backward())
    assert not pingpong.implements(library.rms_gate_up_swiglu())


def test_config_schedule():
    assert PINGPONG.short() == "128x128x64 s4 w4 pingpong"
    assert KernelConfig.from_json(PINGPONG.to_json()) == PINGPONG
    assert KernelConfig.from_json({k: v for k, v in PINGPONG.to_json().items() if k != "schedule"}).schedule == "persistent"
    with pytest.raises(ValueError, match="schedule must be 'persistent' or 'pingpong'"):
        KernelConfig(128, 128, 64, 4, 4, schedule="cooperative")


def test_fastest_of_a_pool_from_recorded_timings(tmp_path, monkeypatch):
    """A call that cannot run its bucket's choice takes the fastest it can, by the recorded times."""
    monkeypatch.setenv("CODAGEN_CACHE_DIR", str(tmp_path))
    cache = TuningCache()
    pool = _pool(library.swiglu_backward(), tma_epilogue=False)
    timings = {cfg.short(): 1.0 + i for i, cfg in enumerate(reversed(pool))}
    timings[PINGPONG.short()] = 0.5
    timings[pool[0].short()] = math.nan  # out of resources when tuned
    cache.put("key", PINGPONG, timings)
    assert cache.fastest("key", pool) == pool[-1]
    assert cache.fastest("missing", pool) is None


def test_refuses_a_preact_of_another_dtype():
    program = library.swiglu_backward()
    a, b, tensors = random_inputs(program, 8, 16, 16, torch.float16, "cpu")
    assert pingpong.refuses(bind(program, a, b, tensors)) is None
    tensors["preact"] = tensors["preact"].float()
    assert "preact must have the operands' dtype" in pingpong.refuses(bind(program, a, b, tensors))
    a, b, tensors = random_inputs(program, 8, 16, 16, torch.float32, "cpu")
    assert "bfloat16 or float16" in pingpong.refuses(bind(program, a, b, tensors))


def test_forcing_it_where_it_cannot_run_is_refused():
    program = library.swiglu_backward()
    a, b, tensors = random_inputs(program, 8, 16, 16, torch.float16, "cpu")
    with pytest.raises(ProgramError, match="ping-pong kernel runs on sm_90"):
        TritonBackend(config=PINGPONG).run(bind(program, a, b, tensors))
    a, b, tensors = random_inputs(library.linear(), 8, 16, 16, torch.float16, "cpu")
    with pytest.raises(ProgramError, match="computes only the library's swiglu_backward"):
        TritonBackend(config=PINGPONG).run(bind(library.linear(), a, b, tensors))


# --------------------------------------------------------------------------------------------------
# GPU (Hopper)
# --------------------------------------------------------------------------------------------------
def _need_hopper():
    if not _is_hopper():
        pytest.skip("the ping-pong kernel is for sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (1000, 2000, 512), (515, 1000, 1000), (128, 128, 64), (4096, 8192, 2048)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_numerics(shape, dtype):
    _need_hopper()
    check(library.swiglu_backward(), *shape, dtype, device="cuda", backend=TritonBackend(config=PINGPONG))


@pytest.mark.gpu
def test_gpu_one_launch_and_bitwise_deterministic():
    _need_hopper()
    program = library.swiglu_backward()
    a, b, tensors = random_inputs(program, 2048, 4096, 1024, torch.bfloat16, "cuda")
    backend = TritonBackend(config=PINGPONG)
    first = backend.run(bind(program, a, b, _clone(tensors)))
    bound = bind(program, a, b, _clone(tensors))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        second = backend.run(bound)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert [k for k in kernels if "fill" not in k.lower()] == ["swiglu_backward_pingpong_kernel"], kernels
    for key in first:
        assert torch.equal(first[key].view(torch.uint8), second[key].view(torch.uint8)), key


@pytest.mark.gpu
def test_gpu_preact_of_another_dtype_takes_a_generated_kernel():
    """fp32 preact with bf16 operands: the tuner leaves the ping-pong kernel out; forcing it is refused."""
    _need_hopper()
    program = library.swiglu_backward()
    a, b, tensors = random_inputs(program, 256, 512, 256, torch.bfloat16, "cuda")
    tensors["preact"] = tensors["preact"].float()
    backend = TritonBackend(autotune=False)
    backend.run(bind(program, a, b, _clone(tensors)))
    assert backend.last_config.schedule == "persistent"
    with pytest.raises(ProgramError, match="preact must have the operands' dtype"):
        TritonBackend(config=PINGPONG).run(bind(program, a, b, tensors))


@pytest.mark.gpu
def test_gpu_unaligned_rows_are_refused_when_forced():
    """K = 1001 (rows of 2002 bytes): no TMA, so no ping-pong; the tuner never offers it there."""
    _need_hopper()
    program = library.swiglu_backward()
    a, b, tensors = random_inputs(program, 300, 512, 1001, torch.bfloat16, "cuda")
    with pytest.raises(ProgramError, match="TMA-aligned"):
        TritonBackend(config=PINGPONG).run(bind(program, a, b, tensors))
