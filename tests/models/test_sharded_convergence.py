"""``bench/sharded_convergence.py --dry-run`` on two forked gloo processes: the JSON it writes, and codagen's per-step
losses against transformers' and against one process, in float32."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("transformers")

from codagen.bench.common import load_module  # noqa: E402

from .conftest import run_distributed  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

ROOT = Path(__file__).resolve().parents[2]
convergence = load_module("sharded_convergence", ROOT / "bench" / "sharded_convergence.py")


def _dry_run(rank, world, out):
    return convergence.main(["--dry-run", "--out", out])


def test_dry_run_writes_matching_loss_curves(tmp_path, monkeypatch):
    for name, value in convergence.MULTICAST_OFF.items():
        monkeypatch.setenv(name, value)
    result = run_distributed(2, _dry_run, str(tmp_path))
    (path,) = tmp_path.glob("*-sharded-convergence-single-fsdp-tp.json")
    if importlib.util.find_spec("matplotlib") is not None:
        assert path.with_suffix(".png").stat().st_size > 0
    written = json.loads(path.read_text())
    assert written == json.loads(json.dumps(result))

    env, config = written["env"], written["config"]
    assert env["world_size"] == 2 and env["gpus"] == [None, None] and env["dry_run"]
    assert env["multicast"] == convergence.MULTICAST_OFF
    assert env["dtype"] == "float32" and env["backend"] == "reference" and env["torch"] and env["transformers"]
    assert config["shape"] == "tiny" and config["steps"] == 5 and config["vocab"] % 64 == 0

    records = {(r["mode"], r["provider"]): r for r in written["records"]}
    assert records.keys() == {(mode, provider) for mode in ("single", "fsdp", "tp")
                              for provider in ("codagen", "transformers")}
    for (mode, provider), record in records.items():
        losses = record["losses"]
        assert len(losses) == 5 and all(math.isfinite(loss) for loss in losses)
        assert losses[-1] < losses[0], f"{mode} {provider} does not train: {losses}"
        assert record["world"] == (1 if mode == "single" else 2)
        # single holds the whole model, FSDP half of each parameter, TP half of the blocks' GEMM weights (90% of the
        # tiny model) and all of the embeddings and norms
        held = record["rank0_parameters"] / config["parameters"]
        assert {"single": held == 1, "fsdp": 0.45 < held <= 0.55, "tp": 0.5 < held < 0.6}[mode], (mode, provider, held)

    by_name = {c["name"]: c for c in written["comparisons"]}
    pairs = {"single: codagen vs transformers": (("single", "codagen"), ("single", "transformers")),
             "fsdp: codagen vs transformers": (("fsdp", "codagen"), ("fsdp", "transformers")),
             "tp: codagen vs transformers": (("tp", "codagen"), ("tp", "transformers")),
             "codagen: fsdp on 2 ranks vs single": (("fsdp", "codagen"), ("single", "codagen")),
             "codagen: tp on 2 ranks vs single": (("tp", "codagen"), ("single", "codagen")),
             "transformers: fsdp on 2 ranks vs single": (("fsdp", "transformers"), ("single", "transformers")),
             "transformers: tp on 2 ranks vs single": (("tp", "transformers"), ("single", "transformers"))}
    assert by_name.keys() == pairs.keys()
    for name, (got, want) in pairs.items():
        diffs = [abs(a - b) for a, b in zip(records[got]["losses"], records[want]["losses"], strict=True)]
        assert by_name[name]["max_abs_diff"] == max(diffs)
        assert diffs[by_name[name]["step"] - 1] == max(diffs)
        rel = max(d / abs(b) for d, b in zip(diffs, records[want]["losses"]))
        assert by_name[name]["max_rel_diff"] == rel <= 1e-4, name


def test_refuses_to_start_with_multicast_on(monkeypatch):
    for name, value in convergence.MULTICAST_OFF.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS")
    with pytest.raises(SystemExit, match="NVLink multicast must be off .* NVSHMEM_DISABLE_NVLS=1"):
        convergence.main(["--dry-run"])
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with pytest.raises(SystemExit, match="'NCCL_NVLS_ENABLE': '1'"):
        convergence.main(["--dry-run"])
