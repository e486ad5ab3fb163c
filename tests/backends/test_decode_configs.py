"""The decode (small-M) kernel configurations: chosen for M <= 64 on sm_90, ordered by the column-tile
heuristic, and correct (Triton interpreter on CPU; every decode program on the GPU)."""
from __future__ import annotations

import pytest
import torch

from codagen.backends.triton import TritonBackend
from codagen.backends.triton.configs import SMALL_M, SMALL_M_ROWS, candidates, small_m_order
from codagen.epilogue import library

DECODE_PROGRAMS = ["rms_qkv_rope", "residual_rms_stats", "rms_gate_up_swiglu", "rms_linear"]
H200 = dict(major=9, operand_bytes=2, smem_limit=232448, tma=True, tma_epilogue=True, num_sms=132)


def test_small_m_order():
    # 2048 columns (o-proj, down-proj of LLaMA-3 1B): no tile width gives 132 tiles: the narrowest first
    assert small_m_order(SMALL_M, 2048, 132)[0].block_n == 16
    # 16384 columns (gate/up): the widest with >= 132 tiles (64 columns: 256 tiles)
    assert small_m_order(SMALL_M, 16384, 132)[0].block_n == 64
    # 128256 columns (LM head): 128-column tiles
    assert small_m_order(SMALL_M, 128256, 132)[0].block_n == 128


@pytest.mark.parametrize("name", DECODE_PROGRAMS)
def test_decode_configs_come_first_only_for_small_m(name):
    program = library.PROGRAMS[name]()
    pool = candidates(program, m=8, n=2048, **H200)
    assert pool[0] in SMALL_M and pool[0].block_n == 16
    assert all(cfg.schedule == "persistent" for cfg in pool)  # no ping-pong pair of 128-row tiles for 8 rows
    assert all(cfg in SMALL_M for cfg in pool)  # tuning times only the decode tiles
    large = candidates(program, m=SMALL_M_ROWS + 1, n=2048, **H200)
    assert not any(cfg in SMALL_M for cfg in large)
    assert candidates(program, **H200) == [c for c in large]  # no M given: the training pool


def test_qk_norm_keeps_only_head_wide_decode_tiles():
    pool = candidates(library.rms_qkv_rope(128, 1e-6), m=1, n=6144, **H200)
    assert pool == [next(cfg for cfg in SMALL_M if cfg.block_n == 128)]


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
