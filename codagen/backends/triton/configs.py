"""Kernel configurations, their pruning by resources, and the on-disk cache of tuned choices.

A :class:`KernelConfig` fixes everything the launch chooses: tile sizes, pipeline depth, warps, how the
epilogue is cut (``epilogue_split``: the accumulator's column halves are processed one after the other,
halving the epilogue's live registers) and whether epilogue tiles move through TMA descriptors
(``tma_epilogue``: the copy engine stages them in shared memory) or plain pointer loads/stores.

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
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from codagen.epilogue.ir import Program, ProgramError, Store, TileInput

__all__ = ["KernelConfig", "candidates", "smem_estimate", "cache_dir", "TuningCache", "INTERPRETER_CONFIG", "PINGPONG"]


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

    def __post_init__(self):
        if self.schedule not in ("persistent", "pingpong"):
            raise ValueError(f"schedule must be 'persistent' or 'pingpong', got {self.schedule!r}")
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
        return f"{tile} split{self.epilogue_split} {'tma' if self.tma_epilogue else 'ptr'}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict) -> "KernelConfig":
        return KernelConfig(**d)


#: the interpreter runs every program instance in numpy: small tiles keep the CPU tests fast
INTERPRETER_CONFIG = KernelConfig(32, 32, 32, num_stages=1, num_warps=4, epilogue_split=1, group_m=2)

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
# the warp-specialized kernel (.pingpong): 128x128 tiles, a 4-slot ring, two consumer warpgroups of 4 warps
# (num_warps counts one), the epilogue in four or eight TMA-staged column pieces (eight: half the buffers)
PINGPONG = tuple(KernelConfig(128, 128, 64, 4, 4, epilogue_split=split, tma_epilogue=True, schedule="pingpong")
                 for split in (4, 8))
# Ampere/Ada (pointer loads, cp.async pipelining)
_SM80 = (
    KernelConfig(128, 128, 32, 4, 8, epilogue_split=1),
    KernelConfig(128, 64, 32, 4, 4, epilogue_split=1),
)
# float32 operands multiply in IEEE fp32 (no tensor cores): small tiles
_FP32 = (KernelConfig(64, 64, 32, 3, 4, epilogue_split=1),)

_MAX_ACC_REGS = 128


def _tile_io(program: Program):
    """(width, is_output) of every tile that crosses the epilogue: tile operands and tile stores."""
    for e in program.inputs.values():
        if isinstance(e, TileInput):
            yield e.width, False
    for o in program.outputs:
        if isinstance(o, Store):
            yield o.value.width, True


def smem_estimate(program: Program, cfg: KernelConfig, operand_bytes: int, io_bytes: int = 2) -> int:
    """Bytes of shared memory the configuration needs (see the module docstring)."""
    if cfg.schedule == "pingpong":
        from . import pingpong
        return pingpong.shared_memory(program, cfg.sub_n, operand_bytes)
    ring = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * operand_bytes
    # layout conversions of a sub-tile go through shared memory (measured: BM * SUB_N * 2 bytes on sm_90)
    scratch = cfg.block_m * cfg.sub_n * 2
    if cfg.tma_epilogue:  # one staging box per tile operand / output (an upper bound: Triton reuses some)
        scratch = max(scratch, sum(int(cfg.block_m * cfg.sub_n * w.value) * io_bytes for w, _ in _tile_io(program)))
    return ring + scratch + 1024  # + barriers


def candidates(program: Program, *, major: int, operand_bytes: int, smem_limit: int, tma: bool,
               tma_epilogue: bool = False) -> list[KernelConfig]:
    """Configurations worth compiling for this program on this GPU, best guess first.

    ``tma``: A and B are TMA-aligned; ``tma_epilogue``: so are the tile operands and outputs (the
    ping-pong kernel has no pointer fallback)."""
    if operand_bytes == 4:
        pool = _FP32
    elif tma:
        pool = _SM90
    else:
        pool = _SM80
    pingpong_pool = ()
    if major == 9 and tma and tma_epilogue and operand_bytes == 2:
        from . import pingpong_codegen
        if pingpong_codegen.refusal(program) is None:
            pingpong_pool = tuple(cfg for cfg in PINGPONG if smem_estimate(program, cfg, operand_bytes) <= smem_limit)
    # A SegmentSum group (a head, for QK-norm) must lie inside one epilogue sub-tile: a hard constraint,
    # so it filters the pool before the fallback below.
    segments = program.segment_sums()
    if segments:
        fitting = tuple(cfg for cfg in pool if all(int(cfg.sub_n * s.width.value) % s.size == 0 for s in segments))
        if not fitting:
            sizes = sorted({s.size for s in segments})
            raise ProgramError(
                f"{program.name}: segment_sum over groups of {sizes} columns (the QK-norm head_dim) needs an "
                f"epilogue sub-tile width (BLOCK_N / EPILOGUE_SPLIT) that is a multiple of it; the configurations "
                f"for these operands have sub-tile widths {sorted({cfg.sub_n for cfg in pool})}")
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


def cache_dir() -> Path:
    """``$CODAGEN_CACHE_DIR`` or ``~/.cache/codagen``."""
    root = os.environ.get("CODAGEN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "codagen")
    return Path(root)


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class TuningCache:
    """Tuned configurations by key (GPU name, versions, program, dtypes, shape bucket).

    Read from the shipped table next to this file (measured on the project's H200) and from
    ``<cache_dir>/triton/tuning.json``; new results are written to the latter.
    """
    SHIPPED = Path(__file__).with_name("tuned.json")

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[str, dict] | None = None

    @property
    def path(self) -> Path:
        return cache_dir() / "triton" / "tuning.json"

    def _load(self) -> dict[str, dict]:
        if self._entries is None:
            entries: dict[str, dict] = {}
            for p in (self.SHIPPED, self.path):
                try:
                    entries.update(json.loads(p.read_text()))
                except (OSError, ValueError):
                    pass
            self._entries = entries
        return self._entries

    def get(self, key: str) -> KernelConfig | None:
        with self._lock:
            d = self._load().get(key)
        if d is None:
            return None
        try:
            return KernelConfig.from_json(d["config"])
        except (KeyError, TypeError, ValueError):
            return None

    def fastest(self, key: str, pool: list[KernelConfig]) -> KernelConfig | None:
        """The config of ``pool`` with the shortest time recorded under ``key`` (None if none was): for a
        call that cannot run the bucket's choice (the ping-pong kernel, with operands TMA cannot take)."""
        with self._lock:
            timings = self._load().get(key, {}).get("timings_ms", {})
        timed = [(ms, i) for i, cfg in enumerate(pool)
                 if (ms := timings.get(cfg.short())) is not None and not math.isnan(ms)]
        return pool[min(timed)[1]] if timed else None

    def put(self, key: str, cfg: KernelConfig, timings: dict[str, float]) -> None:
        with self._lock:
            entries = self._load()
            entries[key] = {"config": cfg.to_json(), "timings_ms": timings}
            try:
                on_disk = json.loads(self.path.read_text())
            except (OSError, ValueError):
                on_disk = {}
            on_disk[key] = entries[key]
            try:
                _atomic_write(self.path, json.dumps(on_disk, indent=1, sort_keys=True))
            except OSError:
                pass  # a read-only cache directory only costs re-tuning
