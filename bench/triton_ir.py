"""IR statistics of one library kernel compiled for sm_90 on any machine (no GPU needed).

    python bench/triton_ir.py PROGRAM [--config 128x256x64:3:8:2:ptr] [--dump DIR]

Counts, in the TTGIR, the layout conversions (``ttg.convert_layout``) and shared-memory buffers
(``ttg.local_alloc``), and in the PTX the shared-memory traffic (``st.shared``/``ld.shared``, also
vectorised and ``stmatrix``/``ldmatrix``), barriers (``bar.sync``), local-memory (spill) traffic,
``sin``/``cos`` approximations and transcendental helpers. ``--dump`` writes ttgir/ptx/source there.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from triton_resources import compile_one, resources  # noqa: E402

from codagen.backends.triton.configs import KernelConfig  # noqa: E402
from codagen.epilogue import library  # noqa: E402

PTX_PATTERNS = {
    "st.shared": r"^\s*st\.shared", "ld.shared": r"^\s*ld\.shared", "stmatrix": r"stmatrix", "ldmatrix": r"ldmatrix",
    "bar.sync": r"^\s*bar\.sync|barrier\.sync", "st.local": r"^\s*st\.local", "ld.local": r"^\s*ld\.local",
    "sin.approx": r"sin\.approx", "cos.approx": r"cos\.approx", "ex2.approx": r"ex2\.approx", "rcp": r"rcp\.",
    "wgmma": r"wgmma\.mma_async", "cp.async.bulk.tensor": r"cp\.async\.bulk\.tensor", "st.global": r"^\s*st\.global",
}


def parse_config(text: str) -> KernelConfig:
    tile, stages, warps, split, epi = text.split(":")
    bm, bn, bk = (int(x) for x in tile.split("x"))
    return KernelConfig(bm, bn, bk, int(stages), int(warps), epilogue_split=int(split), tma_epilogue=epi == "tma")


def stats(compiled) -> dict[str, int]:
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    out = {"convert_layout": ttgir.count("ttg.convert_layout"), "local_alloc": ttgir.count("ttg.local_alloc"),
           "ptx_lines": ptx.count("\n")}
    for key, pat in PTX_PATTERNS.items():
        out[key] = len(re.findall(pat, ptx, flags=re.M))
    regs, stack = resources(compiled.asm["cubin"])
    out.update(regs=regs, stack=stack, smem=compiled.metadata.shared)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("program")
    p.add_argument("--config", action="append", default=[], help="BMxBNxBK:stages:warps:split:ptr|tma")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--dump", default=None)
    args = p.parse_args(argv)
    program = library.PROGRAMS[args.program]()
    for text in args.config or ["128x256x64:3:8:2:ptr"]:
        cfg = parse_config(text)
        c = compile_one(program, cfg, args.dtype, 90)
        s = stats(c)
        print(f"{args.program} {cfg.short()}: " + " ".join(f"{k}={v}" for k, v in s.items()), flush=True)
        if args.dump:
            d = Path(args.dump)
            d.mkdir(parents=True, exist_ok=True)
            stem = f"{args.program}_{text.replace(':', '_')}"
            (d / f"{stem}.ttgir").write_text(c.asm["ttgir"])
            (d / f"{stem}.ptx").write_text(c.asm["ptx"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
