"""Reading a compiled kernel's SASS (diagnostics for tests and ``bench/``; no GPU needed).

``cuobjdump``, which Triton ships, disassembles a cubin compiled for any architecture, so what ptxas made
of a kernel can be checked on a CPU machine.
"""
from __future__ import annotations

import re
import subprocess
import tempfile

__all__ = ["instructions", "arithmetic_before_handoff", "HANDOFF_LIMIT"]

#: floating-point instructions a consumer may run between its last wgmma wait and its turn hand-off: a few
#: hundred cycles, against a mainloop of ~20000 (K = 2048)
HANDOFF_LIMIT = 128

_INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/")
_ARITHMETIC = re.compile(r"\b(FMUL|FFMA|FADD|MUFU|SHFL|FMNMX|FSETP)\b")


def instructions(cubin: bytes) -> list[str]:
    """The cubin's SASS, one line per instruction."""
    import triton
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    return [line for line in text.splitlines() if _INSTRUCTION.match(line)]


def arithmetic_before_handoff(sass: list[str]) -> list[int]:
    """For each consumer of a ping-pong kernel (:func:`.pingpong.mainloop`): the floating-point
    instructions ptxas scheduled between the mainloop's final wgmma wait (``WARPGROUP.DEPBAR.LE gsb0,
    0x0``) and the last ``SYNCS.ARRIVE`` before the consumer's next barrier wait (``SYNCS.PHASECHK``):
    the mainloop's last arrives free its ring slots and pass the turn, and epilogue arithmetic ahead of
    them delays the other consumer's mainloop. (Loads the epilogue requests for later pieces arrive on
    their barriers only after the piece's first wait, so they are not counted.)"""
    counts = []
    for i, line in enumerate(sass):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x0" not in line:
            continue
        arithmetic, before_last_arrive = 0, None
        for later in sass[i + 1:]:
            if "SYNCS.PHASECHK" in later:
                break
            if "SYNCS.ARRIVE" in later:
                before_last_arrive = arithmetic
            elif _ARITHMETIC.search(later):
                arithmetic += 1
        if before_last_arrive is not None:
            counts.append(before_last_arrive)
    return counts
