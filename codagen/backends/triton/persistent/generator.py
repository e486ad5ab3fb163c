"""Epilogue program -> Triton source: one persistent GEMM kernel with the program in its epilogue.

The generated module holds ``@triton.jit`` functions at module level, so that Triton can resolve them
by name: the fixed helpers of :mod:`.runtime` (copied in: ``tile_coords``, the grouped, L2-friendly
order of output tiles; ``column_halves``; ``cast_for_store``; ``merge_logsumexp``) and two generated ones:

``<name>_epilogue``      the program, evaluated on one ``[BLOCK_M, SUB_N]`` accumulator sub-tile in
                         registers: vector and tile loads, elementwise and pair maps, stores, the
                         ColPartial sums, and the sub-tile's RowPartial pieces (returned);
``<name>_kernel``        the persistent GEMM: each program walks output tiles ``tile_id = pid,
                         pid + num_programs, ...``; per tile, a K loop of ``acc += A_tile @ B_tile``
                         (TMA tensor-descriptor loads, or masked pointer loads), then the epilogue on
                         ``EPILOGUE_SPLIT`` column halves of ``acc``, then the RowPartial stores;
``<name>_split_k_kernel``
                         the same GEMM with K cut in ``SPLIT_K`` ranges (decode shapes, programs
                         without a low-rank pair): partial tiles to fp32 scratch; the last split of
                         a tile to finish sums them in split order and runs the same epilogue.

With ``PDL`` (programmatic dependent launch, decode shapes: :mod:`..dependent_launch`) both kernels start
by letting the next kernel launch (``gdc_launch_dependents``) and wait for the earlier ones (``gdc_wait``)
before the first write or read of their outputs; in between they prefetch the first ``PREFETCH_K`` columns
of their first tile's weight rows into L2.

The mainloop is one fixed template; only the epilogue differs between programs. Every expression of
the program becomes one named variable, computed once (the IR's value equality already merges
common subexpressions; pair splits and sigmoids of one operand are shared as well).

Column bookkeeping. An accumulator sub-tile covers FULL-width columns ``[off_n, off_n + SUB_N)``. A
value of width HALF covers ``[off_n / 2, off_n / 2 + SUB_N / 2)`` of its own N/2 columns, DOUBLE
covers ``[2 off_n, 2 off_n + 2 SUB_N)`` of 2N: the same column pairs, so pair maps never straddle a
sub-tile (``SUB_N`` is even). A ``SegmentSum`` of size s needs ``SUB_N * w`` to be a multiple of s
(the configurations are filtered for it; the kernel checks it with ``tl.static_assert``). Rows past M
and columns past N*w are masked on every load and store and excluded from every reduction (``-inf`` for logsumexp).
"""
from __future__ import annotations

import textwrap

from codagen.epilogue.ir import ColPartial, Expr, Program, QuantizedStore, RowPartial, Store, Width

from ..emitter import Emitter, comment
from ..names import kernel_program
from . import runtime

__all__ = ["generate", "GENERATOR_VERSION"]

#: bump when the generated code changes meaning (it keys the on-disk source cache)
GENERATOR_VERSION = "6"

_WIDTH_SUFFIX = {Width.HALF: "_half", Width.FULL: "", Width.DOUBLE: "_double"}
# Triton expressions for a width's number of columns: of the matrix (N*w) and of a sub-tile (SUB_N*w)
_MATRIX_COLS = {Width.HALF: "(N // 2)", Width.FULL: "N", Width.DOUBLE: "(2 * N)"}
_TILE_COLS = {Width.HALF: "(SUB_N // 2)", Width.FULL: "SUB_N", Width.DOUBLE: "(2 * SUB_N)"}
_TILE_OFFSET = {Width.HALF: "off_n // 2", Width.FULL: "off_n", Width.DOUBLE: "2 * off_n"}
# the width whose columns index the pairs of a width's columns
_HALF_OF = {Width.FULL: Width.HALF, Width.DOUBLE: Width.FULL}

