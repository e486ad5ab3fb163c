"""Do kernel choices tuned one kernel at a time still win inside a power-capped block? (GPU, bf16)

    PYTHONPATH=. python bench/tile_choice_ab.py [--shapes d2048 llama3-1b] [--within 0.04] [--rounds 5] [--out DIR]

``tuned.json`` picks each bucket's configuration by timing the kernel alone. Inside a block the GPU runs
at its 690 W power cap (docs/notes/power-cap-and-clocks.md), where a step's time is its energy over
690 W, and a kernel that is as fast alone but moves more bytes through L2 and shared memory per FLOP
costs the *other* kernels clock. The ping-pong kernels use 128 x 128 tiles, the persistent ones 128 x 256:
per FLOP the latter read a third less from L2. This times codagen's block with three tables, in one
process, in rotated rounds against the speed-of-light line:

``isolated``   the shipped choices;
``wide``       each ping-pong choice replaced by the bucket's fastest 128 x 256 persistent configuration
               when that one timed within ``--within`` of it alone;
``wide_all``   every ping-pong choice replaced by the bucket's fastest 128 x 256 configuration.

The tables differ only in the backend's chosen configs: the same weights, inputs and kernels' code.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from codagen.backends import get_backend
from codagen.backends.triton.configs import KernelConfig
from codagen.bench.block import SHAPES, block_providers
from codagen.bench.common import median_ms, ratio_records, timed_rounds, write_results


def wide_table(entries: dict, within: float) -> tuple[dict, list[str]]:
    """``entries`` with ping-pong choices swapped for the best 128 x 256 config within ``within`` of them."""
    table, changed = {}, []
    for key, entry in entries.items():
        table[key] = entry
        if entry["config"]["schedule"] != "pingpong":
            continue
        timings = {name: ms for name, ms in entry["timings_ms"].items() if not math.isnan(ms)}
        wide = {name: ms for name, ms in timings.items() if name.startswith("128x256")}
        if not wide:
            continue
        name = min(wide, key=wide.get)
        if wide[name] <= (1 + within) * min(timings.values()):
            table[key] = {**entry, "config": _config_named(name).to_json()}
            changed.append(f"{key.split('|')[2].split(':')[0]} {key.split('|')[-1]}: {name} "
                           f"({wide[name] / min(timings.values()):.3f}x alone)")
    return table, changed


def _config_named(short: str) -> KernelConfig:
    """The persistent config whose ``short()`` is ``short`` ("128x256x64 s3 w8 split4 tma")."""
    tile, stages, warps, split, epilogue = short.split()
    block_m, block_n, block_k = (int(v) for v in tile.split("x"))
    cfg = KernelConfig(block_m, block_n, block_k, int(stages[1:]), int(warps[1:]), int(split[5:]),
                       tma_epilogue=epilogue == "tma")
    assert cfg.short() == short, (cfg.short(), short)
    return cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["d2048", "llama3-1b"], choices=sorted(SHAPES))
    p.add_argument("--within", type=float, default=0.04)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    backend = get_backend("triton")
    shipped = dict(backend.tuning._load())
    tables = {"isolated": (shipped, []), "wide": wide_table(shipped, args.within), "wide_all": wide_table(shipped, 9.0)}
    for name, (_, changed) in tables.items():
        print(f"{name}: {len(changed)} choices changed" + "".join(f"\n  {c}" for c in changed), flush=True)
    records = []
    for shape in args.shapes:
        factories, _ = block_providers(SHAPES[shape], 2, 8192, torch.device("cuda"), torch.bfloat16)
        steps = {"speed_of_light": factories["speed_of_light"]()}
        for name, (table, _) in tables.items():
            backend.tuning._entries, backend._plans = table, {}
            step = factories["codagen"]()
            step()  # builds this table's plans (kernel + chosen config per call signature)
            plans = backend._plans

            def run(step=step, plans=plans, table=table):
                backend._plans, backend.tuning._entries = plans, table
                step()
            steps[f"codagen_{name}"] = run
        times = timed_rounds(steps, args.rounds, median_ms)
        records += ratio_records("tile_choice_ab", shape, times, "speed_of_light")
        del steps
        torch.cuda.empty_cache()
    if args.out:
        write_results("tile-choice-ab", records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
