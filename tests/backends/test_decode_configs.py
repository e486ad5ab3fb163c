"""The decode (small-M) kernel configurations: chosen for M <= 64 on sm_90, ordered by
:func:`small_m_order`, and correct (Triton interpreter on CPU; every decode program on the GPU)."""
from __future__ import annotations

import pytest
import torch

from codagen.backends.triton import TritonBackend
from codagen.backends.triton.configs import SMALL_M, SMALL_M_ROWS, candidates, small_m_order
from codagen.epilogue import library

DECODE_PROGRAMS = ["rms_qkv_rope", "residual_rms_stats", "rms_gate_up_swiglu", "rms_linear"]
H200 = dict(target="sm_90", operand_bytes=2, smem_limit=232448, tma=True, tma_epilogue=True, num_sms=132)


@pytest.mark.parametrize("m, n, first", [
    (1, 4096, "16x64x256 s4 w4 split1 ptr k2"),    # o-proj, down-proj at 4096: 64 tiles, two K ranges each
    (8, 2048, "16x64x256 s4 w4 split1 ptr k4"),    # at 2048: 32 tiles, four ranges
    (1, 6144, "16x64x256 s4 w4 split1 ptr"),       # QKV at 4096: 96 tiles, unsplit
    (16, 128256, "16x64x256 s4 w4 split1 ptr"),    # LM head
    (17, 4096, "64x128x128 s4 w4 split1 ptr"),     # more than 16 rows: one 64-row tile
])
def test_small_m_order(m, n, first):
    order = small_m_order(m, n, 132)
    assert order[0].short() == first
    assert len(set(order)) == len(order) and set(order) <= set(SMALL_M)


@pytest.mark.parametrize("name", DECODE_PROGRAMS)
def test_decode_configs_come_first_only_for_small_m(name):
    program = library.PROGRAMS[name]()
    pool = candidates(program, m=8, n=2048, **H200)
    assert pool[0] == small_m_order(8, 2048, 132)[0]
    assert all(cfg.schedule == "persistent" for cfg in pool)  # no ping-pong pair of 128-row tiles for 8 rows
    assert all(cfg in SMALL_M for cfg in pool)  # tuning times only the decode tiles
    large = candidates(program, m=SMALL_M_ROWS + 1, n=2048, **H200)
    assert not any(cfg in SMALL_M for cfg in large)
    assert candidates(program, **H200) == [c for c in large]  # no M given: the training pool


def test_qk_norm_keeps_only_head_wide_decode_tiles():
    pool = candidates(library.rms_qkv_rope(128, 1e-6), m=1, n=6144, **H200)
    assert pool and all(cfg.block_n % 128 == 0 and cfg in SMALL_M for cfg in pool)


def test_low_rank_decode_tiles_are_unsplit():
    program = library.rms_qkv_rope().with_low_rank()
    pool = candidates(program, m=1, n=4096, **H200)
    assert pool and all(cfg.split_k == 1 for cfg in pool)


@pytest.mark.parametrize("cfg", SMALL_M, ids=lambda c: c.short())
@pytest.mark.parametrize("name", DECODE_PROGRAMS)
def test_decode_config_interpreter(check, name, cfg):
    """Each decode tile on 1 and 5 rows, fp32 in the interpreter (test_triton checks that loading an fp16
    kernel writes its source file, which a kernel loaded here first would not)."""
    for m in (1, 5):
        check(library.PROGRAMS[name](), m, 2 * cfg.block_n + 6, 136, torch.float32, backend=TritonBackend(config=cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", SMALL_M, ids=lambda c: c.short())
@pytest.mark.parametrize("name", DECODE_PROGRAMS)
def test_gpu_decode_config(check, name, cfg):
    for m in (1, 8, 64):
        check(library.PROGRAMS[name](), m, 3072, 2048, torch.bfloat16, device="cuda", backend=TritonBackend(config=cfg))


@pytest.mark.parametrize("cfg", [c for c in SMALL_M if c.block_m == 16 and c.split_k == 1], ids=lambda c: c.short())
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_low_rank_decode_tiles(cfg, device):
    """A LoRA projection at decode (``rms_linear`` with its low-rank pair, 1 and 5 rows, R = 8) on each 16-row
    tile: fp32 in the interpreter against float64 (1e-5 relative); bf16 on the GPU within the 2x rule of the
    same sum in bf16 by PyTorch."""
    from codagen.backends import execute
    from codagen.epilogue.bind import bind
    program = library.rms_linear().with_low_rank()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    n, k, r = 2 * cfg.block_n + 6, 2 * cfg.block_k + 8, 8
    for m in (1, 5):
        a, b = torch.randn(m, k, device=device), torch.randn(n, k, device=device) / k ** 0.5
        a2, b2 = torch.randn(m, r, device=device), torch.randn(n, r, device=device) / r ** 0.5
        rstd = torch.rand(m, device=device) + 0.5
        a, b, a2, b2 = (t.to(dtype) for t in (a, b, a2, b2))
        got = TritonBackend(config=cfg).run(bind(program, a, b, dict(a2=a2, b2=b2, rstd=rstd)))["out"].double()
        exact = execute(program, a.double(), b.double(), a2=a2.double(), b2=b2.double(), rstd=rstd.double(),
                        backend="reference")["out"]
        error = (got - exact).abs().max().item()
        if dtype == torch.float32:
            assert error <= 1e-5 * max(1.0, exact.abs().max().item())
        else:
            lowp = ((a @ b.T + a2 @ b2.T).float() * rstd[:, None]).to(dtype).double()
            assert error <= 2 * (lowp - exact).abs().max().item() + 1e-6


@pytest.mark.gpu
def test_gpu_split_k_one_launch_is_deterministic_in_a_cuda_graph():
    """Split K in one launch (the last range of each tile sums the partials): the same inputs give bitwise the
    same outputs, eagerly and replayed from a CUDA graph, for two shapes in turn sharing the arrival counters
    (the O-proj and down-proj of an 8B decode step, as programmatic dependents)."""
    from codagen.bench.kernels import random_inputs
    from codagen.epilogue.bind import bind
    program = library.residual_rms_stats()
    backend = TritonBackend(config=next(c for c in SMALL_M if c.block_m == 16 and c.split_k == 2))
    calls = [random_inputs(program, 1, 4096, k, torch.bfloat16, "cuda") for k in (4096, 14336)]

    def step():
        return [backend.run(bind(program, a, b, dict(tensors))) for a, b, tensors in calls]
    first = step()
    assert backend.launches == 2
    for _ in range(3):
        for want, got in zip(first, step()):
            assert all(torch.equal(want[name], got[name]) for name in want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        for out in captured:
            for t in out.values():
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for want, got in zip(first, captured):
            assert all(torch.equal(want[name], got[name]) for name in want)