class PersistentEmitter(Emitter):
    """Emits the body of ``<name>_epilogue``: one line (or a few) per expression, in evaluation order.

    What a primitive's ``emit_persistent`` may use: ``emit``, ``fresh``, ``comment``, ``memo``; ``names``
    (expression -> its variable); ``full(e)`` (the [BLOCK_M, W] tile of a value), ``pairs_of(e)`` (its
    (even, odd) halves), ``pair_form`` (values kept as halves), ``in_pairs(*operands)``, ``operand``;
    ``sigmoid(var)``; ``elementwise(e, operands, formula)``; the sub-tile's index names ``cols(w)``,
    ``col_ok(w)``, ``tile_ok(w)``, ``tile_offsets(w)``, ``tile_offset(w)``, ``tile_cols(w)``.
    """

    def __init__(self, program: Program):
        super().__init__(program)
        self.names: dict[Expr, str] = {}
        self.widths_used: set[Width] = set()
        # values kept as their (even, odd) column halves: pair maps produce them, elementwise maps of
        # them stay in that form, and the interleaving tl.join + reshape is emitted only for a consumer
        # that needs the [BLOCK_M, W] tile itself (a store or a column reduction)
        self.pair_form: dict[Expr, tuple[str, str]] = {}
        self.joined: set[Expr] = set()

    # -- helpers -------------------------------------------------------------------------------------
    @staticmethod
    def tile_cols(width: Width) -> str:
        """Columns of a sub-tile of a value of ``width`` (SUB_N * w)."""
        return _TILE_COLS[width]

    @staticmethod
    def tile_offset(width: Width) -> str:
        """The sub-tile's first column of a value of ``width``."""
        return _TILE_OFFSET[width]

    def cols(self, width: Width) -> str:
        self.widths_used.add(width)
        return "cols" + _WIDTH_SUFFIX[width]

    def col_ok(self, width: Width) -> str:
        self.widths_used.add(width)
        return "col_ok" + _WIDTH_SUFFIX[width]

    def tile_ok(self, width: Width) -> str:
        self.widths_used.add(width)
        return "tile_ok" + _WIDTH_SUFFIX[width]

    def tile_offsets(self, width: Width) -> str:
        """Element offsets of a [BLOCK_M, SUB_N*w] tile of a row-major [M, N*w] matrix (int64 rows)."""
        return f"rows_64[:, None] * {_MATRIX_COLS[width]} + {self.cols(width)}[None, :]"

    def pairs(self, var: str, width: Width, rows: str = "BLOCK_M") -> tuple[str, str]:
        """(even, odd) columns of a tile value: ``x[:, 2j]`` and ``x[:, 2j + 1]``, split once."""
        key = ("pairs", var)
        if key not in self.memo:
            even, odd = f"{var}_even", f"{var}_odd"
            self.emit(f"{even}, {odd} = tl.split(tl.reshape({var}, ({rows}, {_TILE_COLS[width]} // 2, 2)))")
            self.memo[key] = (even, odd)
        return self.memo[key]

    def pairs_of(self, e: Expr) -> tuple[str, str]:
        """(even, odd) halves of a tile or column value: its pair form, or a split of its tile."""
        if e in self.pair_form:
            return self.pair_form[e]
        return self.pairs(self.names[e], e.width, "1" if e.kind == "col" else "BLOCK_M")

    def full(self, e: Expr) -> str:
        """The [BLOCK_M, W] tile of ``e``; a value in pair form is interleaved here, once."""
        name = self.names[e]
        if e in self.pair_form and e not in self.joined:
            even, odd = self.pair_form[e]
            self.emit(f"{name} = tl.reshape(tl.join({even}, {odd}), (BLOCK_M, {_TILE_COLS[e.width]}))  # interleave (even, odd)")
            self.joined.add(e)
        return name

    def operand(self, e: Expr, as_pairs: bool) -> tuple[str, str] | str:
        """An operand of an elementwise map: its halves when the map runs on pairs (row vectors,
        scalars and constants broadcast to both halves), else its full value."""
        if not as_pairs:
            return self.full(e)
        if e.kind in ("tile", "col"):
            return self.pairs_of(e)
        return self.names[e], self.names[e]

    def in_pairs(self, *operands: Expr) -> bool:
        """An elementwise map runs on pairs when a tile operand is in pair form (no join needed)."""
        return any(o in self.pair_form for o in operands)

    def sigmoid(self, var: str) -> str:
        key = ("sigmoid", var)
        if key not in self.memo:
            name = f"{var}_sigmoid"
            self.emit(f"{name} = sigmoid({var}, PORTABLE)")
            self.memo[key] = name
        return self.memo[key]

    def elementwise(self, e: Expr, operands: tuple[Expr, ...], formula) -> str:
        """An elementwise map: on (even, odd) halves when an operand is in pair form (no join needed;
        row vectors, scalars and constants broadcast to both halves), else on full tiles. ``formula``
        takes the operands' variables and returns the expression (it may emit helper lines)."""
        name = self.fresh("v")
        if self.in_pairs(*operands):
            halves = [self.operand(o, True) for o in operands]
            self.emit(f"# {comment(e)}: on (even, odd) halves")
            for i, half in enumerate(("even", "odd")):
                self.emit(f"{name}_{half} = {formula(*(h[i] for h in halves))}")
            self.pair_form[e] = (f"{name}_even", f"{name}_odd")
        else:
            values = [self.full(o) for o in operands]
            self.emit(f"{name} = {formula(*values)}  # {comment(e)}")
        return name

    # -- expressions ---------------------------------------------------------------------------------
    def expression(self, e: Expr) -> None:
        self.names[e] = e.emit_persistent(self)

    # -- outputs -------------------------------------------------------------------------------------
    def output(self, out) -> list[str]:
        """Emit one output; return the names of the RowPartial pieces this sub-tile contributes."""
        w = out.value.width
        if isinstance(out, RowPartial) and out.value in self.pair_form:
            # a pair-form value is reduced half by half: pair j covers the columns [2j, 2j+1], which
            # lie inside the matrix exactly when pair j does inside the half-width one
            even, odd = self.pair_form[out.value]
            mask = self.tile_ok(_HALF_OF[w])
            self.emit(f"# {out}: columns past N excluded, on (even, odd) halves")
            if out.reduction == "sum":
                self.emit(f"{out.name}_part = tl.sum(tl.where({mask}, {even}, 0.0), axis=1) + "
                          f"tl.sum(tl.where({mask}, {odd}, 0.0), axis=1)")
                return [f"{out.name}_part"]
            self.emit(f"{out.name}_x_even = tl.where({mask}, {even}, float('-inf'))")
            self.emit(f"{out.name}_x_odd = tl.where({mask}, {odd}, float('-inf'))")
            self.emit(f"{out.name}_max = tl.maximum(tl.max({out.name}_x_even, axis=1), tl.max({out.name}_x_odd, axis=1))")
            # shift = max where finite, else 0, as on a full tile (below): never inf - inf = nan
            self.emit(f"{out.name}_shift = tl.where(tl.abs({out.name}_max) == float('inf'), 0.0, {out.name}_max)")
            self.emit(f"{out.name}_sumexp = tl.sum(tl.exp({out.name}_x_even - {out.name}_shift[:, None]), axis=1) + "
                      f"tl.sum(tl.exp({out.name}_x_odd - {out.name}_shift[:, None]), axis=1)")
            return [f"{out.name}_max", f"{out.name}_sumexp"]
        v = self.full(out.value)
        if isinstance(out, Store):
            self.emit(f"# {out}")
            if out.accumulate:
                self.emit("if TMA_EPILOGUE:")
                self.emit(f"    {out.name}_old = {out.name}_desc.load([off_m, {_TILE_OFFSET[w]}]).to(tl.float32)")
                self.emit("else:")
                self.emit(f"    {out.name}_old = tl.load({out.name}_ptr + {self.tile_offsets(w)}, "
                          f"mask={self.tile_ok(w)}, other=0.0).to(tl.float32)")
                v = f"({out.name}_old + {v})"
            cast = f"cast_for_store({v}, {out.name}_ptr, PORTABLE)"
            self.emit("if TMA_EPILOGUE:")
            self.emit(f"    {out.name}_desc.store([off_m, {_TILE_OFFSET[w]}], {cast})")
            self.emit("else:")
            self.emit(f"    tl.store({out.name}_ptr + {self.tile_offsets(w)}, {cast}, mask={self.tile_ok(w)})")
            return []
        if isinstance(out, QuantizedStore):
            self.quantized_store(out, v)
            return []
        if isinstance(out, ColPartial):
            self.emit(f"# {out}: rows past M excluded")
            self.emit(f"{out.name}_part = tl.sum(tl.where({self.tile_ok(w)}, {v}, 0.0), axis=0)")
            self.emit(f"tl.store({out.name}_ptr + pid_m.to(tl.int64) * {_MATRIX_COLS[w]} + {self.cols(w)}, "
                      f"{out.name}_part, mask={self.col_ok(w)})")
            return []
        assert isinstance(out, RowPartial)
        self.emit(f"# {out}: columns past N excluded")
        if out.reduction == "sum":
            self.emit(f"{out.name}_part = tl.sum(tl.where({self.tile_ok(w)}, {v}, 0.0), axis=1)")
            return [f"{out.name}_part"]
        # online logsumexp piece: (max, sum exp(x - shift)), shift = max where finite, else 0: a row of -inf
        # keeps sum 0 (lse -inf), a row holding +inf gets sum +inf (lse +inf), never inf - inf = nan
        self.emit(f"{out.name}_x = tl.where({self.tile_ok(w)}, {v}, float('-inf'))")
        self.emit(f"{out.name}_max = tl.max({out.name}_x, axis=1)")
        self.emit(f"{out.name}_shift = tl.where(tl.abs({out.name}_max) == float('inf'), 0.0, {out.name}_max)")
        self.emit(f"{out.name}_sumexp = tl.sum(tl.exp({out.name}_x - {out.name}_shift[:, None]), axis=1)")
        return [f"{out.name}_max", f"{out.name}_sumexp"]


    def quantized_store(self, out: QuantizedStore, v: str) -> None:
        """e4m3 codes and one scale per group (:class:`QuantizedStore`): the group's amax over its valid elements,
        broadcast back onto the group so that the value is scaled, coded (``e4m3_code``, bit arithmetic) and stored
        as uint8 bits in its own layout; only the amax goes through the grouped shape ([rows, groups, group] along
        N, [groups, group, columns] along M)."""
        w, group, name = out.width, out.group, out.name
        cols = _TILE_COLS[w]
        along_n = out.along == "n"
        self.emit(f"# {out}: elements past M and N excluded from the amax")
        if along_n:
            groups = f"({cols} // {group})"
            self.emit(f"tl.static_assert({cols} % {group} == 0, \"quantized store {name!r}: the epilogue sub-tile "
                      f"(BLOCK_N / EPILOGUE_SPLIT columns, times the value's width) must hold whole groups of "
                      f"{group} columns\")")
            grouped, reduced_axis, spread = f"(BLOCK_M, {groups}, {group})", 2, "[:, :, None]"
        else:
            groups = f"(BLOCK_M // {group})"
            self.emit(f"tl.static_assert(BLOCK_M % {group} == 0, \"quantized store {name!r}: a tile of BLOCK_M rows "
                      f"must hold whole groups of {group} rows\")")
            grouped, reduced_axis, spread = f"({groups}, {group}, {cols})", 1, "[:, None, :]"
        # along N a group is one row's columns (those past N excluded); along M one column's rows (those past M
        # excluded; a column past N is neither stored nor its scale)
        valid = self.tile_ok(w) if along_n else "row_ok[:, None]"
        self.emit(f"{name}_amax = tl.maximum(tl.max(tl.reshape(tl.where({valid}, tl.abs({v}), 0.0), "
                  f"{grouped}), axis={reduced_axis}), 1e-12)  # AMAX_FLOOR")
        self.emit(f"{name}_inv_scale = tl.reshape(tl.broadcast_to(tl.math.div_rn(448.0, {name}_amax){spread}, "
                  f"{grouped}), (BLOCK_M, {cols}))  # E4M3_MAX / amax on each element")
        self.emit(f"{name}_code = e4m3_code(tl.minimum(tl.maximum({v} * {name}_inv_scale, -448.0), 448.0))")
        self.emit(f"tl.store({name}_ptr + {self.tile_offsets(w)}, {name}_code.to(tl.uint8), mask={self.tile_ok(w)})")
        scale_value = f"tl.math.div_rn({name}_amax, 448.0)"
        if along_n:
            scale_cols, scale_width = f"{out.scale}_cols", f"({_MATRIX_COLS[w]} // {group})"
            self.emit(f"{scale_cols} = {_TILE_OFFSET[w]} // {group} + tl.arange(0, {groups})")
            self.emit(f"tl.store({out.scale}_ptr + rows_64[:, None] * {scale_width} + {scale_cols}[None, :], "
                      f"{scale_value}, mask=row_ok[:, None] & ({scale_cols} < {scale_width})[None, :])")
        else:  # scale [cdiv(M, group), N*w]: the tile's row groups, its columns
            scale_rows = f"{out.scale}_rows"
            self.emit(f"{scale_rows} = off_m // {group} + tl.arange(0, {groups})")
            self.emit(f"tl.store({out.scale}_ptr + {scale_rows}.to(tl.int64)[:, None] * {_MATRIX_COLS[w]} + "
                      f"{self.cols(w)}[None, :], {scale_value}, mask=({scale_rows} < tl.cdiv(M, {group}))[:, None] & "
                      f"{self.col_ok(w)}[None, :])")


