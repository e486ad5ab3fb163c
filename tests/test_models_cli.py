"""The model-level commands end to end on CPU: the demo (a few steps) and the block benchmark's harness."""
from __future__ import annotations

import json
import re

import pytest
import torch

from codagen import demo
from codagen.bench import block


def test_corpus_and_tokenizer():
    text = demo.make_corpus(5000, seed=3)
    assert len(text) == 5000 and text == demo.make_corpus(5000, seed=3) != demo.make_corpus(5000, seed=4)
    assert "=" in text and "the " in text
    tok = demo.CharTokenizer(text)
    assert tok.decode(tok.encode(text[:300]).tolist()) == text[:300]


def test_demo_runs(tmp_path, capsys):
    """On CPU (a log, not a terminal): the two runs in float64, their loss difference stated as what it is, no
    speed (the reference backend's timing measures nothing), no progress bar."""
    assert demo.main(["--steps", "3", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "\r" not in out + captured.err and not captured.err
    assert "speed" not in out and "tokens/s" not in out and "on cpu in float64" in out
    (diff,) = re.findall(r"^max \|loss difference\| over 3 steps, float64: (\S+)$", out, flags=re.M)
    assert float(diff) < 1e-10
    # the two runs start from the same init on the same batch: equal first losses
    rows = dict(re.findall(r"^(codagen|PyTorch) +([\d.]+) ", out, flags=re.M))
    assert rows.keys() == {"codagen", "PyTorch"} and rows["codagen"] == rows["PyTorch"]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "loss.png").stat().st_size > 1000


@pytest.mark.gpu
def test_demo_on_gpu_prints_speed(tmp_path, capsys):
    """On a GPU (Triton backend, bf16) the demo prints each run's tokens/s and their ratio."""
    assert demo.main(["--device", "cuda", "--steps", "12", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "on cuda in bfloat16; codagen backend: triton" in out
    assert re.search(r"^max \|loss difference\| over 12 steps, bfloat16: \S+$", out, flags=re.M)
    rows = re.findall(r"^(codagen|PyTorch) +[\d.]+ +[\d.]+ +[\d.]+ +([\d,]+)$", out, flags=re.M)
    assert {name for name, _ in rows} == {"codagen", "PyTorch"} and all(int(t.replace(",", "")) > 0 for _, t in rows)
    assert re.search(r"^codagen / PyTorch tokens/s: [\d.]+x$", out, flags=re.M)


def test_block_bench_smoke(tmp_path, capsys):
    assert block.main(["--smoke", "--layers", "1", "--providers", "speed_of_light", "eager", "liger", "codagen",
                       "--cases", "causal", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-block.json")
    records = json.loads(path.read_text())["records"]
    assert {r["suite"] for r in records} == {"block"}
    assert {(r["pass"], r["provider"]) for r in records} >= {("fwd+bwd", "codagen"), ("step", "eager")}
    for r in records:
        if r["provider"] == "liger":  # recorded as an error when Liger is not installed, never fatal
            assert (r["median_ms"] is None) == ("error" in r)
        else:
            assert r["median_ms"] > 0, r.get("traceback")
            # timed in interleaved rounds; the median of the round medians is reported
            assert len(r["round_ms"]) == 3 and r["median_ms"] == sorted(r["round_ms"])[1]
    diffs = [r["rel_diff_vs_eager"] for r in records if r["provider"] == "codagen" and r["pass"] == "fwd+bwd"]
    # fp32 on CPU: the fused block computes the eager block, with QK-norm too, under each attention mask
    assert len(diffs) == len(block.SMOKE_SHAPES) == 3 and max(diffs) < 1e-5
    out = capsys.readouterr().out
    assert "| fwd+bwd | smoke-gqa |" in out and "| fwd+bwd | smoke-qk-norm |" in out


@pytest.mark.parametrize("case", ["padded", "packed"])
def test_block_bench_attention_cases(case):
    """Every provider of a masked case runs under the case's mask; codagen's block equals eager's under it."""
    mask, positions = block.attention_case(case, 2, 32, torch.device("cpu"))
    assert mask.shape[-2:] == (32, 32) and not mask.all()
    if case == "padded":
        assert (~mask[:, 0, -1, :]).sum() == 16  # 25% of the 64 tokens are pads, hidden as keys
    else:
        assert positions.tolist()[16:24] == list(range(8))  # the second document restarts at 0
    factories, check = block.block_providers(block.SMOKE_SHAPES["smoke-gqa"], 2, 32, torch.device("cpu"),
                                             torch.float64, case)
    assert check() < 1e-6  # (RoPE frequencies are float32)
    for name in ("speed_of_light", "eager", "codagen"):
        factories[name]()()


@pytest.mark.parametrize("provider", ["eager", "codagen"])
def test_block_bench_steps_start_from_fresh_gradients(provider):
    """Every timed step resets the gradients of the tensors it trains: none left unused (a copy of a
    weight, say), none accumulated from the previous step."""
    torch.manual_seed(0)
    shape = block.SMOKE_SHAPES["smoke-gqa"]
    block_factories, _ = block.block_providers(shape, 2, 32, torch.device("cpu"), torch.float64)
    model_factories = block.model_providers(shape, 1, 128, 2, 32, torch.device("cpu"), torch.float64)
    for factories in (block_factories, model_factories):
        step = factories[provider]()
        step()
        assert all(t.grad is not None for t in step.params), "a trained tensor got no gradient"
        first = [t.grad.clone() for t in step.params]
        step()
        for before, t in zip(first, step.params):
            torch.testing.assert_close(t.grad, before, rtol=1e-12, atol=0)


def test_tune_buckets_records_the_block_benchmarks_fused_calls():
    """``bench/tune_buckets.py --blocks``: one codagen block and model step run on the Triton backend
    (the interpreter here) and every fused GEMM call is recorded with its tensors; the backend is left
    as it was."""
    import importlib.util
    from pathlib import Path

    from codagen.backends import get_backend
    spec = importlib.util.spec_from_file_location("tune_buckets",
                                                  Path(__file__).resolve().parents[1] / "bench" / "tune_buckets.py")
    tune_buckets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_buckets)
    torch.manual_seed(0)
    backend = get_backend("triton")
    shapes = {"smoke-gqa": block.SMOKE_SHAPES["smoke-gqa"]}
    calls = tune_buckets.block_calls(shapes, "smoke-gqa", 1, 128, 1, 32, torch.device("cpu"), torch.float32)
    programs = {bound.program.name for _, bound in calls}
    assert {"rms_qkv_rope", "residual_rms_stats", "rms_gate_up_swiglu", "swiglu_backward", "rms_norm_backward",
            "weight_grad", "input_grad", "rms_linear"} <= programs  # the step's LM head: rms_linear + CE
    assert {name.split()[0] for name, _ in calls} == {"smoke-gqa", "smoke-gqa-x1"}
    assert all(bound.m > 0 and bound.a.device.type == "cpu" for _, bound in calls)
    assert "run" not in vars(backend) and backend.autotune is None


def test_kernel_bench_times_in_rounds_and_records_failures():
    """``codagen bench kernels``' per-case timing, on CPU (wall-clock, interpreter): every provider is
    timed in each round and reported as the median of its round medians; a provider that cannot run
    is recorded with its error while the others still run."""
    import statistics

    from codagen.backends.triton import TritonBackend
    from codagen.bench import kernels
    torch.manual_seed(0)
    model = kernels.Model("tiny", 64, 128, 2, 1, head_dim=16)
    case = next(c for c in kernels.kernel_cases(model, m=48, vocab=256) if c.name == "o_proj_residual_rms")
    logs = []
    records = kernels.run_case(case, model, torch.float32, ["cublas_gemm", "eager", "codagen", "nonsense"],
                               TritonBackend(), warmup_ms=0, rep_ms=0, rounds=2, device="cpu", log=logs.append)
    by_provider = {r["provider"]: r for r in records}
    assert set(by_provider) == {"cublas_gemm", "eager", "codagen", "nonsense"}
    for provider in ("cublas_gemm", "eager", "codagen"):
        r = by_provider[provider]
        assert len(r["round_ms"]) == 2 and r["median_ms"] == statistics.median(r["round_ms"]) > 0
    assert by_provider["codagen"]["config"]
    assert by_provider["nonsense"]["median_ms"] is None and "unknown provider" in by_provider["nonsense"]["error"]
    assert any("nonsense" in line for line in logs)


def test_timed_rounds_rotate_the_order_and_drop_what_fails():
    from codagen.bench.common import timed_rounds
    calls = []

    def timer(name):
        calls.append(name)
        if name == "c" and calls.count("c") == 2:
            raise RuntimeError("out of resources")
        return float(len(calls))
    errors = []
    times = timed_rounds({n: n for n in "abc"}, 3, timer, on_error=lambda name, error: errors.append(name))
    assert calls == ["a", "b", "c", "b", "c", "a"] + ["a", "b"]  # round 3 starts at c, which is gone
    assert times == {"a": [1.0, 6.0, 7.0], "b": [2.0, 4.0, 8.0]} and errors == ["c"]
    def failing_timer(name):
        if name == "b":
            raise RuntimeError("out of resources")
        return 1.0
    with pytest.raises(RuntimeError, match="out of resources"):  # without on_error the failure propagates
        timed_rounds({n: n for n in "abc"}, 2, failing_timer)


def test_ratio_records_take_each_median_over_the_references(capsys):
    from codagen.bench.common import ratio_records
    records = ratio_records("suite", "shape", {"line": [3.0, 1.0, 2.0], "fused": [4.0, 6.0, 5.0]}, "line")
    assert [(r["provider"], r["median_ms"], r["vs_line"]) for r in records] == [("line", 2.0, 1.0),
                                                                                 ("fused", 5.0, 2.5)]
    assert records[1]["round_ms"] == [4.0, 6.0, 5.0] and records[1]["suite"] == "suite"
    assert "2.500x line" in capsys.readouterr().out


def test_load_module_imports_a_saved_copy_as_a_sibling(tmp_path):
    """A saved module with relative imports loads beside today's under the name given."""
    import sys

    from codagen.bench.common import load_module
    path = tmp_path / "saved.py"
    path.write_text("from .layouts import kv_heads_of\nANSWER = kv_heads_of(48, 8, 4)\n")
    module = load_module("codagen.ops.saved_for_test", path)
    try:
        assert module.ANSWER == 1 and sys.modules["codagen.ops.saved_for_test"] is module
    finally:
        del sys.modules["codagen.ops.saved_for_test"]


def test_checkpoint_bench_smoke(tmp_path):
    from codagen.bench import checkpoint
    variants = ["hf+checkpoint", "codagen+keep_attention"]
    assert checkpoint.main(["--smoke", "--steps", "1", "--variants", *variants, "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-checkpoint.json")
    records = json.loads(path.read_text())["records"]
    assert [r["variant"] for r in records] == variants
    assert all(r["median_ms"] > 0 for r in records), [r.get("traceback") for r in records]


def test_tune_presets_carry_the_published_norm_eps():
    """Llama 3's config.json sets rms_norm_eps 1e-5 and Qwen3's 1e-6; transformers' LlamaConfig defaults to 1e-6."""
    pytest.importorskip("transformers")
    from codagen.tune import PRESETS, model_config
    for name in PRESETS:
        expected = 1e-5 if name.startswith("llama3") else 1e-6 if name.startswith("qwen3") else None
        if expected is not None:
            assert model_config(name, 1).rms_norm_eps == expected, name


def test_models_bench_smoke_runs_the_fp8_recipe(tmp_path, capsys):
    """``codagen bench models --smoke`` with codagen's FP8 provider (bf16 whatever the smoke dtype) beside the bf16
    one: both time a step, and the table gets the FP8 columns (torchao's provider records its error where torchao
    does not import)."""
    import json

    from codagen.bench import models
    assert models.main(["--smoke", "--providers", "codagen", "codagen_fp8", "torchao_fp8", "--out",
                        str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-models-full.json")
    records = {r["provider"]: r for r in json.loads(path.read_text())["records"]}
    assert records["codagen"]["median_ms"] and records["codagen_fp8"]["median_ms"]
    assert records["codagen_fp8"]["losses"] != records["codagen"]["losses"]
    assert "codagen fp8 / torchao fp8" in capsys.readouterr().out
