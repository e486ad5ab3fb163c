"""``codagen bench generate --smoke``: the harness runs every CPU provider and records each case."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from codagen.bench import generate  # noqa: E402


def test_generate_bench_smoke(tmp_path):
    assert generate.main(["--smoke", "--new-tokens", "3", "--rl", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("*-generate.json")
    records = json.loads(result.read_text())["records"]
    assert not [r for r in records if r.get("error")], [r["error"] for r in records if r.get("error")]
    cases = {(r["case"], r["provider"]) for r in records}
    for case in ("prefill 1x64", "prefill 2x32"):
        assert {p for c, p in cases if c == case} == {"eager", "codagen"}
    for case in ("decode b1", "decode b2"):
        assert {p for c, p in cases if c == case} == {"eager", "codagen_eager", "codagen", "generate",
                                                      "codagen_generate", "codagen_generate_static",
                                                      "codagen_generate_dynamic", "generate_sample",
                                                      "codagen_generate_sample"}
    decode = [r for r in records if r["pass_"] == "decode"]
    assert all(r["bytes_per_step"] > 0 for r in decode)
    assert all(r["tokens_equal_first_provider"] == 1.0 for r in decode if not r["provider"].endswith("_sample"))
    (rl,) = [r for r in records if r["pass_"] == "rl"]
    assert rl["provider"] == "rl_codagen" and rl["generate_ms"] > 0 and rl["train_ms"] > 0


def test_bytes_per_step_llama3_1b():
    """The decode roofline's bytes: LLaMA-3 1B has 1.236e9 weights (16 layers, untied head) in bf16."""
    shape = generate.MODELS["llama3-1b"]
    assert shape.weight_bytes(16) == 2 * (16 * (2048 * 3072 + 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048)
                                          + 2048 + 128256 * 2048)
    assert abs(shape.weight_bytes(16) / 2 - 1.236e9) < 1e6
    assert shape.kv_bytes(16, batch=1, context=2048) == 2 * 2 * 16 * 2048 * 8 * 64