def _signature_names(program: Program) -> tuple[list[str], list[str], list[str]]:
    """(input pointer names, output pointer names, descriptor names) in argument order."""
    inputs = [f"{name}_ptr" for name in program.inputs]
    outputs = [f"{name}_ptr" for name in program.output_tensors]
    descs = [f"{name}_desc" for name, e in program.inputs.items() if e.kind == "tile"]
    descs += [f"{o.name}_desc" for o in program.outputs if isinstance(o, Store)]
    return inputs, outputs, descs


def _operand_pointers(program: Program) -> str:
    """The GEMM's pointer parameters: A, B and its named operand tensors (the low-rank pair or the K-group scales)."""
    return ", ".join(["a_ptr", "b_ptr"] + [f"{name}_ptr" for name in program.gemm.operand_tensors])


def _mainloop(program: Program) -> tuple[str, str]:
    """(descriptor set-up, K-loop body) for the program's operand layouts."""
    gemm = program.gemm
    if gemm.a_layout == "mk":
        a_desc = "a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])"
        a_tma = "a = a_desc.load([off_m, off_k])"
        a_ptr = "a = tl.load(a_ptr + rows_a[:, None] * K + offs_k[None, :], mask=row_ok_a[:, None] & k_ok[None, :], other=0.0)"
    else:  # A stored [K, M]: load a [BLOCK_K, BLOCK_M] box and use it transposed
        a_desc = "a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[M, 1], block_shape=[BLOCK_K, BLOCK_M])"
        a_tma = "a = a_desc.load([off_k, off_m]).T"
        a_ptr = "a = tl.load(a_ptr + offs_k[None, :].to(tl.int64) * M + rows_a[:, None], mask=row_ok_a[:, None] & k_ok[None, :], other=0.0)"
    if gemm.b_layout == "nk":  # B stored [N, K] (nn.Linear weight): load [BLOCK_N, BLOCK_K], use transposed
        b_desc = "b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])"
        b_tma = "b = b_desc.load([off_n, off_k]).T"
        b_ptr = "b = tl.load(b_ptr + cols_b[None, :] * K + offs_k[:, None], mask=k_ok[:, None] & col_ok_b[None, :], other=0.0)"
    else:
        b_desc = "b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])"
        b_tma = "b = b_desc.load([off_k, off_n])"
        b_ptr = "b = tl.load(b_ptr + offs_k[:, None].to(tl.int64) * N + cols_b[None, :], mask=k_ok[:, None] & col_ok_b[None, :], other=0.0)"
    setup = f"""\
if TMA_MAINLOOP:
    {a_desc}
    {b_desc}"""
    if gemm.k_scale_group is not None:  # the scale matrices' K extent
        setup = f"k_groups = tl.cdiv(K, {gemm.k_scale_group})\n{setup}"
    body = f"""\
if TMA_MAINLOOP:  # TMA boxes; out-of-bounds rows/columns/k are zero-filled by the copy engine
    {a_tma}
    {b_tma}
else:
    offs_k = off_k + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    {a_ptr}
    {b_ptr}
if UPCAST_OPERANDS:  # the Triton 3.6 interpreter's bf16 dot is wrong: multiply in fp32 there
    a = a.to(tl.float32)
    b = b.to(tl.float32)
{_k_group_product(program) if gemm.k_scale_group is not None else "acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)"}"""
    return setup, body


