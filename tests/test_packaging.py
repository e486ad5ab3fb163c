"""What an installed codagen carries and what ``import codagen`` costs: the wheel built from the checkout
holds the tuning table and loads it, ``import codagen`` leaves FSDP, DTensor, Dynamo, transformers and
PEFT out, and each optional dependency's absence or wrong version is named with its fix."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: every file the code reads at run time that is not a Python module
PACKAGE_DATA = ["codagen/backends/triton/tuned.json"]


def python(code: str, cwd: Path, path: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter started in ``cwd``, ``path`` (else nothing) as its PYTHONPATH."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    if path is not None:
        env["PYTHONPATH"] = str(path)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_wheel_ships_and_loads_the_tuning_table(tmp_path):
    """A wheel built from a copy of the checkout, installed into an empty folder and imported from there
    (not from the checkout) has the shipped tuning table and reads its entries."""
    source = tmp_path / "source"  # a copy: a build writes build/ and *.egg-info/ beside its sources
    shutil.copytree(ROOT / "codagen", source / "codagen", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("codagen-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert set(PACKAGE_DATA) <= names, sorted(n for n in names if not n.endswith(".py"))
    sources = {p.relative_to(source).as_posix() for p in (source / "codagen").rglob("*") if p.is_file()}
    assert sources - names == set()  # every module and data file of the package, none left behind

    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                              "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    run = python("import json, warnings\n"
                 "warnings.simplefilter('error')\n"  # a missing table warns: here that fails the run
                 "import codagen\n"
                 "from codagen.backends.triton.configs import TuningCache\n"
                 "cache = TuningCache(path='no-user-cache.json')\n"
                 "print(json.dumps({'file': codagen.__file__, 'shipped': str(cache.SHIPPED),\n"
                 "                  'entries': sum(1 for key in cache._load())}))", cwd=tmp_path, path=site)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.splitlines()[-1])
    assert Path(report["file"]).is_relative_to(site) and Path(report["shipped"]).is_relative_to(site), report
    assert report["entries"] == len(json.loads((ROOT / PACKAGE_DATA[0]).read_text())) > 0


def test_missing_shipped_table_warns_once(tmp_path, monkeypatch):
    from codagen.backends.triton import configs
    monkeypatch.setattr(configs.TuningCache, "SHIPPED", tmp_path / "tuned.json")
    monkeypatch.setattr(configs, "_warned_missing_table", False)
    with pytest.warns(UserWarning, match=r"tuned\.json.*untimed"):
        assert configs.TuningCache(path=tmp_path / "user.json")._load() == {}
    with warnings.catch_warnings(record=True) as second:
        warnings.simplefilter("always")
        assert configs.TuningCache(path=tmp_path / "user.json")._load() == {}
    assert [str(w.message) for w in second] == []


#: what ``import codagen`` must not import (each is absent after ``import torch`` alone: checked below)
HEAVY = ["torch.distributed.fsdp", "torch.distributed.tensor", "torch._dynamo", "torch._inductor", "transformers",
         "peft"]


def test_import_codagen_leaves_heavy_modules_out(tmp_path):
    probe = ("import sys, json\nimport {}\n"
             "print(json.dumps([m for m in {!r} if m in sys.modules]))")
    torch_alone = python(probe.format("torch", HEAVY), cwd=tmp_path, path=ROOT)
    assert torch_alone.returncode == 0 and json.loads(torch_alone.stdout) == [], torch_alone.stderr
    codagen_ = python(probe.format("codagen", HEAVY), cwd=tmp_path, path=ROOT)
    assert codagen_.returncode == 0, codagen_.stderr
    assert json.loads(codagen_.stdout) == []


def test_patch_resolves_on_first_use(tmp_path):
    run = python("import sys, codagen\n"
                 "assert 'codagen.models.hf' not in sys.modules\n"
                 "from codagen.models import hf\n"
                 "assert codagen.patch is hf.patch and codagen.unpatch is hf.unpatch\n"
                 "assert codagen.is_patched is hf.is_patched\n"
                 "from codagen import patch\n"
                 "from codagen.models import is_patched\n"
                 "assert patch is hf.patch and is_patched is hf.is_patched\n"
                 "assert codagen.models.Llama is sys.modules['codagen.models.llama'].Llama\n"
                 "assert codagen.ops is sys.modules['codagen.ops']\n"
                 "try:\n"
                 "    codagen.no_such_name\n"
                 "except AttributeError as error:\n"
                 "    assert 'no_such_name' in str(error)\n"
                 "else:\n"
                 "    raise AssertionError('no AttributeError')\n", cwd=tmp_path, path=ROOT)
    assert run.returncode == 0, run.stderr


def _linear_on_the_interpreter():
    import torch

    import codagen
    a, b = torch.randn(16, 32), torch.randn(16, 32)  # y = a @ b.T on CPU tensors: the Triton interpreter
    return codagen.execute(codagen.library.linear(), a, b, backend="triton")


@pytest.mark.parametrize("version", ["2.3.0", "2.4.1", "3.0.0rc1"])
def test_interpreter_refuses_numpy_it_breaks_on(monkeypatch, version):
    numpy = pytest.importorskip("numpy")
    pytest.importorskip("triton")
    monkeypatch.setattr(numpy, "__version__", version)
    with pytest.raises(RuntimeError, match=rf'needs numpy < 2\.3, but numpy {re.escape(version)} is installed: '
                                           r'pip install "numpy<2\.3".*\.\[interpret\]'):
        _linear_on_the_interpreter()


def test_interpreter_runs_on_numpy_below_2_3(monkeypatch):
    numpy = pytest.importorskip("numpy")
    pytest.importorskip("triton")
    monkeypatch.setattr(numpy, "__version__", "2.2.6")
    assert _linear_on_the_interpreter()["out"].shape == (16, 16)


def test_numpy_only_for_the_interpreter(tmp_path):
    """Without numpy codagen imports (a GPU needs none) and a CPU launch of the Triton backend names the fix."""
    pytest.importorskip("triton")
    run = python("import sys, warnings\n"
                 "sys.modules['numpy'] = None\n"
                 "warnings.simplefilter('ignore')\n"  # torch: 'Failed to initialize NumPy'
                 "import torch, codagen\n"
                 "try:\n"
                 "    codagen.execute(codagen.library.linear(), torch.randn(16, 32), torch.randn(16, 32),"
                 " backend='triton')\n"
                 "except RuntimeError as error:\n"
                 "    print(error)\n", cwd=tmp_path, path=ROOT)
    assert run.returncode == 0, run.stderr
    assert 'numpy is not installed: pip install "numpy<2.3"' in run.stdout, run.stdout


def test_patch_without_transformers_names_the_extra(tmp_path):
    run = python("import sys, torch\n"
                 "sys.modules['transformers'] = None\n"
                 "import codagen\n"
                 "try:\n"
                 "    codagen.patch(torch.nn.Linear(4, 4))\n"
                 "except ImportError as error:\n"
                 "    print(type(error).__name__, error)\n", cwd=tmp_path, path=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith('ImportError codagen.patch') and 'pip install -e ".[hf]"' in run.stdout, run.stdout


def test_readme_installs_from_the_checkout_with_extras_that_exist():
    """codagen is not on PyPI: every ``pip install`` of codagen in the README installs the checkout, and
    every extra it names is one of pyproject.toml's."""
    tomllib = pytest.importorskip("tomllib")
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    lines = [line.split("#")[0].strip() for line in (ROOT / "README.md").read_text().splitlines()
             if line.strip().startswith("pip install")]
    assert lines
    for line in lines:
        match = re.fullmatch(r'pip install -e (?:\.|"\.\[([\w,]+)\]")', line)
        assert match is not None, f"README: {line!r} does not install from the checkout (pip install -e \".[...]\")"
        assert set(filter(None, (match.group(1) or "").split(","))) <= extras, line
    assert 'pip install -e ".[hf]"' in lines and 'pip install -e ".[torchtitan]"' in lines


def test_hf_extra_installs_what_the_trainer_needs():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    accelerate = [r for r in extras["test"] if r.startswith("accelerate")]
    assert accelerate and [r for r in extras["hf"] if r.startswith("accelerate")] == accelerate
    assert not any(r.startswith("numpy") for r in tomllib.loads((ROOT / "pyproject.toml").read_text())
                   ["project"]["dependencies"])
    assert "numpy<2.3" in extras["interpret"] and "numpy<2.3" in extras["test"]
