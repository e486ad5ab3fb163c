"""Kernel configurations, their pruning by resources, and the on-disk cache of tuned choices.

A :class:`KernelConfig` fixes everything the launch chooses: tile sizes, pipeline depth, warps, how the
epilogue is cut (``epilogue_split``: the accumulator's column halves are processed one after the other,
halving the epilogue's live registers) and whether epilogue tiles move through TMA descriptors
(``tma_epilogue``: the copy engine stages them in shared memory) or plain pointer loads/stores, and
``split_k``: K cut in that many ranges, the epilogue run on their sum by each tile's last range (decode shapes).

Candidates are pruned *before* compiling by two estimates:

* shared memory: ``stages * (BM + BN) * BK * bytes(operand)`` for the mainloop ring, plus the
  epilogue's: layout-conversion scratch of one sub-tile, or with ``tma_epilogue`` one staging box per
  tile operand and tile output of a sub-tile (``BM * SUB_N * w * bytes``, an upper bound); it must fit
  the device's opt-in limit (227 KiB on sm_90). ``bench/triton_resources.py`` prints the compiler's
  own numbers next to this estimate;
* registers: the fp32 accumulator needs ``BM * BN / (32 * warps)`` registers per thread; more than
  128 leaves the epilogue too little of the 255 a thread can have and it spills.

A compile that still runs out of resources (``OutOfResources``) drops the candidate at tuning time.

``schedule``: ``"persistent"`` is the generated ``tl`` kernel (one warp group does a tile's mainloop, then
its epilogue); ``"pingpong"`` is the generated warp-specialized Gluon kernel of :mod:`.pingpong` (two
consumer warpgroups alternate tiles, so one's epilogue overlaps the other's mainloop), a candidate on
sm_90 with every operand TMA-aligned, for the programs :func:`.pingpong.supports`; its
``epilogue_split`` cuts the 128 columns into 4 or 8 pieces.

Choosing a configuration (:meth:`TuningCache.choose`), fastest source first, nothing timed:

1. the entry of this exact key (GPU, versions, program and kernel hash, dtypes, TMA flags, M/N/K
   buckets) in the user's cache or the shipped table;
2. the entries of the same program, dtypes and TMA flags on this GPU at most one log2 bucket away in
   M, N and K together (the same buckets measured with other Triton/torch versions count as one bucket
   away): the candidate fastest over their timings together (the least mean log of its time relative to
   each entry's fastest);
3. likewise the entries of other programs with the same GEMM layout and operand dtype in the same buckets;
4. :func:`heuristic`: ping-pong where the epilogue's tile traffic is large next to the mainloop's K,
   else the first persistent candidate.

An entry's choice is taken only where it is a candidate for these operands; otherwise its fastest
timed candidate is. Timing (:meth:`.TritonBackend._tune`) happens only where asked for:
``CODAGEN_TRITON_AUTOTUNE=1`` times a key on its first use, ``codagen tune`` times a model's keys ahead.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from codagen.epilogue.ir import Program, ProgramError, QuantizedStore, Store

from . import pingpong
from .gluon_support import pingpong_available
from .targets import TARGETS

__all__ = ["KernelConfig", "candidates", "smem_estimate", "cache_dir", "atomic_write", "TuningCache",
           "INTERPRETER_CONFIG", "PINGPONG", "heuristic", "gemm_layout", "interpreter_config", "SMALL_M",
           "SMALL_M_ROWS", "small_m_order"]


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    epilogue_split: int = 1
    tma_epilogue: bool = False
    group_m: int = 8
    schedule: str = "persistent"
    split_k: int = 1

    def __post_init__(self):
        if self.schedule not in ("persistent", "pingpong"):
            raise ValueError(f"schedule must be 'persistent' or 'pingpong', got {self.schedule!r}")
        if self.split_k < 1 or (self.split_k > 1 and (self.schedule != "persistent" or self.tma_epilogue)):
            raise ValueError(f"split_k must be >= 1, and > 1 only for a persistent configuration with the pointer "
                             f"epilogue, got split_k={self.split_k} ({self.schedule}, "
                             f"tma_epilogue={self.tma_epilogue})")
        splits = (4, 8) if self.schedule == "pingpong" else (1, 2, 4)
        if self.epilogue_split not in splits:
            raise ValueError(f"epilogue_split of a {self.schedule} configuration must be one of {splits}, "
                             f"got {self.epilogue_split}")
        if (self.block_n // self.epilogue_split) % 2:
            raise ValueError("a sub-tile's width must be even (column pairs never straddle sub-tiles)")

    @property
    def sub_n(self) -> int:
        return self.block_n // self.epilogue_split

    def short(self) -> str:
        tile = f"{self.block_m}x{self.block_n}x{self.block_k} s{self.num_stages} w{self.num_warps}"
        if self.schedule == "pingpong":
            return f"{tile} pingpong split{self.epilogue_split}"
        short = f"{tile} split{self.epilogue_split} {'tma' if self.tma_epilogue else 'ptr'}"
        return short + (f" k{self.split_k}" if self.split_k > 1 else "")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict) -> KernelConfig:
        return KernelConfig(**d)


#: the interpreter runs every program instance in numpy: small tiles keep the CPU tests fast
INTERPRETER_CONFIG = KernelConfig(32, 32, 32, num_stages=1, num_warps=4, epilogue_split=1, group_m=2)
_INTERPRETER_MAX_BLOCK_N = 256


def interpreter_config(program: Program) -> KernelConfig:
    """:data:`INTERPRETER_CONFIG`, its tile widened to the narrowest power of two that holds whole groups
    of every ``SegmentSum`` (QK-norm heads) and ``QuantizedStore`` along N (``ProgramError`` when none up to 256
    columns does), and its rows to the groups of a ``QuantizedStore`` along M."""
    block_n = INTERPRETER_CONFIG.block_n
    segments = program.column_groups()
    while any(int(block_n * s.width.value) % s.column_group for s in segments):
        if block_n >= _INTERPRETER_MAX_BLOCK_N:
            raise ProgramError(f"{program.name}: {_groups_described(segments)} needs a power-of-two tile width up "
                               f"to {_INTERPRETER_MAX_BLOCK_N} that is a multiple of it")
        block_n *= 2
    block_m = max([INTERPRETER_CONFIG.block_m] + [g.row_group for g in program.row_groups()])
    return _k_tiles_in_groups(program, (dataclasses.replace(INTERPRETER_CONFIG, block_m=block_m, block_n=block_n),))[0]


def _groups_described(grouped) -> str:
    """What groups a program's columns, for an error: segment sums (QK-norm heads) and quantized stores' scales."""
    sizes = sorted({g.column_group for g in grouped if not isinstance(g, QuantizedStore)})
    stores = [g for g in grouped if isinstance(g, QuantizedStore)]
    parts = [f"segment_sum over groups of {sizes} columns (the QK-norm head_dim)"] if sizes else []
    parts += [g.grouping for g in stores]
    return " and ".join(parts)


def _k_tiles_in_groups(program: Program, pool) -> tuple[KernelConfig, ...]:
    """``pool`` for a GEMM with K-group scales (``Gemm.k_scale_group`` G; unchanged without them).

    - BLOCK_K is twice the pool's, at most G: the pools are laid out for 16-bit operands, and twice as many e4m3
      elements keep a stage's bytes; a K tile lies in one group, so it has one scale per operand row. With
      ``b_scale_block`` BLOCK_N is at most G, so the tile's columns share one block's scale.
    - Each K tile's product lands in registers of its own before it is scaled into ``acc``: two accumulators
      (:func:`_halved_accumulators` keeps the configurations with room for them). Per-column scales of B hold a
      register per accumulator column too, and with them sm_90's 4-stage 128x128 kernels spill where 3-stage ones
      do not (``docs/notes/fp8-quantizing-epilogue.md``): at most 3 stages."""
    gemm = program.gemm
    group = gemm.k_scale_group
    if group is None:
        return tuple(pool)
    changed = []
    for cfg in pool:
        block_n = min(cfg.block_n, group) if gemm.b_scale_block else cfg.block_n
        split = max(1, cfg.epilogue_split * block_n // cfg.block_n)
        stages = cfg.num_stages if gemm.b_scale_block else min(cfg.num_stages, 3)
        changed.append(dataclasses.replace(cfg, block_k=min(group, 2 * cfg.block_k), block_n=block_n,
                                           epilogue_split=split, num_stages=stages))
    return tuple(dict.fromkeys(changed))


#: the widest epilogue sub-tile of a program with a quantized store along M, whose column amaxes over the tile's rows
#: are held beside the value it stores: at 64 columns sm_90's kernels of the FP8 backward's quantizing programs spill
#: up to 144 bytes, at 128 up to 1448 (bench/fp8_blockwise_compile.py)
_ROW_GROUP_SUB_N = 32


def _quantized_groups_in_sub_tiles(program: Program, pool) -> tuple[KernelConfig, ...]:
    """``pool`` with each EPILOGUE_SPLIT lowered until the sub-tile holds whole groups of every quantized store along
    N (its scale groups, of 128 columns by default, are wider than the 32- and 64-column sub-tiles the pools favour),
    or, with only quantized stores along M, raised until the sub-tile is at most :data:`_ROW_GROUP_SUB_N` columns
    (or the split is 4);
    ``pool`` as it is for a program without one."""
    stores = [o for o in program.outputs if isinstance(o, QuantizedStore)]
    column_grouped = [o for o in stores if o.along == "n"]
    if not stores:
        return tuple(pool)
    changed = []
    for cfg in pool:
        split = cfg.epilogue_split
        if column_grouped:
            while split > 1 and not _holds_segments(dataclasses.replace(cfg, epilogue_split=split), column_grouped):
                split //= 2
        else:
            while cfg.block_n // split > _ROW_GROUP_SUB_N and split < 4:  # the persistent kernel's splits: 1, 2, 4
                split *= 2
        changed.append(dataclasses.replace(cfg, epilogue_split=split))
    return tuple(dict.fromkeys(changed))


def _halved_accumulators(program: Program, pool) -> tuple[KernelConfig, ...]:
    """The configurations of ``pool`` with at most half of :data:`_MAX_ACC_REGS` accumulator registers per thread,
    for a program that holds a second tile as large as the accumulator (all of ``pool`` if none has that room, or
    for other programs): a K-grouped mainloop's per-tile product, or a quantized store's scaled codes beside the
    value it stores (with the full accumulator the sm_90 and sm_100 kernels of a quantizing residual spill:
    ``docs/notes/fp8-quantizing-epilogue.md``)."""
    if program.gemm.k_scale_group is None and not any(isinstance(o, QuantizedStore) for o in program.outputs):
        return tuple(pool)
    fitting = tuple(cfg for cfg in pool if cfg.block_m * cfg.block_n / (32 * cfg.num_warps) <= _MAX_ACC_REGS // 2)
    return fitting or tuple(pool)


# Hopper (TMA mainloop). The first viable one is the untuned default.
_SM90 = (
    KernelConfig(128, 256, 64, 3, 8, epilogue_split=2, tma_epilogue=False),
    KernelConfig(128, 256, 64, 3, 8, epilogue_split=2, tma_epilogue=True),
    KernelConfig(128, 256, 64, 3, 8, epilogue_split=4, tma_epilogue=False),
    # DOUBLE-width tile operands (SwiGLU backward) fit 128x256 only in quarters staged by TMA
    KernelConfig(128, 256, 64, 3, 8, epilogue_split=4, tma_epilogue=True),
    KernelConfig(128, 128, 64, 4, 8, epilogue_split=1, tma_epilogue=True),
    KernelConfig(128, 128, 64, 4, 8, epilogue_split=2, tma_epilogue=False),
    KernelConfig(128, 128, 64, 4, 8, epilogue_split=2, tma_epilogue=True),
)
SM90 = _SM90  # the Hopper pool by its public name (bench/mainloop_configs.py, bench/triton_resources.py)
# the warp-specialized kernel (.pingpong): 128x128 tiles, a 4-slot ring, two consumer warpgroups of 4 warps
# (num_warps counts one), the epilogue in four or eight TMA-staged column pieces (eight: half the buffers)
PINGPONG = tuple(KernelConfig(128, 128, 64, 4, 4, epilogue_split=split, tma_epilogue=True, schedule="pingpong")
                 for split in (4, 8))
# pointer loads (cp.async pipelining) on a TMA chip whose operands are not TMA-aligned
_SM80 = (
    KernelConfig(128, 128, 32, 4, 8, epilogue_split=1),
    KernelConfig(128, 64, 32, 4, 4, epilogue_split=1),
)
# Ampere, Ada and sm_120 (pointer loads): the 128 x 128 tile's epilogue in quarters first, which no library program
# spills in (the whole tile at once spills in the norm, cross-entropy and SwiGLU backwards, halves in the SwiGLU
# backward on sm_120: the compile matrix); the whole tile last, for QK-norm heads of 128 columns
_AMPERE = (
    KernelConfig(128, 128, 32, 4, 8, epilogue_split=4),
    KernelConfig(128, 128, 32, 4, 8, epilogue_split=2),
    KernelConfig(128, 128, 32, 4, 8, epilogue_split=1),
)
# Blackwell (TMA, tcgen05): 128 x 128 tiles, the epilogue in quarters (128 x 256 spills in the backwards there);
# 128 x 256 in halves last, for QK-norm heads of 64 and 128 columns
_BLACKWELL = (
    KernelConfig(128, 128, 64, 4, 8, epilogue_split=4, tma_epilogue=False),
    KernelConfig(128, 128, 64, 4, 8, epilogue_split=4, tma_epilogue=True),
    KernelConfig(128, 256, 64, 3, 8, epilogue_split=2, tma_epilogue=False),
)
# AMD CDNA (pointer loads, Triton's stream pipeliner double-buffers): 2-stage rings whose compiled LDS fits the
# MI300's 64 KiB for every library program (at most 56 KiB, the cross-entropy epilogues; at 128 x 128 those need 80);
# the whole 128-column tile last, for QK-norm heads of 128 columns (40 KiB)
_CDNA = (
    KernelConfig(128, 64, 64, 2, 4, epilogue_split=2),
    KernelConfig(64, 128, 64, 2, 4, epilogue_split=2),
    KernelConfig(64, 128, 64, 2, 4, epilogue_split=1),
)
# float32 operands multiply in IEEE fp32 (no tensor cores): small tiles
_FP32 = (KernelConfig(64, 64, 32, 3, 4, epilogue_split=1),)

# Decode (M <= SMALL_M_ROWS rows: the batch of one decode step). The weight read is the whole cost. Up to
# 16 rows, 16-row tiles (mma.sync; wgmma's 64-row minimum would move three zero-filled A rows per real one
# through shared memory every stage); up to 64 rows, one 64-row tile spans every row. Deep K pipelines keep
# 64-96 KiB of the weight in flight per SM. Where N gives few column tiles (o-proj and down-proj of a
# 4096-wide model: 64), K is split in 2 or 4 ranges so that more programs stream the weight at once.
# :func:`small_m_order` picks the first guess (measured: docs/notes/decode-gemms.md).
SMALL_M_ROWS = 64
_SIXTEEN_ROWS = tuple(KernelConfig(16, block_n, block_k, stages, 4, epilogue_split=1, group_m=1, split_k=split_k)
                      for block_n, block_k, stages, split_k in (
                          (64, 256, 4, 1), (64, 256, 4, 2), (64, 256, 4, 4), (128, 128, 6, 1), (128, 128, 6, 2),
                          (32, 256, 6, 1), (256, 64, 6, 1)))
_SIXTY_FOUR_ROWS = tuple(KernelConfig(64, block_n, 128, stages, 4, epilogue_split=1, group_m=1)
                         for block_n, stages in ((128, 4), (64, 6), (32, 8), (16, 8)))
SMALL_M = _SIXTEEN_ROWS + _SIXTY_FOUR_ROWS


def small_m_order(m: int, n: int, num_sms: int) -> list[KernelConfig]:
    """The decode configurations for ``m`` rows and ``n`` columns, best guess first: the pool's first tile
    (16 x 64 columns up to 16 rows, 64 x 128 above), with K split in the most ranges the pool holds for it
    that still give at most one program per SM; then the rest of the pool."""
    pool = _SIXTEEN_ROWS if m <= 16 else _SIXTY_FOUR_ROWS
    first = pool[0]
    tiles = -(-m // first.block_m) * -(-n // first.block_n)
    guess = max((cfg for cfg in pool if dataclasses.replace(cfg, split_k=1) == first
                 and (cfg.split_k == 1 or cfg.split_k * tiles <= num_sms)), key=lambda cfg: cfg.split_k)
    return [guess] + [cfg for cfg in pool if cfg != guess]


_MAX_ACC_REGS = 128


def _tile_io(program: Program):
    """(width, is_output) of every tile that crosses the epilogue: tile operands and tile stores."""
    for e in program.inputs.values():
        if e.kind == "tile":
            yield e.width, False
    for o in program.outputs:
        if isinstance(o, Store):
            yield o.value.width, True


def smem_estimate(program: Program, cfg: KernelConfig, operand_bytes: int, io_bytes: int = 2) -> int:
    """Bytes of shared memory the configuration needs (see the module docstring)."""
    if cfg.schedule == "pingpong":
        return pingpong.shared_memory(program, cfg.sub_n, operand_bytes)
    ring = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * operand_bytes
    # layout conversions of a sub-tile go through shared memory (measured: BM * SUB_N * 2 bytes on sm_90)
    scratch = cfg.block_m * cfg.sub_n * 2
    if cfg.tma_epilogue:  # one staging box per tile operand / output (an upper bound: Triton reuses some)
        scratch = max(scratch, sum(int(cfg.block_m * cfg.sub_n * w.value) * io_bytes for w, _ in _tile_io(program)))
    return ring + scratch + 1024  # + barriers


def _holds_segments(cfg: KernelConfig, segments) -> bool:
    return all(int(cfg.sub_n * s.width.value) % s.column_group == 0 for s in segments)


def _holds_row_groups(cfg: KernelConfig, row_groups) -> bool:
    return all(cfg.block_m % g.row_group == 0 for g in row_groups)


def candidates(program: Program, *, target: str, operand_bytes: int, smem_limit: int, tma: bool,
               tma_epilogue: bool = False, m: int | None = None, n: int | None = None,
               num_sms: int | None = None) -> list[KernelConfig]:
    """Configurations worth compiling for this program on ``target`` (a :data:`.targets.TARGETS` name), best guess
    first.

    ``tma``: A and B are TMA-aligned (and the target has TMA); ``tma_epilogue``: so are the tile operands and
    outputs (the ping-pong kernel has no pointer fallback). With ``m <= SMALL_M_ROWS`` (and ``n``, ``num_sms``) on
    sm_90 the pool is the decode configurations, in :func:`small_m_order`."""
    chip = TARGETS[target]
    tma = tma and chip.tma
    small_m = m is not None and m <= SMALL_M_ROWS and chip.name == "sm_90" and tma and operand_bytes == 2
    if operand_bytes == 4:
        pool = _FP32
    elif tma:
        pool = _BLACKWELL if chip.pool == "blackwell" else _SM90
    else:
        pool = {"cdna": _CDNA, "ampere": _AMPERE}.get(chip.pool, _SM80)
    pool = _halved_accumulators(program, _quantized_groups_in_sub_tiles(program, _k_tiles_in_groups(program, pool)))
    segments = program.column_groups()
    if small_m:  # the decode tiles alone, unless none holds whole segments (heads wider than 128 columns)
        fitting = tuple(cfg for cfg in small_m_order(m, n, num_sms) if _holds_segments(cfg, segments)
                        and _holds_row_groups(cfg, program.row_groups())
                        and (cfg.split_k == 1 or not program.gemm.low_rank))  # the low-rank loop: unsplit only
        pool = fitting or pool
    pingpong_pool = ()
    if chip.pingpong and tma and tma_epilogue and operand_bytes == 2 and not small_m and pingpong_available():
        if pingpong.refusal(program) is None:
            pingpong_pool = tuple(cfg for cfg in PINGPONG if smem_estimate(program, cfg, operand_bytes) <= smem_limit)
    # A SegmentSum group (a head, for QK-norm) must lie inside one epilogue sub-tile: a hard constraint,
    # so it filters the pool before the fallback below.
    if segments:
        fitting = tuple(cfg for cfg in pool if _holds_segments(cfg, segments))
        if not fitting:
            hint = ("; in float32 the sub-tiles are narrower: run the model in bfloat16 or float16 (or under "
                    "autocast)" if operand_bytes == 4 else "")
            raise ProgramError(
                f"{program.name}: {_groups_described(segments)} needs an "
                f"epilogue sub-tile width (BLOCK_N / EPILOGUE_SPLIT) that is a multiple of it; the configurations "
                f"for these operands have sub-tile widths {sorted({cfg.sub_n for cfg in pool})}{hint}")
        pool = fitting
    row_groups = program.row_groups()
    if row_groups:  # a quantized store along M: whole groups of rows per tile, a hard constraint as well
        fitting = tuple(cfg for cfg in pool if _holds_row_groups(cfg, row_groups))
        if not fitting:
            raise ProgramError(
                f"{program.name}: {' and '.join(g.grouping for g in row_groups)} needs tiles of a multiple of that "
                f"many rows; the configurations for these operands have {sorted({cfg.block_m for cfg in pool})} rows")
        pool = fitting
    keep = []
    for cfg in pool:
        if cfg.tma_epilogue and not tma:
            continue
        # TMA boxes are at most 256 elements along a dimension; a DOUBLE-width box is 2 * SUB_N
        if cfg.tma_epilogue and any(cfg.sub_n * w.value > 256 for w, _ in _tile_io(program)):
            continue
        if cfg.tma_epilogue and not any(True for _ in _tile_io(program)):
            continue  # nothing to stage: same kernel as the pointer variant
        if smem_estimate(program, cfg, operand_bytes) > smem_limit:
            continue
        if cfg.block_m * cfg.block_n / (32 * cfg.num_warps) > _MAX_ACC_REGS:
            continue
        keep.append(cfg)
    if not keep:  # the smallest one always fits
        keep.append(min(pool, key=lambda c: smem_estimate(program, c, operand_bytes)))
    return keep + list(pingpong_pool)


#: the ping-pong schedule pays off while K <= this many times the epilogue's tile bytes per output
#: element: fit to the shipped H200 table (e.g. the norm backward, 8 bytes, wins up to K 8192; the
#: residual stats, 6 bytes, at K 2048 and not at 8192; input_grad, 2 bytes, never above K 2048)
_PINGPONG_K_PER_TILE_BYTE = 1024


def heuristic(program: Program, pool: list[KernelConfig], k: int) -> KernelConfig:
    """The untimed choice where no tuned entry is near: ping-pong (its finest split) when K is small
    next to the epilogue's tile traffic (the overlapped epilogue is then a large share of a tile's
    time), else the first persistent candidate (the pool's best general guess)."""
    tile_bytes = sum(w.value * 2 for w, _ in _tile_io(program))
    pingpong = [cfg for cfg in pool if cfg.schedule == "pingpong"]
    if pingpong and k <= _PINGPONG_K_PER_TILE_BYTE * tile_bytes:
        return max(pingpong, key=lambda cfg: cfg.epilogue_split)
    persistent = [cfg for cfg in pool if cfg.schedule == "persistent"]
    return (persistent or pool)[0]


def gemm_layout(program: Program) -> str:
    """The operand layout of ``program``'s GEMM, ``"mk,nk"`` for ``nn.Linear``'s forward."""
    return f"{program.gemm.a_layout},{program.gemm.b_layout}"


def cache_dir() -> Path:
    """``$CODAGEN_CACHE_DIR`` or ``~/.cache/codagen``."""
    root = os.environ.get("CODAGEN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "codagen")
    return Path(root)


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class _Key(NamedTuple):
    """The fields of a tuning key (:func:`.tuning.tuning_key`)."""
    gpu: str
    versions: str
    program: str  # name:kernel hash
    dtypes: str   # a:<operand dtype>,<input dtypes>
    tma: str
    shape: tuple[int, int, int]  # log2 of the M, N, K buckets

    @staticmethod
    def parse(key: str) -> _Key | None:
        parts = key.split("|")
        if len(parts) != 6:
            return None
        try:
            shape = tuple(int(field[1:]).bit_length() - 1 for field in parts[5].split())
        except ValueError:
            return None
        return _Key(*parts[:5], shape) if len(shape) == 3 else None

    @property
    def operand_dtype(self) -> str:
        return self.dtypes.split(",")[0]

    def distance(self, other: _Key) -> int:
        return sum(abs(a - b) for a, b in zip(self.shape, other.shape)) + (self.versions != other.versions)


_warned_missing_table = False


def _warn_missing_table(path: Path, error: Exception) -> None:
    """Warn, once a process, that the shipped table cannot be read (an install without its package data)."""
    global _warned_missing_table
    if not _warned_missing_table:
        _warned_missing_table = True
        warnings.warn(f"codagen: the shipped tuning table {path} cannot be read ({error}); every shape "
                      f"without an entry in the user's tuning cache runs an untimed choice. Reinstall codagen "
                      f"from the checkout (pip install -e .) or run codagen tune.", stacklevel=3)


class TuningCache:
    """Tuned configurations by key (GPU name, versions, program, dtypes, shape bucket).

    Read from the shipped table next to this file (measured on the project's H200) and from
    ``path`` (default ``<cache_dir>/triton/tuning.json``); new results are written to the latter. Each
    entry holds the chosen config, every candidate's time and the program's GEMM layout (``gemm``).
    """
    SHIPPED = Path(__file__).with_name("tuned.json")
    #: how far (log2 buckets) an entry of the same program / of another program may be to stand in:
    #: further ones chose worse than :func:`heuristic` when each shipped entry was left out in turn
    NEAR = (1, 0)

    def __init__(self, path: str | os.PathLike | None = None):
        self._lock = threading.Lock()
        self._entries: dict[str, dict] | None = None
        self._parsed: dict[str, _Key | None] = {}
        self._path = None if path is None else Path(path)

    @property
    def path(self) -> Path:
        return self._path or cache_dir() / "triton" / "tuning.json"

    def _load(self) -> dict[str, dict]:
        if self._entries is None:
            entries: dict[str, dict] = {}
            for p in (self.SHIPPED, self.path):
                try:
                    entries.update(json.loads(p.read_text()))
                except (OSError, ValueError) as error:
                    if p == self.SHIPPED:
                        _warn_missing_table(p, error)
            self._entries = entries
        return self._entries

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._load()

    def get(self, key: str) -> KernelConfig | None:
        with self._lock:
            d = self._load().get(key)
        return _config_of(d)

    def fastest(self, key: str, pool: list[KernelConfig]) -> KernelConfig | None:
        """The config of ``pool`` with the shortest time recorded under ``key`` (None if none was): for a
        call that cannot run the bucket's choice (the ping-pong kernel, with operands TMA cannot take)."""
        with self._lock:
            timings = self._load().get(key, {}).get("timings_ms", {})
        return _fastest_of(timings, pool)

    def choose(self, key: str, gemm: str, program: Program, pool: list[KernelConfig],
               k: int) -> tuple[KernelConfig, str]:
        """``(config, source)`` for ``key`` without timing anything: ``source`` is ``"tuned"``, ``"nearest"``
        (same program), ``"layout"`` (another program of GEMM layout ``gemm``) or ``"heuristic"``; see
        the module docstring. The config is always one of ``pool``."""
        with self._lock:
            entries = self._load()
            exact = entries.get(key)
            if exact is not None:
                cfg = _config_of(exact)
                cfg = cfg if cfg in pool else _fastest_of(exact.get("timings_ms", {}), pool)
                if cfg is not None:
                    return cfg, "tuned"
            want = self._parse(key)
            if want is not None:
                ranked = []
                for other, entry in entries.items():
                    got = self._parse(other)
                    if got is None or got.gpu != want.gpu or got.tma != want.tma:
                        continue
                    distance = want.distance(got)
                    if distance > self.NEAR[0 if got.program == want.program else 1]:
                        continue
                    if got.program == want.program and got.dtypes == want.dtypes:
                        ranked.append((0, distance, other))
                    elif entry.get("gemm") == gemm and got.operand_dtype == want.operand_dtype:
                        ranked.append((1, distance, other))
                for tier in sorted({tier for tier, _, _ in ranked}):
                    # the candidate fastest over all this tier's neighbours at once: one bucket's timings
                    # are single medians, a few percent noisy, and the neighbours' agree where they count
                    near = [entries[other].get("timings_ms", {}) for t, _, other in ranked if t == tier]
                    cfg = _fastest_over(near, pool)
                    if cfg is None:  # no candidate timed in every neighbour: the nearest one's choice
                        nearest = entries[min((d, o) for t, d, o in ranked if t == tier)[1]]
                        cfg = _config_of(nearest)
                        cfg = cfg if cfg in pool else _fastest_of(nearest.get("timings_ms", {}), pool)
                    if cfg is not None:
                        return cfg, ("nearest", "layout")[tier]
        return heuristic(program, pool, k), "heuristic"

    def _parse(self, key: str) -> _Key | None:
        parsed = self._parsed.get(key, False)
        if parsed is False:
            parsed = self._parsed[key] = _Key.parse(key)
        return parsed

    def put(self, key: str, cfg: KernelConfig, timings: dict[str, float], gemm: str | None = None) -> None:
        with self._lock:
            entries = self._load()
            entries[key] = {"config": cfg.to_json(), "timings_ms": timings}
            if gemm is not None:
                entries[key]["gemm"] = gemm
            try:
                on_disk = json.loads(self.path.read_text())
            except (OSError, ValueError):
                on_disk = {}
            on_disk[key] = entries[key]
            try:
                atomic_write(self.path, json.dumps(on_disk, indent=1, sort_keys=True))
            except OSError:
                pass  # a read-only cache directory only costs re-tuning


def _config_of(entry: dict | None) -> KernelConfig | None:
    if entry is None:
        return None
    try:
        return KernelConfig.from_json(entry["config"])
    except (KeyError, TypeError, ValueError):
        return None


def _fastest_over(timings: list[dict[str, float]], pool: list[KernelConfig]) -> KernelConfig | None:
    """The config of ``pool`` fastest over several entries' timings together: the least mean over the entries
    of log(its time / that entry's fastest time). Only a config timed in every entry counts; None if none is."""
    best, best_score = None, math.inf
    for cfg in pool:
        logs = []
        for entry in timings:
            ms = entry.get(cfg.short())
            if ms is None or math.isnan(ms):
                break
            logs.append(math.log(ms / min(v for v in entry.values() if not math.isnan(v))))
        else:
            if logs and (score := sum(logs) / len(logs)) < best_score:
                best, best_score = cfg, score
    return best


def _fastest_of(timings: dict[str, float], pool: list[KernelConfig]) -> KernelConfig | None:
    timed = [(ms, i) for i, cfg in enumerate(pool)
             if (ms := timings.get(cfg.short())) is not None and not math.isnan(ms)]
    return pool[min(timed)[1]] if timed else None
