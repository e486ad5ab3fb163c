"""SM clock and power while a block runs back to back, per provider (GPU; nvidia-smi on the path).

    PYTHONPATH=. python bench/block_clocks.py [--shapes d2048 llama3-8b] [--providers speed_of_light compile
        codagen] [--seconds 3] [--smi-index 0] [--out DIR]

Is the GPU clocked lower, or power-capped, while a provider's block runs? (docs/notes/power-cap-and-clocks.md)
Each provider's fwd+bwd step runs back to back for ``--seconds`` (after a second of warm-up) while nvidia-smi
samples the SM clock, the power draw and the throttle reasons every 50 ms. Reports ms per step, the
median clock and power, the energy per step (power x time) and the throttle reasons seen
(0x4: software power cap).
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from codagen.bench.block import SHAPES, block_providers
from codagen.bench.common import environment


def run_for(step, seconds: float) -> int:
    """Run ``step`` back to back for about ``seconds``; return the number of steps (synchronized)."""
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        step()
        steps += 1
        if steps % 4 == 0:  # keep the launch queue short, so the clock samples cover this provider only
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return steps


def measure(step, seconds: float, smi_index: int) -> dict:
    run_for(step, 1.0)
    smi = subprocess.Popen(["nvidia-smi", "-i", str(smi_index), "-lms", "50", "--format=csv,noheader,nounits",
                            "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.2)
    started = time.perf_counter()
    steps = run_for(step, seconds)
    elapsed = time.perf_counter() - started
    smi.terminate()
    out, _ = smi.communicate()
    rows = [line.split(", ") for line in out.strip().splitlines() if line.count(",") == 2]
    mhz = [float(r[0]) for r in rows]
    watts = [float(r[1]) for r in rows]
    ms = 1e3 * elapsed / steps
    power = statistics.median(watts)
    return {"ms_per_step": ms, "sm_mhz": statistics.median(mhz), "power_w": power, "joules_per_step": power * ms / 1e3,
            "throttle": dict(collections.Counter(r[2] for r in rows)), "samples": len(rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["d2048", "llama3-8b"], choices=sorted(SHAPES))
    p.add_argument("--providers", nargs="+", default=["speed_of_light", "compile", "codagen"])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--smi-index", type=int, default=0, help="nvidia-smi's index of the GPU torch uses")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    records = []
    for shape in args.shapes:
        factories, _ = block_providers(SHAPES[shape], 2, 8192, torch.device("cuda"), torch.bfloat16)
        for provider in args.providers:
            step = factories[provider]()
            step()
            result = measure(step, args.seconds, args.smi_index)
            del step
            torch.cuda.empty_cache()
            records.append({"suite": "block_clocks", "shape": shape, "provider": provider, **result})
            print(f"{shape:10s} {provider:15s} {result['ms_per_step']:7.3f} ms  {result['sm_mhz']:6.0f} MHz  "
                  f"{result['power_w']:5.0f} W  {result['joules_per_step']:6.3f} J/step  {result['throttle']}",
                  flush=True)
    if args.out:
        path = Path(args.out) / "block-clocks.json"
        path.write_text(json.dumps({"env": environment(), "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