def _k_group_product(program: Program) -> str:
    """The K tile's product scaled by its group's scales (``Gemm.k_scale_group``), added to ``acc`` in fp32: one
    group holds whole K tiles (``G % BLOCK_K == 0``: the configurations cut BLOCK_K to it), so a tile has one scale
    per row of A, and one per column of B or, with ``b_scale_block`` (BLOCK_N cut to at most G), one for all."""
    gemm = program.gemm
    group = gemm.k_scale_group
    a_scale = ("a_scale_ptr + rows_a * k_groups + k_group" if gemm.a_layout == "mk"
               else "a_scale_ptr + k_group * M + rows_a")
    lines = [f'tl.static_assert({group} % BLOCK_K == 0, "K-group scales: a group of {group} must hold whole K tiles")',
             f"k_group = off_k // {group}",
             f"a_scale_k = tl.load({a_scale}, mask=row_ok_a, other=0.0)"]
    if gemm.b_scale_block:  # the tile's columns lie in one block (G % BLOCK_N == 0): one scale per K tile
        b_scale = (f"b_scale_ptr + (off_n // {group}) * k_groups + k_group" if gemm.b_layout == "nk"
                   else f"b_scale_ptr + k_group * tl.cdiv(N, {group}) + off_n // {group}")
        lines += [f'tl.static_assert({group} % BLOCK_N == 0, "block scales of B: a {group} x {group} block must '
                  f'hold the tile\'s columns")',
                  f"b_scale_k = tl.load({b_scale})",
                  "acc += tl.dot(a, b, input_precision=DOT_PRECISION) * (a_scale_k[:, None] * b_scale_k)"]
    else:
        b_scale = ("b_scale_ptr + cols_b * k_groups + k_group" if gemm.b_layout == "nk"
                   else "b_scale_ptr + k_group * N + cols_b")
        lines += [f"b_scale_k = tl.load({b_scale}, mask=col_ok_b, other=0.0)",
                  "acc += tl.dot(a, b, input_precision=DOT_PRECISION) * (a_scale_k[:, None] * b_scale_k[None, :])"]
    return "\n".join(lines)


