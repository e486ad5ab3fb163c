"""The ``codagen`` command line: help for every command and suite, the documented spellings accepted,
bad arguments a one-line usage error naming the argument (exit 2), never a traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from codagen import __main__ as cli
from codagen import tune


def run(capsys, *args: str) -> tuple[int, str, str]:
    """``codagen <args>`` in this process: (exit status, stdout, stderr)."""
    try:
        code = cli.main(list(args))
    except SystemExit as exit_:  # argparse: --help, usage errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "codagen", "bench", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "kernels" in result.stdout and "block" in result.stdout, result.stderr


@pytest.mark.parametrize("args", [["--help"], ["bench", "--help"], ["bench", "kernels", "--help"],
                                  ["bench", "block", "--help"], ["demo", "--help"], ["tune", "--help"]])
def test_help_exits_zero_without_rst_markup(capsys, args):
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert "usage: codagen" in out
    assert "``" not in out and ":func:" not in out and ":class:" not in out


def test_every_command_and_suite_is_listed(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in [*cli.COMMANDS, "bench", *cli.BENCH_SUITES])
    assert cli.main(["bench"]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in cli.BENCH_SUITES)
    assert cli.main(["bench", "nope"]) == 2 and "unknown suite 'nope'" in capsys.readouterr().err
    assert cli.main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without a GPU")
def test_documented_arguments_accepted_and_bad_ones_named(capsys):
    code, _, err = run(capsys, "bench", "kernels", "--dtype", "bf16")  # the help's own example: parsed, needs a GPU
    assert code == 2 and "needs a CUDA GPU" in err and "invalid" not in err
    code, _, err = run(capsys, "bench", "kernels", "--dtype", "fp64")
    assert code == 2 and "argument --dtype" in err
    code, _, err = run(capsys, "demo", "--device", "cuda")
    (line,) = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and "--device" in line and "no CUDA GPU" in line and "--device cpu" in line
    code, _, err = run(capsys, "demo", "--device", "tpu0")
    assert code == 2 and "argument --device" in err
    code, _, err = run(capsys, "tune", "--model", "llama3-8b", "--tokens", "4096")
    assert code == 2 and "needs a CUDA GPU" in err
    code, _, err = run(capsys, "tune", "--model", "no-such-model", "--tokens", "4096")
    assert code == 2 and "--model" in err and "preset" in err


def test_tune_presets_and_steps(capsys):
    """Every preset builds a config with the layers asked for; the tuning loop runs a patched model's
    training step per token count and reports its new kernel keys (CPU: the interpreter, which times
    nothing)."""
    for name in tune.PRESETS:
        config = tune.model_config(name, 2)
        assert config.num_hidden_layers == 2 and config.hidden_size >= 2048
    from codagen.backends import get_backend
    from codagen.models import patch
    transformers = pytest.importorskip("transformers")
    config = tune.model_config("d2048", 1)
    config.update(dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, vocab_size=64))
    model = patch(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    backend = get_backend("triton")
    steps = tune.tune_steps(model, [8, 16], 8, backend)
    assert [s["tokens"] for s in steps] == [8, 16] and all(s["timed"] == 0 for s in steps)
    assert backend.autotune is None  # restored
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert lines[0].startswith("[1/2] 8 tokens:") and lines[1].startswith("[2/2] 16 tokens:")
    assert all(p.grad is None for p in model.parameters())
