"""Epilogue program -> a Gluon ping-pong kernel (:mod:`.pingpong` holds the fixed parts).

The generated module holds five ``@gluon.jit`` functions:

``<name>_load_inputs``  requests one piece's tile operands by TMA into a rotating buffer slot;
``<name>_load_vectors`` loads one piece's column vectors (a piece ahead of its use);
``<name>_piece``        the program on one [BLOCK_M, PIECE_N] column piece of the accumulator: tile
                        operands read from shared memory, vector loads, the maps, tile stores through
                        shared memory and TMA, ColPartial sums; returns the piece's RowPartial pieces;
``<name>_consumer``     a consumer warpgroup: for each of its tiles, the first pieces' operand loads,
                        the mainloop, the pieces one after the other, the RowPartial stores;
``<name>_kernel``       allocates the A/B ring and each consumer's piece buffers and barriers, and
                        starts the two consumers and the producer (``gl.warp_specialize``).

Layouts. Gluon has no implicit layout conversions, so every value has one of two layouts, fixed by
its width and whether it is kept as its (even, odd) column halves (*pair form*, as in :mod:`.codegen`):

- ``P``, the wgmma accumulator layout of a [BLOCK_M, PIECE_N] piece: FULL-width values, and the
  halves of DOUBLE-width ones (pair j of a 2N-wide value sits where column j of the piece does);
- ``H``, the layout of a ``split`` of a ``P`` tile's column pairs: HALF-width values and the halves of
  FULL-width ones.

Both keep a thread's columns in its own registers, so pair splits and joins move no data. Per-row
vectors load once in ``P``'s row slice and are relabelled into ``H``'s where needed; per-column vectors
load in the layout (and pair form) their use needs. DOUBLE-width values exist only in pair form.
"""
from __future__ import annotations

from codagen.epilogue.ir import Binary, ColPartial, Expr, Program, RowPartial, Store, TileInput, Width

from ..emitter import Emitter, comment
from ..names import kernel_program
from . import timeline as timeline_mode
from .plan import kernel_arguments, refusal, tile_io

__all__ = ["generate", "GENERATOR_VERSION"]

#: bump when the generated code changes meaning (it keys the on-disk source cache)
GENERATOR_VERSION = "1"

_PIECE_COLS = {Width.HALF: "(PIECE_N // 2)", Width.FULL: "PIECE_N", Width.DOUBLE: "(2 * PIECE_N)"}
_MATRIX_COLS = {Width.HALF: "(N // 2)", Width.FULL: "N", Width.DOUBLE: "(2 * N)"}
_OFFSET = {Width.HALF: "col0 // 2", Width.FULL: "col0", Width.DOUBLE: "2 * col0"}



def _tile_inputs(program: Program) -> list[tuple[str, str, Width]]:
    """(value name, descriptor, width) of what each piece reads through shared memory
    (:func:`.plan.tile_io`): the tile operands, and the old value ``<output>_old`` of each
    accumulated store (through the output's own descriptor)."""
    outputs = {o.name for o in program.outputs}
    return [(f"{name}_old" if name in outputs else name, f"{name}_desc", width)
            for name, width, is_input in tile_io(program) if is_input]