#: the e4m3 coder, imported by the kernels of programs with a quantized store (it keys their tuning: ``tuning.kernel_hash``)
_E4M3_IMPORT = "from codagen.backends.triton.e4m3 import e4m3_code  # shared with the row kernels\n"


#: an output tile's start in both GEMM kernels: its offsets, the operand rows and columns it reads, the accumulator
_TILE_START = """\
off_m = pid_m * BLOCK_M
off_n = pid_n * BLOCK_N
rows_a = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
row_ok_a = rows_a < M
cols_b = (off_n + tl.arange(0, BLOCK_N)).to(tl.int64)
col_ok_b = cols_b < N

acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)"""


def _dependent_launch(program: Program, first_tile: str, first_k: str) -> str:
    """The start of a GEMM kernel under programmatic dependent launch (:mod:`.runtime`): let the next kernel
    launch, prefetch the first tile's weight rows into L2 (a weight stored [N, K]), then wait for the earlier
    kernels. ``first_tile``: the (pid_m, pid_n) of this program's first tile; ``first_k``: its first K column."""
    lines = ["if PDL:  # programmatic dependent launch: nothing is written before gdc_wait",
             "    tl.extra.cuda.gdc_launch_dependents()"]
    if program.gemm.b_layout == "nk":
        lines += ["    if PREFETCH_K > 0:  # the weight does not depend on the earlier kernels",
                  f"        first_pid_m, first_pid_n = {first_tile}",
                  f"        prefetch_weight_rows(b_ptr, first_pid_n * BLOCK_N, {first_k}, N, K, BLOCK_N, PREFETCH_K)"]
    lines.append("    tl.extra.cuda.gdc_wait()")
    return "\n".join(lines)


