"""``bench/ab.py``: the A/B of two revisions' kernels, in its CPU dry mode (tiny shapes, the interpreter)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_dry_run_compares_a_revision_with_itself(tmp_path):
    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "ab.py"), "--base", "HEAD", "--head", "HEAD", "--dry-run",
                    "--rounds", "2", "--kernels", "o_proj_residual_rms", "--out", str(out)], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["base"]["commit"] == result["head"]["commit"] and result["env"]["dry_run"]
    (record,) = result["records"]
    assert record["name"] == "o_proj_residual_rms" and record["same_source"]
    assert record["base"]["kernel_hash"] == record["head"]["kernel_hash"]
    for side in ("base", "head"):
        assert len(record[side]["round_ms"]) == 2 and record[side]["median_ms"] > 0
    assert record["head_over_base"] == record["head"]["median_ms"] / record["base"]["median_ms"]