class PingpongEmitter(Emitter):
    """Emits the body of ``<name>_piece``: one line (or a few) per expression, in evaluation order.

    What a primitive's ``emit_pingpong`` may use: ``emit``, ``fresh``, ``comment``, ``memo``; ``full``
    (value -> its variable) and ``pairs`` (value -> its (even, odd) halves), one of which it sets;
    ``operand(e, width, paired)`` (an operand in the layout and form of the result); ``row(e, layout)``;
    ``sigmoid(var)``; ``elementwise(e, operands, formula)``; ``scalars`` (device scalars the consumer
    loads); the piece's index names ``cols``, ``col_ok``, ``cols_half``, ``col_ok_half``.
    """

    def __init__(self, program: Program):
        super().__init__(program)
        self.full: dict[Expr, str] = {}                # value -> its tile (or vector, scalar) variable
        self.pairs: dict[Expr, tuple[str, str]] = {}   # value -> its (even, odd) halves
        self.row_vectors: list[Expr] = []                  # loaded per tile by the consumer
        self.scalars: list[Expr] = []                      # loaded once by the consumer
        self.col_vectors: dict[tuple[str, bool], list[str]] = {}   # (name, paired) -> variables
        self.col_loads: list[str] = []                     # the body of <name>_load_vectors
        self.uses_half_layout = False

    def layout(self, width: Width, paired: bool) -> str:
        """``P`` or ``H`` (module docstring) for a tile of ``width`` in full or pair form."""
        name = "P" if (width, paired) in ((Width.FULL, False), (Width.DOUBLE, True)) else "H"
        self.uses_half_layout |= name == "H"
        return name

    # -- operands ----------------------------------------------------------------------------------
    def row(self, e: Expr, layout: str) -> str:
        """``e`` as a [BLOCK_M, 1] column in ``layout``. The vector itself (P's row slice) is loaded
        once per tile by the consumer, before the mainloop, and passed in."""
        if e not in self.row_vectors:
            self.row_vectors.append(e)
        view = ("row", e.name, layout)
        if view not in self.memo:
            name = f"{e.name}_{layout}"
            source = e.name if layout == "P" else f"gl.convert_layout({e.name}, gl.SliceLayout(1, H))"
            self.emit(f"{name} = gl.expand_dims({source}, 1)")
            self.memo[view] = name
        return self.memo[view]

    def col(self, e: Expr, paired: bool) -> str | tuple[str, str]:
        """``e`` as [1, columns] in the layout of its width and form (its halves when ``paired``).
        Loaded one piece ahead (``<name>_load_vectors``) and passed in, so no load latency is exposed."""
        key = (e.name, paired)
        if key not in self.col_vectors:
            layout = self.layout(e.width, paired)
            index, ok = ("cols", "col_ok") if layout == "P" else ("cols_half", "col_ok_half")
            if not paired:
                names = [f"{e.name}_{layout}"]
                self.col_loads.append(f"{names[0]} = gl.expand_dims(gl.load({e.name}_ptr + {index}, mask={ok}, "
                                      f"other=0.0).to(gl.float32), 0)  # {e}")
            else:  # columns 2j and 2j + 1 of the vector, for pair j of the piece
                names = [f"{e.name}_{layout}_even", f"{e.name}_{layout}_odd"]
                for name, plus in zip(names, ("", " + 1")):
                    self.col_loads.append(f"{name} = gl.expand_dims(gl.load({e.name}_ptr + 2 * {index}{plus}, mask={ok}, "
                                          f"other=0.0).to(gl.float32), 0)")
            self.col_vectors[key] = names
        names = self.col_vectors[key]
        return tuple(names) if paired else names[0]

    def split(self, e: Expr) -> tuple[str, str]:
        """The (even, odd) halves of a full-form FULL tile (P -> H: no data moves), split once."""
        if e not in self.pairs:
            name = self.full[e]
            self.uses_half_layout = True
            self.emit(f"{name}_even, {name}_odd = gl.split(gl.reshape({name}, [BM, PIECE_N // 2, 2]))")
            self.pairs[e] = (f"{name}_even", f"{name}_odd")
        return self.pairs[e]

    def joined(self, e: Expr) -> str:
        """The full-form tile of a FULL value kept in pair form (H -> P), joined once."""
        if e not in self.full:
            assert e.width == Width.FULL, "DOUBLE-width values exist only in pair form"
            even, odd = self.pairs[e]
            name = self.fresh("joined")
            self.emit(f"{name} = gl.convert_layout(gl.reshape(gl.join({even}, {odd}), [BM, PIECE_N]), P)  # interleave")
            self.full[e] = name
        return self.full[e]

    def operand(self, e: Expr, width: Width, paired: bool) -> str | tuple[str, str]:
        """``e`` as an operand of a map whose result has ``width`` and form (halves when ``paired``)."""
        if e.kind == "scalar":
            value = self.full[e]
            return (value, value) if paired else value
        if e.kind == "row":
            view = self.row(e, self.layout(width, paired))
            return (view, view) if paired else view
        if e.kind == "col":
            return self.col(e, paired)
        if paired:
            return self.pairs[e] if e in self.pairs else self.split(e)
        return self.full[e] if e in self.full else self.joined(e)

    def sigmoid(self, x: str) -> str:
        key = ("sigmoid", x)
        if key not in self.memo:
            self.emit(f"{x}_sigmoid = sigmoid({x})")
            self.memo[key] = f"{x}_sigmoid"
        return self.memo[key]

    def elementwise(self, e: Expr, operands: tuple[Expr, ...], formula) -> None:
        """An elementwise map: on (even, odd) halves when the result is DOUBLE-wide or an operand is
        only in pair form, else on full tiles. ``formula`` takes the operands' variables and returns the
        expression (it may emit helper lines)."""
        paired = e.width == Width.DOUBLE or any(o in self.pairs and o not in self.full for o in operands)
        name = self.fresh("v")
        values = [self.operand(o, e.width, paired) for o in operands]
        if paired:
            self.emit(f"# {comment(e)}: on (even, odd) halves")
            for i, half in enumerate(("even", "odd")):
                self.emit(f"{name}_{half} = {formula(*(v[i] for v in values))}")
            self.pairs[e] = (f"{name}_even", f"{name}_odd")
        else:
            self.emit(f"{name} = {formula(*values)}  # {comment(e)}")
            self.full[e] = name

    # -- expressions -------------------------------------------------------------------------------
    def expression(self, e: Expr) -> None:
        e.emit_pingpong(self)

    # -- outputs -----------------------------------------------------------------------------------
    def masked_columns(self, value: Expr) -> tuple[list[str], str, str]:
        """(the value's tiles: one or two halves, their layout, the column mask in that layout)."""
        paired = value in self.pairs and value not in self.full
        tiles = list(self.pairs[value]) if paired else [self.full[value]]
        layout = self.layout(value.width, paired)
        return tiles, layout, ("gl.expand_dims(col_ok, 0)" if layout == "P" else "gl.expand_dims(col_ok_half, 0)")

    def row_partial(self, out: RowPartial) -> list[str]:
        tiles, layout, mask = self.masked_columns(out.value)
        to_rows = (lambda x: x) if layout == "P" else (lambda x: f"gl.convert_layout({x}, gl.SliceLayout(1, P))")
        self.emit(f"# {out}: columns past N excluded")
        if out.reduction == "sum":
            total = " + ".join(f"gl.sum(gl.where({mask}, {t}, 0.0), axis=1)" for t in tiles)
            self.emit(f"{out.name}_part = {to_rows(total)}")
            return [f"{out.name}_part"]
        xs = []
        for i, t in enumerate(tiles):
            self.emit(f"{out.name}_x{i} = gl.where({mask}, {t}, float('-inf'))")
            xs.append(f"{out.name}_x{i}")
        row_max = ", ".join(f"gl.max({x}, axis=1)" for x in xs)
        self.emit(f"{out.name}_max = " + (f"gl.maximum({row_max})" if len(xs) == 2 else row_max))
        # shift = max where finite, else 0: a row of -inf keeps sum 0, one holding +inf gets +inf, never nan
        self.emit(f"{out.name}_shift = gl.where(({out.name}_max == float('inf')) | ({out.name}_max == float('-inf')), "
                  f"0.0, {out.name}_max)")
        self.emit(f"{out.name}_sumexp = " + " + ".join(
            f"gl.sum(gl.exp({x} - gl.expand_dims({out.name}_shift, 1)), axis=1)" for x in xs))
        return [to_rows(f"{out.name}_max"), to_rows(f"{out.name}_sumexp")]

    def col_partial(self, out: ColPartial) -> None:
        tiles, layout, _ = self.masked_columns(out.value)
        row_ok = f"row_ok_{layout}"
        if ("row_ok", layout) not in self.memo:
            source = "row_ok" if layout == "P" else "gl.convert_layout(row_ok, gl.SliceLayout(1, H))"
            self.emit(f"{row_ok} = gl.expand_dims({source}, 1)")
            self.memo[("row_ok", layout)] = row_ok
        index, ok = ("cols", "col_ok") if layout == "P" else ("cols_half", "col_ok_half")
        self.emit(f"# {out}: rows past M excluded")
        base = f"{out.name}_ptr + pid_m.to(gl.int64) * {_MATRIX_COLS[out.value.width]}"
        if len(tiles) == 1:
            self.emit(f"gl.store({base} + {index}, gl.sum(gl.where({row_ok}, {tiles[0]}, 0.0), axis=0), mask={ok})")
        else:
            for plus, t in zip(("", " + 1"), tiles):
                self.emit(f"gl.store({base} + 2 * {index}{plus}, gl.sum(gl.where({row_ok}, {t}, 0.0), axis=0), mask={ok})")

    def stores(self, stores: list[Store]) -> None:
        """Every tile store of the piece: wait for piece p - 2's copies to have read the buffers, write
        them, fence, one TMA copy each."""
        if not stores:
            return
        values = {}
        for out in stores:
            value = out.value
            if out.accumulate:  # old + value, in the value's form
                value = Binary("add", TileInput(f"{out.name}_old", value.width), out.value)
                self.expression(value)
            values[out.name] = value
        self.emit(f"tma.store_wait(pendings={len(stores)})  # piece p - 2's stores have read their buffers")
        for out in stores:
            value = values[out.name]
            buffer = f"{out.name}_out.index(piece % OUT_BUFFERS)"
            if value in self.pairs and value not in self.full:
                even, odd = self.pairs[value]
                pairs = _PIECE_COLS[value.width] + " // 2"
                self.emit(f"{buffer}.reshape([BM, {pairs}, 2]).store(gl.join({even}, {odd}).to({out.name}_out.dtype))"
                          f"  # {out.name}: (even, odd) interleaved")
            else:
                self.emit(f"{buffer}.store({self.full[value]}.to({out.name}_out.dtype))  # {out.name}")
        self.emit("fence_async_shared()")
        for out in stores:
            self.emit(f"tma.async_copy_shared_to_global({out.name}_desc, [pid_m * BM, {_OFFSET[out.value.width]}], "
                      f"{out.name}_out.index(piece % OUT_BUFFERS))")