def _low_rank_loop(program: Program) -> str:
    """The short second K loop of a low-rank GEMM: ``acc += op(A2) @ op(B2)`` over R in BLOCK_R steps.

    Pointer loads, masked along R: the pair is tiny (R columns), so its loads cost little next to the
    main loop, and no TMA alignment is asked of R. BLOCK_R >= 16, the dot's minimum inner size.
    """
    gemm = program.gemm
    if gemm.a_layout == "mk":
        a2 = "a2 = tl.load(a2_ptr + rows_a[:, None] * R + offs_r[None, :], mask=row_ok_a[:, None] & r_ok[None, :], other=0.0)"
    else:
        a2 = "a2 = tl.load(a2_ptr + offs_r[None, :].to(tl.int64) * M + rows_a[:, None], mask=row_ok_a[:, None] & r_ok[None, :], other=0.0)"
    if gemm.b_layout == "nk":
        b2 = "b2 = tl.load(b2_ptr + cols_b[None, :] * R + offs_r[:, None], mask=r_ok[:, None] & col_ok_b[None, :], other=0.0)"
    else:
        b2 = "b2 = tl.load(b2_ptr + offs_r[:, None].to(tl.int64) * N + cols_b[None, :], mask=r_ok[:, None] & col_ok_b[None, :], other=0.0)"
    return f"""\
for r_tile in range(tl.cdiv(R, BLOCK_R)):  # the low-rank pair: acc += op(A2) @ op(B2)
    offs_r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    {a2}
    {b2}
    if UPCAST_OPERANDS:
        a2 = a2.to(tl.float32)
        b2 = b2.to(tl.float32)
    acc = tl.dot(a2, b2, acc, input_precision=DOT_PRECISION)"""


