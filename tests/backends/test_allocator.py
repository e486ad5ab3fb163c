"""Device-side TMA descriptors need Triton's scratch allocator in whichever thread launches.

Triton keeps it in a ContextVar; autograd's backward runs on other threads, which start without it.
"""
import threading

import pytest

triton = pytest.importorskip("triton")
from triton.runtime import _allocation  # noqa: E402

from codagen.backends.triton import backend  # noqa: E402


def test_allocator_is_set_in_every_launching_thread():
    seen = {}

    def launching_thread():
        seen["before"] = _allocation._allocator.get()
        backend._set_allocator()
        seen["after"] = _allocation._allocator.get()

    worker = threading.Thread(target=launching_thread)
    worker.start()
    worker.join()
    assert seen["before"] is not backend._scratch_alloc      # a new thread starts without it ...
    assert seen["after"] is backend._scratch_alloc           # ... and the launch path sets it there