def generate(program: Program, header: str = "", timeline: bool = False) -> str:
    """The Gluon source of ``program``'s ping-pong kernel (a complete Python module).

    ``timeline``: the measurement-only variant that stamps each tile's phases (:mod:`.timeline`)."""
    stamps = timeline_mode.ON if timeline else timeline_mode.OFF
    reason = refusal(program)
    if reason:
        raise ValueError(f"{program.name}: the ping-pong generator cannot take this program: {reason}")
    shown, program = program, kernel_program(program)
    name = program.name
    emitter = PingpongEmitter(program)
    inputs = _tile_inputs(program)
    # tile operands are read first: their slot is refilled (piece + IN_SLOTS) as soon as they are
    load_lines = []
    for value, _, width in inputs:
        buffer = f"{value}_in.index(slot)"
        if width == Width.DOUBLE:
            emitter.pairs[TileInput(value, width)] = (f"{value}_even", f"{value}_odd")
            load_lines += [f"{value}_even, {value}_odd = gl.split({buffer}.reshape([BM, PIECE_N, 2]).load(J).to(gl.float32))",
                           f"{value}_even, {value}_odd = gl.convert_layout({value}_even, P), gl.convert_layout({value}_odd, P)"]
        else:
            layout = emitter.layout(width, False)
            emitter.full[TileInput(value, width)] = value
            load_lines.append(f"{value} = {buffer}.load({layout}).to(gl.float32)")
    for e in program.expressions():
        emitter.expression(e)
    partials: list[tuple[RowPartial, list[str]]] = []
    for out in program.outputs:
        if isinstance(out, RowPartial):
            partials.append((out, emitter.row_partial(out)))
        elif isinstance(out, ColPartial):
            emitter.col_partial(out)
    emitter.stores([o for o in program.outputs if isinstance(o, Store)])

    args = kernel_arguments(program)
    descs = [a.name for a in args if a.descriptor]
    ptrs = [a.name for a in args if not a.descriptor]
    in_bufs = [f"{value}_in" for value, _, _ in inputs]
    out_bufs = [f"{o.name}_out" for o in program.outputs if isinstance(o, Store)]
    bars = ["input_bars"] if inputs else []
    shared = ", ".join(descs + ptrs + in_bufs + out_bufs + bars)
    rows_in = [e.name for e in emitter.row_vectors] + [e.name for e in emitter.scalars]
    cols_in = [v for names in emitter.col_vectors.values() for v in names]
    col_ptrs = sorted({name for name, _ in emitter.col_vectors})
    vector_args = ", ".join(rows_in + cols_in)

    # -- <name>_piece ------------------------------------------------------------------------------
    head = ["P: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PIECE_N, 16])",
            "acc = gl.convert_layout(acc, P)  # the piece's own wgmma layout: the same registers, relabelled"]
    if emitter.uses_half_layout:
        head += ["probe_even, probe_odd = gl.split(gl.reshape(acc, [BM, PIECE_N // 2, 2]))",
                 "H: gl.constexpr = probe_even.type.layout  # a column-pair half of P"]
    if any(w == Width.DOUBLE for _, _, w in inputs):
        head.append("J: gl.constexpr = gl.join(acc, acc).type.layout  # a DOUBLE-width piece as [BM, PIECE_N, 2]")
    head += ["col0 = pid_n * BN + piece * PIECE_N  # the piece's first column",
             "rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, P))",
             "row_ok = rows < M",
             "cols = col0 + gl.arange(0, PIECE_N, layout=gl.SliceLayout(0, P))  # FULL columns, DOUBLE pairs",
             "col_ok = cols < N"]
    if emitter.uses_half_layout:
        head += ["cols_half = col0 // 2 + gl.arange(0, PIECE_N // 2, layout=gl.SliceLayout(0, H))  # HALF columns, FULL pairs",
                 "col_ok_half = cols_half < N // 2"]
    if cols_in:
        head += ["if piece + 1 < PIECES:  # the next piece's column vectors load while this piece runs",
                 f"    next_vectors = {name}_load_vectors(piece + 1, pid_n, N, {', '.join(p_ + '_ptr' for p_ in col_ptrs)}, PIECE_N)",
                 "else:",
                 f"    next_vectors = ({', '.join(cols_in)},)"]
    if inputs:
        load_args = ", ".join([d for _, d, _ in inputs] + in_bufs)
        head += ["slot = piece % IN_SLOTS",
                 "mbarrier.wait(input_bars.index(slot), (iteration * (PIECES // IN_SLOTS) + piece // IN_SLOTS) & 1)"]
        head += load_lines
        head += ["if piece + IN_SLOTS < PIECES:  # the slot is read: refill it with a later piece's operands",
                 f"    {name}_load_inputs(piece + IN_SLOTS, pid_m, pid_n, {load_args}, input_bars, PIECE_N, IN_SLOTS)"]
    returned = [p_ for _, ps in partials for p_ in ps] + (["next_vectors"] if cols_in else [])
    body = head + [""] + emitter.lines + ([f"return {', '.join(returned)}"] if returned else [])

    def ind(lines, n):
        return "\n".join((" " * n + line) if line else "" for line in lines)

    load_fn = ""
    if inputs:
        load_args = ", ".join([d for _, d, _ in inputs] + in_bufs)
        nbytes = " + ".join(f"{d}.block_type.nbytes" for _, d, _ in inputs)
        copies = [f"tma.async_copy_global_to_shared({d}, [pid_m * BM, {_OFFSET[w]}], bar, {v}_in.index(piece % IN_SLOTS))"
                  for v, d, w in inputs]
        load_fn = f'''

@gluon.jit
def {name}_load_inputs(piece: gl.constexpr, pid_m, pid_n, {load_args}, input_bars, PIECE_N: gl.constexpr, IN_SLOTS: gl.constexpr):
    """Request the tile operands of a piece into its slot (one barrier for all of them)."""
    col0 = pid_n * BN + piece * PIECE_N
    bar = input_bars.index(piece % IN_SLOTS)
    mbarrier.expect(bar, {nbytes})
{ind(copies, 4)}
'''

    if cols_in:
        probe = []
        if any("cols_half" in line for line in emitter.col_loads):
            probe = ["probe_even, probe_odd = gl.split(gl.reshape(gl.zeros([BM, PIECE_N], gl.float32, P), [BM, PIECE_N // 2, 2]))",
                     "H: gl.constexpr = probe_even.type.layout",
                     "cols_half = col0 // 2 + gl.arange(0, PIECE_N // 2, layout=gl.SliceLayout(0, H))",
                     "col_ok_half = cols_half < N // 2"]
        vector_lines = (["P: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PIECE_N, 16])",
                         "col0 = pid_n * BN + piece * PIECE_N",
                         "cols = col0 + gl.arange(0, PIECE_N, layout=gl.SliceLayout(0, P))",
                         "col_ok = cols < N"] + probe + emitter.col_loads + [f"return {', '.join(cols_in)},"])
        load_fn += f'''

@gluon.jit
def {name}_load_vectors(piece: gl.constexpr, pid_n, N, {', '.join(p_ + '_ptr' for p_ in col_ptrs)}, PIECE_N: gl.constexpr):
    """A piece's column vectors, in the layouts the piece uses them in."""
{ind(vector_lines, 4)}
'''

    # -- <name>_consumer ---------------------------------------------------------------------------
    consumer = []
    if inputs:
        load_args = ", ".join([d for _, d, _ in inputs] + in_bufs)
        consumer += ["for piece in gl.static_range(IN_SLOTS):  # the first pieces' operands load under the mainloops",
                     f"    {name}_load_inputs(piece, pid_m, pid_n, {load_args}, input_bars, PIECE_N, IN_SLOTS)"]
    consumer.append("rows = pid_m * BM + gl.arange(0, BM, layout=row_layout)")
    for e in emitter.row_vectors:  # loaded before the mainloop: their latency hides under it
        other = "-1" if e.index else "0.0"
        cast = "" if e.index else ".to(gl.float32)"
        consumer.append(f"{e.name} = gl.load({e.name}_ptr + rows, mask=rows < M, other={other}){cast}")
    if cols_in:
        consumer.append(f"vectors = {name}_load_vectors(0, pid_n, N, {', '.join(p_ + '_ptr' for p_ in col_ptrs)}, PIECE_N)")
    consumer = stamps.tile_start(consumer)
    consumer += ["acc = mainloop(a_slots, b_slots, ready, empty, turn, local, k_steps, WHICH, B_NK)",
                 "pieces = column_pieces(acc, PIECES)"]
    for out, _ in partials:
        if out.reduction == "sum":
            consumer.append(f"{out.name} = gl.zeros([BM], gl.float32, row_layout)")
        else:
            consumer += [f"{out.name}_max = gl.full([BM], float('-inf'), gl.float32, row_layout)",
                         f"{out.name}_sumexp = gl.zeros([BM], gl.float32, row_layout)"]
    lhs = ", ".join([f"{o.name}_{i}" for o, names in partials for i in range(len(names))] + (["vectors"] if cols_in else []))
    vec_call = ", ".join(rows_in + [f"vectors[{i}]" for i in range(len(cols_in))])
    call = (f"{name}_piece(pieces[piece], piece, local // 2, pid_m, pid_n, M, N, {shared}, "
            f"{vec_call + ', ' if vec_call else ''}PIECE_N, PIECES, IN_SLOTS)")
    consumer += stamps.stamp(2)
    consumer += ["for piece in gl.static_range(PIECES):", f"    {lhs + ' = ' if lhs else ''}{call}"]
    for out, _ in partials:
        if out.reduction == "sum":
            consumer.append(f"    {out.name} += {out.name}_0")
        else:
            consumer.append(f"    {out.name}_max, {out.name}_sumexp = merge_logsumexp({out.name}_max, {out.name}_sumexp, "
                            f"{out.name}_0, {out.name}_1)")
    consumer += stamps.stamp(3)
    if partials:
        consumer += ["partial_offsets = rows.to(gl.int64) * num_pid_n + pid_n  # [M, cdiv(N, BN)] partials"]
        for out, _ in partials:
            value = out.name if out.reduction == "sum" else f"{out.name}_max + gl.log({out.name}_sumexp)"
            consumer.append(f"gl.store({out.name}_ptr + partial_offsets, {value}, mask=rows < M)  # {out.reduction}")

    scalar_lines = [f"{e.name} = gl.load({e.name}_ptr).to(gl.float32)  # a device scalar: no host sync"
                    for e in emitter.scalars]

    # -- <name>_kernel -----------------------------------------------------------------------------
    allocs = []
    for c in (0, 1):
        for value, desc, width in inputs:
            allocs.append(f"{value}_in_{c} = gl.allocate_shared_memory({desc}.dtype, [IN_SLOTS, BM, {_PIECE_COLS[width]}], "
                          f"{desc}.layout)")
        for o in program.outputs:
            if isinstance(o, Store):
                allocs.append(f"{o.name}_out_{c} = gl.allocate_shared_memory({o.name}_desc.dtype, [OUT_BUFFERS, BM, "
                              f"{_PIECE_COLS[o.value.width]}], {o.name}_desc.layout)")
        if inputs:
            allocs.append(f"input_bars_{c} = gl.allocate_shared_memory(gl.int64, [IN_SLOTS, 1], mbarrier.MBarrierLayout())")
    inits = ["for slot_index in gl.static_range(RING):", "    mbarrier.init(ready.index(slot_index), count=1)",
             "    mbarrier.init(empty.index(slot_index), count=1)", "for slot_index in gl.static_range(2):",
             "    mbarrier.init(turn.index(slot_index), count=1)"]
    if inputs:
        inits += ["for slot_index in gl.static_range(IN_SLOTS):", "    mbarrier.init(input_bars_0.index(slot_index), count=1)",
                  "    mbarrier.init(input_bars_1.index(slot_index), count=1)"]


    def per_consumer(c):
        own = [f"{b}_{c}" for b in in_bufs + out_bufs + bars]
        return ", ".join(["a_slots, b_slots, ready, empty, turn, M, N, K"] + descs + ptrs + own + stamps.params
                         + [str(c), "B_NK", "PIECE_N", "IN_SLOTS"])
    kernel_params = ", ".join(["a_desc, b_desc"] + descs + ptrs + ["M, N, K"] + stamps.params
                              + ["B_NK: gl.constexpr, PIECE_N: gl.constexpr, IN_SLOTS: gl.constexpr"])
    program_text = "\n".join("#   " + line for line in str(shown).splitlines())
    doc = (program.doc or "").strip().splitlines()[0] if program.doc else ""

    return f'''\
# Generated by codagen.backends.triton (ping-pong generator version {GENERATOR_VERSION}); do not edit.
{header}#
# {name}: {doc}
{program_text}
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from codagen.backends.triton.pingpong import (BK, BM, BN, OUT_BUFFERS, RING, column_pieces, cos_sin,
                                              mainloop, merge_logsumexp, producer, sigmoid, tile_coords)
{stamps.functions()}{load_fn}

@gluon.jit
def {name}_piece(acc, piece: gl.constexpr, iteration, pid_m, pid_n, M, N, {shared},{' ' + vector_args + ',' if vector_args else ''}
        PIECE_N: gl.constexpr, PIECES: gl.constexpr, IN_SLOTS: gl.constexpr):
    """The program on columns [col0, col0 + PIECE_N) of tile (pid_m, pid_n); returns its RowPartial pieces."""
{ind(body, 4)}


@gluon.jit
def {name}_consumer(a_slots, b_slots, ready, empty, turn, M, N, K, {shared},{''.join(' ' + p + ',' for p in stamps.params)}
        WHICH: gl.constexpr, B_NK: gl.constexpr, PIECE_N: gl.constexpr, IN_SLOTS: gl.constexpr):
    """Consumer WHICH: tiles WHICH, WHICH + 2, ... of this program; its epilogue overlaps the other's mainloop."""
    PIECES: gl.constexpr = BN // PIECE_N
    row_layout: gl.constexpr = gl.SliceLayout(1, gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                            instr_shape=[16, PIECE_N, 16]))
    num_pid_m, num_pid_n = gl.cdiv(M, BM), gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    my_tiles = gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), gl.num_programs(0))
    if WHICH == 0:
        mbarrier.arrive(turn.index(0))  # consumer 0 takes the first turn
{ind(scalar_lines, 4) + chr(10) if scalar_lines else ''}    for local in range(WHICH, my_tiles, 2):
        tile_index = gl.program_id(0) + local * gl.num_programs(0)
        pid_m, pid_n = tile_coords(tile_index, num_pid_m, num_pid_n)
{ind(consumer, 8)}
    tma.store_wait(pendings=0)


@gluon.jit
def {name}_kernel({kernel_params}):
    """Ping-pong GEMM acc = A @ op(B) with the {name} epilogue; one launch."""
    a_slots = gl.allocate_shared_memory(a_desc.dtype, [RING, BM, BK], a_desc.layout)
    if B_NK:
        b_slots = gl.allocate_shared_memory(b_desc.dtype, [RING, BN, BK], b_desc.layout)
    else:
        b_slots = gl.allocate_shared_memory(b_desc.dtype, [RING, BK, BN], b_desc.layout)
{ind(allocs, 4)}
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
{ind(inits, 4)}
    gl.warp_specialize([
        ({name}_consumer, ({per_consumer(0)})),
        ({name}_consumer, ({per_consumer(1)})),
        (producer, (a_desc, b_desc, a_slots, b_slots, ready, empty, M, N, K, B_NK)),
    ], [4, 1], [232, 40])  # warps and registers of the two worker partitions
'''