def generate(program: Program, header: str = "") -> str:
    """The Triton source of ``program``'s fused kernel (a complete Python module)."""
    shown, program = program, kernel_program(program)
    name = program.name
    ep = PersistentEmitter(program)
    for e in program.expressions():
        ep.expression(e)
    row_pieces: list[tuple[RowPartial, list[str]]] = []
    for out in program.outputs:
        pieces = ep.output(out)
        if pieces:
            row_pieces.append((out, pieces))
    returned = [p for _, ps in row_pieces for p in ps]

    # index set-up of the sub-tile, only for the widths the program touches
    prologue = [
        "rows = off_m + tl.arange(0, BLOCK_M)",
        "row_ok = rows < M",
        "rows_64 = rows.to(tl.int64)  # row offsets can pass 2**31 elements",
        "pid_m = off_m // BLOCK_M",
    ]
    for w in (Width.HALF, Width.FULL, Width.DOUBLE):
        if w in ep.widths_used:
            s = _WIDTH_SUFFIX[w]
            prologue.append(f"cols{s} = {_TILE_OFFSET[w]} + tl.arange(0, {_TILE_COLS[w]})  # width {w!r}")
            prologue.append(f"col_ok{s} = cols{s} < {_MATRIX_COLS[w]}")
            prologue.append(f"tile_ok{s} = row_ok[:, None] & col_ok{s}[None, :]")
    body = prologue + [""] + ep.lines
    if returned:
        body.append(f"return {', '.join(returned)}")

    inputs, outputs, descs = _signature_names(program)
    pointer_args = inputs + outputs
    ep_args = ", ".join(pointer_args + descs)
    ep_params = ["acc, off_m, off_n, M, N"] + [", ".join(group) for group in (pointer_args, descs) if group]
    ep_params.append("BLOCK_M: tl.constexpr, SUB_N: tl.constexpr, TMA_EPILOGUE: tl.constexpr, PORTABLE: tl.constexpr")
    ep_sig = ",\n        ".join(ep_params)
    ep_call_args = f"M, N, {ep_args}, BLOCK_M, SUB_N, TMA_EPILOGUE, PORTABLE" if ep_args else "M, N, BLOCK_M, SUB_N, TMA_EPILOGUE, PORTABLE"

    # epilogue descriptors (tile operands and tile outputs), created once per program instance
    desc_lines = []
    for arg in descs:
        tname = arg[:-len("_desc")]
        e = program.inputs.get(tname)
        w = e.width if e is not None and e.kind == "tile" else next(o for o in program.outputs if o.name == tname).value.width
        desc_lines.append(f"{arg} = tl.make_tensor_descriptor({tname}_ptr, shape=[M, {_MATRIX_COLS[w]}], "
                          f"strides=[{_MATRIX_COLS[w]}, 1], block_shape=[BLOCK_M, {_TILE_COLS[w]}])")
    if desc_lines:
        epi_desc = "if TMA_EPILOGUE:\n" + textwrap.indent("\n".join(desc_lines), "    ") + "\nelse:  # pointer path: placeholders, never used\n" + \
            textwrap.indent("\n".join(f"{d} = {d[:-len('_desc')]}_ptr" for d in descs), "    ")
    else:
        epi_desc = "# (no tile operands or tile outputs: the epilogue uses pointer loads/stores only)"

    # the epilogue call(s) on EPILOGUE_SPLIT column slices of acc, and the merge of their RowPartial pieces
    def call(acc_var: str, offset: str, suffix: str) -> str:
        lhs = ", ".join(f"{p}{suffix}" for p in returned) + " = " if returned else ""
        return f"{lhs}{name}_epilogue({acc_var}, off_m, {offset}, {ep_call_args})"

    def merge(into: str, left: str, right: str) -> list[str]:
        lines = []
        for out, pieces in row_pieces:
            if out.reduction == "sum":
                lines.append(f"{pieces[0]}{into} = {pieces[0]}{left} + {pieces[0]}{right}")
            else:
                mx, se = pieces
                lines.append(f"{mx}{into}, {se}{into} = merge_logsumexp({mx}{left}, {se}{left}, {mx}{right}, {se}{right})")
        return lines

    split_lines = ["if EPILOGUE_SPLIT == 1:", f"    {call('acc', 'off_n', '')}",
                   "elif EPILOGUE_SPLIT == 2:  # column halves, one after the other: fewer live registers",
                   "    acc_0, acc_1 = column_halves(acc, BLOCK_M, SUB_N)",
                   f"    {call('acc_0', 'off_n', '_0')}",
                   f"    {call('acc_1', 'off_n + SUB_N', '_1')}"]
    split_lines += [f"    {line}" for line in merge("", "_0", "_1")]
    split_lines += ["else:  # four column quarters",
                    "    acc_01, acc_23 = column_halves(acc, BLOCK_M, 2 * SUB_N)",
                    "    acc_0, acc_1 = column_halves(acc_01, BLOCK_M, SUB_N)",
                    f"    {call('acc_0', 'off_n', '_0')}",
                    f"    {call('acc_1', 'off_n + SUB_N', '_1')}",
                    "    acc_2, acc_3 = column_halves(acc_23, BLOCK_M, SUB_N)",
                    f"    {call('acc_2', 'off_n + 2 * SUB_N', '_2')}",
                    f"    {call('acc_3', 'off_n + 3 * SUB_N', '_3')}"]
    split_lines += [f"    {line}" for line in merge("_01", "_0", "_1") + merge("_23", "_2", "_3") + merge("", "_01", "_23")]
    row_stores = []
    if row_pieces:
        row_stores += ["rows = off_m + tl.arange(0, BLOCK_M)",
                       "partial_offsets = rows.to(tl.int64) * num_pid_n + pid_n  # [M, cdiv(N, BLOCK_N)] partials"]
        for out, pieces in row_pieces:
            value = pieces[0] if out.reduction == "sum" else f"{pieces[0]} + tl.log({pieces[1]})"
            row_stores.append(f"tl.store({out.name}_ptr + partial_offsets, {value}, mask=rows < M)  # {out.reduction}")
    split_call = "\n".join(split_lines)

    def ind(text: str, n: int) -> str:
        return textwrap.indent(text, " " * n)

    setup, kbody = _mainloop(program)
    program_text = textwrap.indent(str(shown), "#   ")
    doc = (program.doc or "").strip().splitlines()[0] if program.doc else ""

    low_rank = program.gemm.low_rank
    low_rank_loop = ind(_low_rank_loop(program), 8) if low_rank else ""
    kernel_args = ",\n        ".join(filter(None, [
        _operand_pointers(program), ", ".join(inputs), ", ".join(outputs),
        "M, N, K" + (", R" if low_rank else ""),
        "BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr"
        + (", BLOCK_R: tl.constexpr" if low_rank else ""),
        "EPILOGUE_SPLIT: tl.constexpr, SUB_N: tl.constexpr, TMA_MAINLOOP: tl.constexpr, TMA_EPILOGUE: tl.constexpr",
        "UPCAST_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr, FLATTEN: tl.constexpr, PORTABLE: tl.constexpr",
        "PDL: tl.constexpr, PREFETCH_K: tl.constexpr",
    ]))

    src = f'''\
# Generated by codagen.backends.triton (generator version {GENERATOR_VERSION}); do not edit.
{header}#
# {program.name}: {doc}
{program_text}
import triton
import triton.language as tl

from codagen.backends.triton.arrivals import last_to_arrive  # shared with the row kernels
from codagen.backends.triton.device_math import cos_sin, sigmoid  # shared with the row kernels
{_E4M3_IMPORT if any(isinstance(o, QuantizedStore) for o in program.outputs) else ""}

{runtime.SOURCE}

@triton.jit
def {name}_epilogue(
        {ep_sig}):
    """The program on one fp32 accumulator sub-tile: rows [off_m, off_m + BLOCK_M), columns [off_n, off_n + SUB_N)."""
{ind(chr(10).join(body), 4)}


@triton.jit
def {name}_kernel(
        {kernel_args}):
    """Persistent GEMM acc = op(A) @ op(B){" + op(A2) @ op(B2)" if low_rank else ""} (fp32 accumulation) with the {name} epilogue; one launch."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
{ind(_dependent_launch(program, "tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)", "0"), 4)}
{ind(setup, 4)}
{ind(epi_desc, 4)}

    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
{ind(_TILE_START, 8)}
        for k_tile in range(k_tiles):
            off_k = k_tile * BLOCK_K
{ind(kbody, 12)}
{low_rank_loop}
{ind(split_call, 8)}
{ind(chr(10).join(row_stores), 8)}
'''
    if not low_rank:
        src += _split_k_kernel(program, setup, kbody, inputs, outputs, descs, split_call, row_stores, ind)
    return src


