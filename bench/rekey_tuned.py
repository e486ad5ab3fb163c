"""Carry the shipped tuning table (codagen/backends/triton/tuned.json) over a kernel-code change that does
not change performance (a fix in a per-row reduction, a renamed variable), instead of retuning on the GPU.

Each key names its program's ``kernel_hash``, which changes with any change to the generated code. Given a
checkout of the code the table was measured on, this maps every program's old hash to its current one
and rewrites the keys; the choices and timings stay. A change that can move a kernel's time needs a
retune instead (``bench/tune_buckets.py``).

    git archive <commit the table was tuned at> | tar -x -C /tmp/tuned_at
    python bench/rekey_tuned.py /tmp/tuned_at
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "codagen" / "backends" / "triton" / "tuned.json"

# every library program the tuning table may hold, by the library call that makes it (not by its program text,
# which a change to the program itself alters)
_HASHES = """
import json
try:
    from codagen.backends.triton.tuning import kernel_hash
except ImportError:  # a tree from before the backend was split by concern
    from codagen.backends.triton.backend import kernel_hash
from codagen.epilogue import library
calls = ["linear()", "input_grad()", "rms_linear()", "residual_rms_stats()", "rms_gate_up_swiglu()",
         "rms_lm_head_cross_entropy()", "rms_lm_head_cross_entropy_backward()", "swiglu_backward()", "rms_qkv_rope()"]
calls += [f"rms_qkv_rope({head_dim}, 1e-6)" for head_dim in (64, 128)]
calls += [f"rms_norm_backward({grad!r})" for grad in ("add", "accumulate", "none")]
calls += [f"weight_grad({accumulate}, {dtype!r})" for accumulate in (False, True) for dtype in ("input", "float32")]
calls += ["rms_gate_up_swiglu(save_preact=False)"]  # the inference programs (a tree from before them has none)
calls += [f"rms_qkv_rope({head_dim}, 1e-6, save_preact=False)" for head_dim in (64, 128)]
hashes = {}
for call in calls:
    try:
        program = eval("library." + call)
    except TypeError:
        continue
    hashes[call] = f"{program.name}:{kernel_hash(program)}"
print(json.dumps(hashes))
"""


def _hashes(tree: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", _HASHES], env=env, cwd=tree, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tuned_at", type=Path, help="a checkout of the code the table was measured on")
    args = parser.parse_args()
    old, new = _hashes(args.tuned_at), _hashes(ROOT)
    renamed = {old[key]: new[key] for key in old if key in new}
    table = json.loads(TABLE.read_text())
    rekeyed, unknown = {}, set()
    for key, entry in table.items():
        gpu, versions, program, rest = key.split("|", 3)
        if program not in renamed:
            unknown.add(program)
        rekeyed["|".join((gpu, versions, renamed.get(program, program), rest))] = entry
    TABLE.write_text(json.dumps(rekeyed, indent=1, sort_keys=True) + "\n")
    changed = sum(1 for a, b in renamed.items() if a != b)
    print(f"{TABLE.relative_to(ROOT)}: {len(table)} entries, {changed} program hashes changed; "
          f"not found (kept as they were): {sorted(unknown) or 'none'}")


if __name__ == "__main__":
    main()
