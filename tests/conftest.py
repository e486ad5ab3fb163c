"""Shared test set-up: fresh random inputs for every test, GPU tests skipped without a GPU."""
import os

import pytest
import torch

# Every output a backend allocates starts as NaN, so an element a kernel forgets to write fails a test.
os.environ["CODAGEN_POISON_OUTPUTS"] = "1"
from codagen.epilogue.bind import set_poison_outputs  # noqa: E402
from codagen.epilogue.ir import ColPartial, Program, QuantizedStore, RowPartial  # noqa: E402

set_poison_outputs(True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Seed torch from the OS for every test (fresh inputs each run); the seed is shown on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        seeds = [v for k, v in item.user_properties if k == "seed"]
        if seeds:
            report.sections.append(("seed", f"torch.manual_seed({seeds[0]}) reproduces this test's inputs"))


def decoded(codes: torch.Tensor, scale: torch.Tensor, group: int, along: str) -> torch.Tensor:
    """e4m3 ``codes`` [M, K] times their ``scale`` per group of ``group`` ``along`` ``"n"`` (columns), ``"m"``
    (rows) or ``"blocks"``, in float64."""
    rows, cols = {"n": (1, group), "m": (group, 1), "blocks": (group, group)}[along]
    m, k = codes.shape
    expanded = scale.double().repeat_interleave(rows, 0)[:m].repeat_interleave(cols, 1)[:, :k]
    return codes.double() * expanded


def finished(program: Program, outs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A program's outputs as float64, partials reduced over their tile axis (any tile count), quantized stores
    decoded."""
    done = {}
    for o in program.outputs:
        if isinstance(o, QuantizedStore):
            done[o.name] = decoded(outs[o.name], outs[o.scale], o.group, o.along)
            continue
        v = outs[o.name].double()
        if isinstance(o, RowPartial):
            v = v.sum(-1) if o.reduction == "sum" else torch.logsumexp(v, -1)
        elif isinstance(o, ColPartial):
            v = v.sum(0)
        done[o.name] = v
    return done
