"""Fixtures of the backend tests: a private kernel cache, the numerics check every kernel test uses, and
LLaMA-3 RoPE inputs."""
from __future__ import annotations

import tempfile

import pytest
import torch

from codagen.backends.reference import ReferenceBackend
from codagen.backends.triton import TritonBackend
from codagen.bench.kernels import eager_epilogue, gemm, random_inputs
from codagen.epilogue.bind import bind
from codagen.epilogue.ir import Program, Store

from ..conftest import finished


@pytest.fixture(scope="module", autouse=True)
def kernel_cache_dir():
    """Generated sources and tuning results go to a fresh directory, not the user's cache."""
    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        mp.setenv("CODAGEN_CACHE_DIR", d)
        yield d


def _clone(tensors):
    return {k: v.clone() for k, v in tensors.items()}


def _check(program: Program, m: int, n: int, k: int, dtype: torch.dtype, device="cpu",
          backend: TritonBackend | None = None, inputs: dict | None = None) -> dict[str, torch.Tensor]:
    """Run ``program`` on fresh random inputs with the Triton backend and apply the numerics rule.

    ``inputs`` maps input names to functions ``(m, device) -> tensor`` that replace the random ones."""
    backend = backend or TritonBackend(autotune=False)
    a, b, tensors = random_inputs(program, m, n, k, dtype, device)
    for name, make in (inputs or {}).items():
        tensors[name] = make(m, device)
    outs = backend.run(bind(program, a, b, _clone(tensors)))

    up = {name: (t.double() if t.dtype.is_floating_point else t) for name, t in tensors.items()}
    # exact: float64 all the way, stores not rounded to their dtypes
    unrounded = Program(program.name, program.gemm, tuple(
        Store(o.name, o.value, "input", o.accumulate) if isinstance(o, Store) else o for o in program.outputs))
    exact = finished(program, ReferenceBackend().run(bind(unrounded, a.double(), b.double(), up)))
    lowp_tensors = _clone(tensors)
    lowp = finished(program, eager_epilogue(program, gemm(program, a, b), lowp_tensors))
    got = finished(program, outs)
    for o in program.outputs:
        g, e, lo = got[o.name], exact[o.name], lowp[o.name]
        assert g.shape == e.shape, f"{o.name}: shape {tuple(g.shape)} != {tuple(e.shape)}"
        assert not torch.isnan(g).any(), f"{o.name}: NaN left (an element was not written)"
        err = (g - e).abs().max().item() if g.numel() else 0.0
        if dtype == torch.float32:
            bound = 1e-5 * max(1.0, e.abs().max().item() if e.numel() else 0.0)
        else:
            bound = 2 * ((lo.reshape(e.shape) - e).abs().max().item() if e.numel() else 0.0) + 1e-6
        assert err <= bound, f"{program.name}.{o.name} ({dtype}, M={m} N={n} K={k}): error {err:.3g} > {bound:.3g}"
    return outs


def _llama3_rope_inputs(n: int, positions_max: int = 16384):
    """Positions spread over [0, positions_max) and LLaMA-3 frequencies (base 500000, head dim 128):
    angles up to ~16384 rad, far outside the [-pi, pi] of the hardware sin/cos approximations."""
    def positions(m, device):
        return torch.linspace(0, positions_max - 1, m, device=device).round()

    def frequencies(m, device):
        return 500000.0 ** (-(torch.arange(n // 2, device=device) % 64).float() / 64)
    return {"positions": positions, "frequencies": frequencies}


@pytest.fixture
def check():
    """``check(program, m, n, k, dtype, device="cpu", backend=None, inputs=None)``: run ``program`` on
    fresh random inputs with the Triton backend and apply the numerics rule; returns the outputs."""
    return _check


@pytest.fixture
def llama3_rope_inputs():
    """``llama3_rope_inputs(n)``: ``check``'s ``inputs`` for long positions and LLaMA-3 frequencies."""
    return _llama3_rope_inputs
