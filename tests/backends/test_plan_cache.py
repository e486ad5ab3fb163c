"""The Triton backend remembers each call signature's kernel and config; a new signature gets its own."""
import pytest
import torch

pytest.importorskip("triton")

from codagen.backends.reference import ReferenceBackend  # noqa: E402
from codagen.backends.triton import TritonBackend  # noqa: E402
from codagen.epilogue import bind, library  # noqa: E402


def test_each_call_signature_gets_its_own_plan():
    backend = TritonBackend(autotune=False)
    program = library.residual_rms_stats()
    calls = [(5, 6, 8), (9, 10, 8), (5, 6, 8)]          # a repeat of the first signature last
    for m, n, k in calls:
        a, b = torch.randn(m, k), torch.randn(n, k)
        tensors = dict(residual=torch.randn(m, n), norm_weight=torch.randn(n))
        got = backend.run(bind(program, a, b, tensors))
        want = ReferenceBackend().run(bind(program, a, b, tensors))
        torch.testing.assert_close(got["residual_out"], want["residual_out"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["partial_sumsq"].sum(1), want["partial_sumsq"].sum(1), rtol=1e-5, atol=1e-4)
    assert len(backend._plans) == 2

    # a misaligned operand (a view starting one element in) takes the pointer path: a new plan
    m, n, k = 5, 6, 8
    a = torch.randn(m * k + 1)[1:].view(m, k)
    b = torch.randn(n, k)
    tensors = dict(residual=torch.randn(m, n), norm_weight=torch.randn(n))
    got = backend.run(bind(program, a, b, tensors))
    want = ReferenceBackend().run(bind(program, a, b, tensors))
    torch.testing.assert_close(got["normed"], want["normed"], rtol=1e-5, atol=1e-5)
    assert len(backend._plans) == 3
