"""The timeline variant of a ping-pong kernel (measurement only, ``bench/pingpong_timeline.py``).

The kernel takes a ``timeline_ptr`` after ``K`` and CTA 0's consumers write four ``%globaltimer`` stamps
for each of their first ``TIMELINE_TILES`` tiles into it (int64 [2, TIMELINE_TILES, 4]): tile start,
turn taken, mainloop done, epilogue done. The stamps' branches also change how ptxas may schedule across
them (see the script). :data:`OFF` is the production kernel's: no stamps.
"""
from __future__ import annotations

__all__ = ["Stamps", "OFF", "ON"]


class Stamps:
    """What the generator adds at each point of a consumer's tile, and to the kernel's parameters."""

    def __init__(self, on: bool):
        self.on = on
        #: parameters after ``M, N, K`` (kernel and consumers)
        self.params = ["timeline_ptr"] if on else []

    def tile_start(self, before_mainloop: list[str]) -> list[str]:
        """A tile's lines before its mainloop, with the tile-start and turn-taken stamps around them (the
        turn is waited for here to stamp it; the mainloop's own wait then passes at once)."""
        if not self.on:
            return before_mainloop
        return (["stamping = (gl.program_id(0) == 0) & (local // 2 < TIMELINE_TILES)",
                 "stamp_slot = (WHICH * TIMELINE_TILES + local // 2) * 4",
                 "if stamping:", "    stamp(timeline_ptr + stamp_slot, local)"] + before_mainloop
                + ["mbarrier.wait(turn.index(WHICH), (local // 2) & 1)",
                   "if stamping:", "    stamp(timeline_ptr + stamp_slot + 1, local)"])

    def stamp(self, index: int) -> list[str]:
        """Stamp ``index`` (2: mainloop done, 3: epilogue done)."""
        return ["if stamping:", f"    stamp(timeline_ptr + stamp_slot + {index}, local)"] if self.on else []

    def functions(self) -> str:
        """Module-level code the stamps use."""
        return """

TIMELINE_TILES = gl.constexpr(64)


@gluon.jit
def stamp(address, dep):
    \"\"\"(timeline) %globaltimer, in ns, to ``address``; ``dep`` (any int32) orders the read.\"\"\"
    now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [dep], dtype=gl.int64,
                                    is_pure=False, pack=1)
    gl.store(address, now)
""" if self.on else ""


OFF, ON = Stamps(False), Stamps(True)
