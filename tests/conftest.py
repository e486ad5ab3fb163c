"""Shared test set-up: fresh random inputs for every test, GPU tests skipped without a GPU."""
import os

import pytest
import torch

# Every output a backend allocates starts as NaN, so an element a kernel forgets to write fails a test.
os.environ["CODAGEN_POISON_OUTPUTS"] = "1"
from codagen.epilogue.bind import set_poison_outputs  # noqa: E402

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
