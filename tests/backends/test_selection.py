"""Backend selection: argument, set_backend/use_backend, CODAGEN_BACKEND, auto."""
import pytest
import torch

import codagen
from codagen.backends import resolve_backend_name, triton_available, use_backend

cpu = torch.device("cpu")


def test_auto_is_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("CODAGEN_BACKEND", raising=False)
    assert resolve_backend_name(cpu) == "reference"
    expected = "triton" if triton_available() else "reference"
    assert resolve_backend_name(torch.device("cuda")) == expected


def test_environment_variable_argument_and_context(monkeypatch):
    monkeypatch.setenv("CODAGEN_BACKEND", "reference")
    assert resolve_backend_name(torch.device("cuda")) == "reference"
    monkeypatch.setenv("CODAGEN_BACKEND", "Auto ")
    assert resolve_backend_name(cpu) == "reference"
    with use_backend("reference"):
        monkeypatch.setenv("CODAGEN_BACKEND", "auto")
        assert resolve_backend_name(torch.device("cuda")) == "reference"   # set_backend wins over the variable
    assert resolve_backend_name(cpu, "reference") == "reference"


def test_unknown_names_are_refused(monkeypatch):
    monkeypatch.setenv("CODAGEN_BACKEND", "cutlass")
    with pytest.raises(ValueError, match=r"CODAGEN_BACKEND: unknown backend 'cutlass'; expected one of"):
        resolve_backend_name(cpu)
    with pytest.raises(ValueError, match=r"set_backend: unknown backend 'tpu'"):
        codagen.set_backend("tpu")
    with pytest.raises(ValueError, match=r"backend argument: unknown backend 'fast'"):
        resolve_backend_name(cpu, "fast")
