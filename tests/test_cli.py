"""The ``codagen`` command line: plain-text help for every command and suite, the documented spellings
accepted (presets in either spelling), bad arguments a one-line usage error naming the argument (exit 2),
never a traceback; results written under the current directory by default."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from codagen import __main__ as cli
from codagen import tune
from codagen._cli import plain_text, preset_name
from codagen.bench.common import RESULTS_DIR, write_results


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


#: RST in help text: ``literals``, :role:`targets`, `interpreted text`, directives, a literal block's "::",
#: escaped backslashes
RST_MARKUP = re.compile(r"``|:\w+:`|`[^`\s][^`]*`|^\s*\.\. [\w-]+::|\S::$|\\\\", re.MULTILINE)
HELP_ARGS = [["--help"], ["bench", "--help"], *([name, "--help"] for name in cli.COMMANDS),
             *(["bench", name, "--help"] for name in cli.BENCH_SUITES)]


@pytest.mark.parametrize("args", HELP_ARGS, ids=" ".join)
def test_help_exits_zero_without_rst_markup(capsys, args):
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert "usage: codagen" in out
    assert RST_MARKUP.findall(out) == []


def test_plain_text_drops_rst_markup():
    doc = ("Runs ``codagen tune`` (:func:`codagen.patch`, :class:`~codagen.models.Llama`, `text`); C:\\\\dir.\n\n"
           "Schema::\n\n    {\"env\"}\n\n.. code:: bash\n\n    codagen demo\n")
    text = plain_text(doc)
    assert RST_MARKUP.findall(text) == [] and RST_MARKUP.findall(doc)
    assert text.startswith("Runs codagen tune (codagen.patch, codagen.models.Llama, text); C:\\dir.")
    assert "Schema:\n\n    {\"env\"}" in text and "    codagen demo" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the parse on a machine without a GPU (no run)")
@pytest.mark.parametrize("args", [["bench", "kernels", "--models", "d2048,{}"], ["bench", "block", "--shapes", "{}"],
                                  ["bench", "block", "--model-shape", "{}"], ["bench", "lora", "--shapes", "{}"],
                                  ["bench", "generate", "--models", "{}"]], ids=" ".join)
def test_preset_names_in_either_spelling(capsys, args):
    """A preset is named llama3-8b everywhere; llama3_8b is read as the same name, a wrong one is refused
    naming the canonical spellings."""
    for spelling in ("llama3-8b", "llama3_8b", "LLAMA3_8B"):
        code, _, err = run(capsys, *(a.format(spelling) for a in args))
        assert code == 2 and "needs a CUDA GPU" in err and "error" not in err, (spelling, err)
    code, _, err = run(capsys, *(a.format("llama3-9b") for a in args))
    assert code == 2 and f"{args[2]}: expected one of" in err and "llama3-8b" in err and "'llama3-9b'" in err


def test_one_preset_spelling():
    from codagen.bench import block, generate, kernels, lora
    for names in (tune.PRESETS, kernels.MODELS, block.SHAPES, lora.SHAPES, generate.MODELS):
        assert all(preset_name(name) == name for name in names), list(names)
    assert tune.model_config("llama3_8b", 1).to_dict() == tune.model_config("llama3-8b", 1).to_dict()


def test_results_default_to_the_current_directory(tmp_path, monkeypatch):
    """Without --out a suite writes into codagen-results/ under the current directory: not into the
    installed package, nor the checkout's tracked bench/results."""
    monkeypatch.chdir(tmp_path)
    path = write_results("cli-test", [{"suite": "cli-test"}])
    assert path.resolve().parent == tmp_path / "codagen-results"
    assert json.loads(path.read_text())["records"] == [{"suite": "cli-test"}]
    assert not RESULTS_DIR.is_absolute()


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


def test_tune_model_config_json_trims_layer_types(tmp_path):
    """A published config.json (Qwen2/Qwen3 list ``layer_types`` per layer) builds with fewer layers: the list is
    trimmed with ``num_hidden_layers``."""
    pytest.importorskip("transformers")
    from codagen.bench.models import MODELS, hf_config
    fields = hf_config(MODELS["Qwen3-0.6B"]).to_dict()
    assert len(fields["layer_types"]) == 28
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    config = tune.model_config(str(path), 3)
    assert config.num_hidden_layers == 3 and config.layer_types == ["full_attention"] * 3
    assert config.vocab_size == 151936 and config.tie_word_embeddings


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