def _split_k_kernel(program: Program, setup: str, kbody: str, inputs: list[str], outputs: list[str],
                    descs: list[str], split_call: str, row_stores: list[str], ind) -> str:
    """The split-K kernel of a program, one launch: ``<name>_split_k_kernel`` runs the mainloop over one of
    ``SPLIT_K`` ranges of K per output tile and stores its fp32 partial accumulator to ``partial[split, M, N]``;
    the tile's last split to finish (:func:`..arrivals.last_to_arrive` on the tile's counter) sums the
    ``SPLIT_K`` partials in split order, a fixed order, so the result does not depend on which split finished
    last, and runs the epilogue on the sum (pointer loads and stores: TMA_EPILOGUE is False). For few rows
    (decode) and few columns, where ``cdiv(N, BLOCK_N)`` tiles would leave SMs idle and every K loop long."""
    name = program.name
    pointer_params = ", ".join(inputs + outputs)
    # the first work item of a program: tile pid // SPLIT_K, split pid % SPLIT_K (the loop below)
    dependent_launch = _dependent_launch(
        program, "(tl.program_id(0) // SPLIT_K) // num_pid_n, (tl.program_id(0) // SPLIT_K) % num_pid_n",
        "(tl.program_id(0) % SPLIT_K) * k_tiles_per_split * BLOCK_K")
    placeholders = "\n".join(f"{d} = {d[:-len('_desc')]}_ptr  # pointer epilogue: placeholder" for d in descs)
    return f'''

@triton.jit
def {name}_split_k_kernel(
        {_operand_pointers(program)}, partial_ptr, arrivals_ptr, {pointer_params}, M, N, K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        EPILOGUE_SPLIT: tl.constexpr, SUB_N: tl.constexpr, TMA_MAINLOOP: tl.constexpr, TMA_EPILOGUE: tl.constexpr,
        UPCAST_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr, FLATTEN: tl.constexpr, PORTABLE: tl.constexpr,
        PDL: tl.constexpr, PREFETCH_K: tl.constexpr):
    """Split-K: partial[split] = op(A)[:, K range of split] @ op(B)[K range of split, :] in fp32; the tile's last
    split sums its SPLIT_K partials in split order and runs the {name} epilogue on the sum."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
{ind(dependent_launch, 4)}
{ind(setup, 4)}
{ind(placeholders, 4)}

    for work_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n * SPLIT_K, tl.num_programs(0), flatten=FLATTEN):
        split = work_id % SPLIT_K  # the splits of one tile run side by side: their A rows share L2
        tile_id = work_id // SPLIT_K
        pid_m = tile_id // num_pid_n
        pid_n = tile_id % num_pid_n
{ind(_TILE_START, 8)}
        first_k = split * k_tiles_per_split
        for k_tile in range(first_k, tl.minimum(first_k + k_tiles_per_split, k_tiles)):
            off_k = k_tile * BLOCK_K
{ind(kbody, 12)}
        ok = row_ok_a[:, None] & col_ok_b[None, :]
        tl.store(partial_ptr + (split * M + rows_a)[:, None] * N + cols_b[None, :], acc, mask=ok)
        if last_to_arrive(arrivals_ptr + tile_id, SPLIT_K):  # every split of this tile is stored
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for part in tl.static_range(SPLIT_K):
                acc += tl.load(partial_ptr + (part * M + rows_a)[:, None] * N + cols_b[None, :], mask=ok, other=0.0,
                               cache_modifier=".cg")
{ind(split_call, 12)}
{ind(chr(10).join(row_stores), 12)}
'''

