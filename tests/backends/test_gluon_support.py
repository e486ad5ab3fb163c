"""Which Triton releases get the Gluon ping-pong schedule (codagen.backends.triton.gluon_support), with the
installed version monkeypatched: both ends of the range, a build missing a Gluon name, and what tuning, a
forced ping-pong configuration and the module import do on an unsupported release."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402

from codagen.backends.triton import TritonBackend, gluon_support  # noqa: E402
from codagen.backends.triton.configs import PINGPONG, candidates  # noqa: E402
from codagen.bench.kernels import random_inputs  # noqa: E402
from codagen.epilogue import ProgramError, bind, library  # noqa: E402


@pytest.fixture
def triton_version(monkeypatch):
    """Set the installed Triton's version string; the cached check and the one-time warning start fresh."""
    def set_version(version: str):
        monkeypatch.setattr(triton, "__version__", version)
        gluon_support._installed_unsupported.cache_clear()
        monkeypatch.setattr(gluon_support, "_warned", False)
    yield set_version
    gluon_support._installed_unsupported.cache_clear()


@pytest.mark.parametrize("version", ["3.6.0", "3.6.1", "3.6.0+git4a1b2c3"])
def test_supported_releases(version):
    assert gluon_support.pingpong_unsupported(version) is None


@pytest.mark.parametrize("version", ["3.5.1", "3.4.0", "3.7.0", "4.0.0", "2.3.1", "nightly"])
def test_unsupported_releases_are_named(version):
    reason = gluon_support.pingpong_unsupported(version)
    assert reason is not None and f"Triton {version} is installed" in reason and ">= 3.6, < 3.7" in reason


def _sm90_candidates():
    return candidates(library.rms_norm_backward(), target="sm_90", operand_bytes=2, smem_limit=232448, tma=True,
                      tma_epilogue=True)


def test_installed_release_offers_the_pingpong_schedule(triton_version):
    triton_version("3.6.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert any(cfg.schedule == "pingpong" for cfg in _sm90_candidates())


@pytest.mark.parametrize("version", ["3.5.0", "3.7.0"], ids=["below", "above"])
def test_unsupported_release_tunes_persistent_kernels_with_one_warning(triton_version, version):
    triton_version(version)
    with pytest.warns(UserWarning, match=rf"Triton {version} is installed.*persistent kernels only"):
        pool = _sm90_candidates()
    assert pool and all(cfg.schedule == "persistent" for cfg in pool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert _sm90_candidates() == pool


def test_unsupported_release_refuses_a_forced_pingpong_config(triton_version):
    triton_version("3.7.0")
    program = library.linear()
    a, b, tensors = random_inputs(program, 8, 16, 16, torch.float16, "cpu")
    with pytest.raises(ProgramError, match=r"linear: the Gluon ping-pong kernels need Triton >= 3.6, < 3.7.*3\.7\.0"):
        TritonBackend(config=PINGPONG[0]).run(bind(program, a, b, tensors))


def test_a_build_missing_a_gluon_name_is_refused_naming_it(triton_version, monkeypatch):
    from triton.experimental.gluon import language as gl
    triton_version("3.6.0")
    monkeypatch.delattr(gl, "warp_specialize")
    reason = gluon_support.pingpong_unsupported()
    assert reason == ("Triton 3.6.0 lacks the Gluon names the ping-pong kernels use: "
                      "triton.experimental.gluon.language.warp_specialize")


def test_importing_the_pingpong_runtime_on_an_unsupported_release_raises_import_error():
    """The schedule's package imports (its plan and generator are plain Python) without its runtime."""
    script = ("import triton; triton.__version__ = '3.5.0'\n"
              "from codagen.backends.triton import pingpong\n"
              "assert not pingpong.RUNTIME and not hasattr(pingpong, 'launch')\n"
              "try:\n    import codagen.backends.triton.pingpong.runtime\n"
              "except ImportError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.stdout.strip() == ("codagen.backends.triton.pingpong.runtime: the Gluon ping-pong kernels need "
                                     "Triton >= 3.6, < 3.7 (Gluon's API changes between minor releases); "
                                     "Triton 3.5.0 is installed"), result.stdout + result.stderr
