"""Which launches are programmatic dependents: the decode-sized GEMMs and their finishers on sm_90+.

A decode step is a chain of short kernels, each reading a weight once: at batch 1 a 4096 x 4096 GEMM
streams its 33 MB in about 10 us, and a kernel's first and last microseconds (programs starting, the
first loads in flight, the last programs draining) stream less. With programmatic dependent launch
(``launch_pdl=True``, CUDA's ``PROGRAMMATIC_STREAM_SERIALIZATION``) the next kernel launches while the
current one runs: its programs take the SMs the current kernel's programs leave, bring their first
weight tile into L2, and wait (``gdc_wait``) until every earlier kernel has finished and its writes are
visible. The device code is in :mod:`.persistent.runtime` and the finisher of
:mod:`codagen.ops.kernels.finish`.

Every such kernel calls ``gdc_launch_dependents`` as it starts, which lets the next kernel launch, and
``gdc_wait`` before it writes anything or reads anything but its weight. So a kernel that started early
still runs after all of its predecessors: the one before it finished only after its own wait, and so on
down the stream. A kernel launched without the attribute (attention, PyTorch's kernels) waits for the
one before it as usual.

``CODAGEN_DEPENDENT_LAUNCH=0`` (read at import) launches every kernel in plain stream order.
"""
from __future__ import annotations

import torch

from codagen.backends.device import capability

from .configs import SMALL_M_ROWS
from .switches import env_flag

__all__ = ["enabled", "launch_options", "DEPENDENT_LAUNCH_ROWS", "PREFETCH_K"]

#: rows (the decode batch) up to which GEMMs and finishers launch as programmatic dependents; 0: none
DEPENDENT_LAUNCH_ROWS = SMALL_M_ROWS if env_flag("CODAGEN_DEPENDENT_LAUNCH", default=True) else 0
#: K columns of its first tile's weight rows a dependent GEMM prefetches into L2 before it waits (0: none; a power
#: of two >= 64): docs/notes/decode-weight-prefetch.md
PREFETCH_K = 256


def enabled(rows: int, device: torch.device) -> bool:
    """Whether a kernel over ``rows`` rows on ``device`` launches as a programmatic dependent (NVIDIA sm_90+; a ROCm
    GPU reports a capability of its own, 9.4 on MI300)."""
    return (rows <= DEPENDENT_LAUNCH_ROWS and device.type == "cuda" and torch.version.hip is None
            and capability(device)[0] >= 9)


def launch_options(pdl: bool) -> dict:
    """A kernel launch's arguments for it: the kernel's ``PDL`` constexpr and, when set, Triton's ``launch_pdl``."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
