"""The identifiers of a program's input and output tensors inside its generated kernels.

Each input and output becomes kernel variables named after it (``rstd``, ``rstd_ptr``, ``normed_desc``,
...), so a generated kernel reads like the program. A name the generators use for their own variables
would shadow one, so such a name is mangled: it gets the prefix :data:`PREFIX` (again, until it is free:
``rows`` -> ``_rows``), and the kernel uses the mangled name throughout. Names that do not collide stay as
they are, so the generated sources of the library programs carry the program's own names.
"""
from __future__ import annotations

import re
import types
from collections.abc import Mapping

from codagen.epilogue.ir import Program

__all__ = ["RESERVED_NAMES", "TEMPORARY", "PREFIX", "kernel_names", "kernel_program"]

#: identifiers the generated kernels use for their own variables and helpers in the scopes where a
#: program's input and output names become variables (``tests/backends/test_triton.py`` checks the list
#: against the generated sources of both schedules)
RESERVED_NAMES = frozenset("""
    a b a2 b2 acc bar cast_for_store col0 col_ok col_ok_b col_ok_double col_ok_half cols cols_b cols_double
    cols_half column_halves column_pieces cos_sin empty fence_async_shared float gl gluon input_bars
    first_k first_pid_m first_pid_n input_bars_0 input_bars_1 iteration k_ok k_tiles_per_split lines low_rank_steps
    offsets ok part partial_ptr prefetch_weight_rows split arrivals_ptr last_to_arrive
    work_id off_r offs_r r_ok r_tile k_steps k_tile k_tiles local
    mainloop mbarrier
    merge_logsumexp my_tiles next_vectors num_pid_m num_pid_n num_tiles off_k off_m off_n offs_k
    partial_offsets pid_m pid_n piece pieces probe_even probe_odd producer range ready row_layout row_ok
    row_ok_P row_ok_H row_ok_a rows rows_64 rows_a sigmoid slot slot_index stamp stamp_slot stamping
    tile_coords tile_id tile_index tile_ok tile_ok_double tile_ok_half timeline_ptr tl tma triton turn vectors
    BK BLOCK_K BLOCK_M BLOCK_N BLOCK_R BM BN B_NK DOT_PRECISION EPILOGUE_SPLIT FLATTEN GROUP_M H PORTABLE
    IN_SLOTS J K M N OUT_BUFFERS P PDL PIECES PREFETCH_K R PIECE_N RING SPLIT_K SUB_N TIMELINE_TILES TMA_EPILOGUE
    TMA_MAINLOOP
    UPCAST_OPERANDS WHICH
    """.split())

#: the generators' numbered temporaries: ``<stem>_<number>`` with a lower-case stem, and names derived
#: from one (``v_3_even``)
TEMPORARY = re.compile(r"[a-z][a-z_]*?_\d+(_\w+)?")

#: what a colliding name is prefixed with: no reserved name or temporary starts with it
PREFIX = "_"


def _taken(name: str) -> bool:
    return name in RESERVED_NAMES or TEMPORARY.fullmatch(name) is not None


def kernel_names(program: Program) -> Mapping[str, str]:
    """Input/output name -> its identifier in the generated kernels (the name itself unless it collides
    with the generators' own identifiers or, once mangled, with another of the program's names)."""
    names = list(program.inputs) + [o.name for o in program.outputs]
    chosen: dict[str, str] = {}
    used = {name for name in names if not _taken(name)}
    for name in names:
        ident = name
        while _taken(ident) or (ident != name and ident in used):
            ident = PREFIX + ident
        used.add(ident)
        chosen[name] = ident
    return types.MappingProxyType(chosen)


def kernel_program(program: Program) -> Program:
    """``program`` with its inputs and outputs renamed to their kernel identifiers (itself when none
    collides): what the generators emit code for."""
    names = kernel_names(program)
    if all(name == ident for name, ident in names.items()):
        return program
    return program.renamed(names)
