"""Does a warp-specialized ping-pong GEMM hide the SwiGLU-backward epilogue? (GPU prototype, Hopper, bf16.)

    PYTHONPATH=. python bench/gluon_pingpong.py [--out DIR]            # check + time on the GPU
    PYTHONPATH=. python bench/gluon_pingpong.py --compile-only         # compile for sm_90 here (no GPU)
    CODAGEN_GLUON_SCHEDULE=4,2 CODAGEN_GLUON_TIMELINE=1 ...            # another split; in-kernel phase times

The ``tl`` template runs each tile's epilogue after its mainloop on the same warps (docs/triton.md), so
the SwiGLU backward (``grad_act = grad_out @ W_down`` [M, F], reading the interleaved pre-activation
[M, 2F] and writing ``grad_preact`` [M, 2F] and ``act`` [M, F]) costs 1.3-1.6x the bare GEMM. This is the
CUTLASS "ping-pong" schedule written in Gluon (Triton's explicit-layout language):

- one producer warp streams A/B k-slices with TMA into a ring of ``STAGES`` shared-memory slots;
- two consumer warpgroups take alternate output tiles (128 x 128, accumulator in registers) and take
  turns on the tensor cores (a pair of mbarriers passes the turn at the end of each mainloop), so one
  runs its epilogue while the other runs its mainloop.

The epilogue takes the accumulator in four [128, 32] column pieces (register-local splits of the wgmma
layout). Each piece's interleaved ``(g, u)`` pairs arrive by TMA in shared memory (the first
``PAIR_BUFFERS`` pieces are requested when the tile starts, so they load under the other consumer's
mainloop); ``(dg, du)`` are written back over them and leave by TMA, as ``act`` does from its own buffer.
``EPILOGUE = 0`` stores the accumulator only (the schedule's bare GEMM speed), ``1`` is the SwiGLU
backward of ``codagen.epilogue.library.swiglu_backward``. Results and what they mean: docs/triton.md.

Printed: ms per kernel against cuBLAS (``torch.mm``) and codagen's Triton kernel for the same program.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

BM, BN, BK = gl.constexpr(128), gl.constexpr(128), gl.constexpr(64)
# shared memory (227 KiB): STAGES x 32 KiB of A/B slots + per consumer PAIR_BUFFERS x 16 KiB of (g, u) pairs
# and 2 x 8 KiB of act; CODAGEN_GLUON_SCHEDULE="stages,pair_buffers[,registers]" picks another split
# ("registers": act leaves by pointer stores from registers, and its shared memory goes to pair buffers)
_schedule = os.environ.get("CODAGEN_GLUON_SCHEDULE", "4,2").split(",")
STAGES = gl.constexpr(int(_schedule[0]))
PAIR_BUFFERS = gl.constexpr(int(_schedule[1]))  # 2: pieces 0, 1 prefetched; 3: pieces 0, 1, 2
ACT_IN_REGISTERS = gl.constexpr(_schedule[2:] == ["registers"])
STORES_PER_PIECE = gl.constexpr(1 if ACT_IN_REGISTERS else 2)  # TMA stores
QUARTER = gl.constexpr(32)  # the epilogue works on [BM, BN / 4] column pieces
GROUP = gl.constexpr(8)
CONSUMER_WARPS = gl.constexpr(4)  # one warpgroup per consumer
# CODAGEN_GLUON_TIMELINE=1: CTA 0's consumers write %globaltimer stamps for their first TIMELINE_TILES tiles
# (tile start, turn granted, mainloop done, each epilogue piece done) and the run prints the phase times
TIMELINE = gl.constexpr(os.environ.get("CODAGEN_GLUON_TIMELINE", "0") == "1")
TIMELINE_TILES = gl.constexpr(16)
STAMPS = gl.constexpr(8)
# CODAGEN_GLUON_ABLATE="loads+stores+math+smem" (any subset) drops epilogue stages to time what is left;
# outputs are then wrong (timing only): loads: no (g, u) TMA loads (the buffers' stale contents are used);
# stores: no TMA stores; math: d_gate = acc * up, no exp/divide; smem: no shared-memory load/store of pairs
_ablate = set(filter(None, os.environ.get("CODAGEN_GLUON_ABLATE", "").split("+")))
assert _ablate <= {"loads", "stores", "math", "smem"}, _ablate
NO_LOADS = gl.constexpr("loads" in _ablate)
NO_STORES = gl.constexpr("stores" in _ablate)
CHEAP_MATH = gl.constexpr("math" in _ablate)
NO_SMEM = gl.constexpr("smem" in _ablate)
# CODAGEN_GLUON_SIGMOID=precise: tl.sigmoid's denormal-safe exp and divide (about 12 instructions)
# instead of codagen's sigmoid (ex2.approx.ftz + rcp.approx.ftz, 4; codagen/backends/triton/device_math.py)
FAST_SIGMOID = gl.constexpr(os.environ.get("CODAGEN_GLUON_SIGMOID", "fast") == "fast")


@gluon.jit
def _stamp(timeline_ptr, slot, dep):
    """Write %globaltimer (ns) to ``timeline_ptr[slot]``; ``dep`` (any int32 value) orders the read."""
    now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [dep], dtype=gl.int64,
                                    is_pure=False, pack=1)
    gl.store(timeline_ptr + slot, now)


@gluon.jit
def _sigmoid(x):
    if FAST_SIGMOID:
        return gl.inline_asm_elementwise(
            "{ .reg .f32 t; mul.ftz.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; "
            "add.ftz.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }",
            "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n):
    """Grouped (L2-friendly) tile order, as the tl template's."""
    in_group = GROUP * num_pid_n
    first_m = (tile // in_group) * GROUP
    group_rows = gl.minimum(num_pid_m - first_m, GROUP)
    return first_m + (tile % in_group) % group_rows, (tile % in_group) // group_rows


@gluon.jit
def _producer(a_desc, b_desc, a_slots, b_slots, ready, empty, M, N, K):
    num_pid_m, num_pid_n = gl.cdiv(M, BM), gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    count = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n)
        for kk in range(k_steps):
            slot = count % STAGES
            # a slot's first use passes at once (parity 1 of a fresh barrier counts as completed)
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pid_m * BM, kk * BK], ready.index(slot), a_slots.index(slot))
            tma.async_copy_global_to_shared(b_desc, [kk * BK, pid_n * BN], ready.index(slot), b_slots.index(slot))
            count += 1


@gluon.jit
def _halves(t):
    """[R, C] -> its column halves [R, C/2]: in the wgmma layout column bit C/2 is a register bit, so
    this moves no data; it bounds how many values the epilogue holds at once."""
    R: gl.constexpr = t.shape[0]
    C: gl.constexpr = t.shape[1]
    return gl.split(gl.permute(gl.reshape(t, [R, 2, C // 2]), [0, 2, 1]))


@gluon.jit
def _issue_piece_load(preact_desc, buffer, bar, pid_m, pid_n, piece: gl.constexpr):
    if NO_LOADS:
        return
    mbarrier.expect(bar, preact_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(preact_desc, [pid_m * BM, pid_n * 2 * BN + piece * 2 * QUARTER], bar, buffer)


@gluon.jit
def _swiglu_backward_piece(acc, pair_buffer, act_buffer, bar, phase, grad_preact_desc, act_desc, act_ptr, M, N,
                           pid_m, pid_n, piece: gl.constexpr):
    """One [BM, QUARTER] column piece: its (g, u) pairs [BM, 2 QUARTER] arrived by TMA in ``pair_buffer``;
    (dg, du) go back over them in place and leave by TMA, as ``act`` does from ``act_buffer``."""
    layout: gl.constexpr = acc.type.layout
    pair_layout: gl.constexpr = gl.join(acc, acc).type.layout
    if not NO_LOADS:
        mbarrier.wait(bar, phase)
    pairs = pair_buffer.reshape([BM, QUARTER, 2])
    if NO_SMEM:
        gate, up = acc + 1.0, acc - 1.0
    else:
        gate, up = gl.split(pairs.load(pair_layout).to(gl.float32))
        # split's result layout is the piece's written as a linear layout: the conversion is a no-op
        gate, up = gl.convert_layout(gate, layout), gl.convert_layout(up, layout)
    if CHEAP_MATH:
        sig = gate
        silu = gate * up
        d_gate = acc * up
    else:
        sig = _sigmoid(gate)
        silu = gate * sig
        d_gate = acc * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = acc * silu
    act = (silu * up).to(act_ptr.dtype.element_ty)
    if not NO_SMEM:
        pairs.store(gl.join(d_gate, d_up).to(pair_buffer.dtype))
        if not ACT_IN_REGISTERS:
            act_buffer.store(act)
    fence_async_shared()
    if not NO_STORES:
        tma.async_copy_shared_to_global(grad_preact_desc, [pid_m * BM, pid_n * 2 * BN + piece * 2 * QUARTER],
                                        pair_buffer)
    if ACT_IN_REGISTERS:
        row = gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(1, layout)), 1)
        col = gl.expand_dims(piece * QUARTER + gl.arange(0, QUARTER, layout=gl.SliceLayout(0, layout)), 0)
        corner = act_ptr + (pid_m * BM).to(gl.int64) * N + pid_n * BN
        gl.store(corner + row * N + col, act, mask=(row < M - pid_m * BM) & (col < N - pid_n * BN))
    elif not NO_STORES:
        tma.async_copy_shared_to_global(act_desc, [pid_m * BM, pid_n * BN + piece * QUARTER], act_buffer)
    return gl.sum(gate * d_gate + up * d_up, axis=1)


@gluon.jit
def _epilogue_step(piece, p: gl.constexpr, iteration, pid_m, pid_n, preact_desc, grad_preact_desc, act_desc,
                   act_ptr, M, N, pair_buffers, act_buffers, bars, timeline_ptr, stamp_base, stamping):
    """Piece p, then the load of piece p - 1 + PAIR_BUFFERS into piece p - 1's buffer once piece p - 1's
    stores have drained (piece p's are issued by then, so the wait rarely waits)."""
    loads_per_tile: gl.constexpr = (4 - p % PAIR_BUFFERS + PAIR_BUFFERS - 1) // PAIR_BUFFERS  # into p's buffer
    phase = (iteration * loads_per_tile + p // PAIR_BUFFERS) & 1
    partial = _swiglu_backward_piece(piece, pair_buffers.index(p % PAIR_BUFFERS),
                                     act_buffers.index(0 if ACT_IN_REGISTERS else p % 2),
                                     bars.index(p % PAIR_BUFFERS), phase, grad_preact_desc, act_desc, act_ptr, M, N,
                                     pid_m, pid_n, p)
    if TIMELINE:
        if stamping:
            _stamp(timeline_ptr, stamp_base + 3 + p, pid_n)
    if p >= 1 and p - 1 + PAIR_BUFFERS < 4:
        tma.store_wait(pendings=STORES_PER_PIECE)  # piece p - 1's stores are done
        _issue_piece_load(preact_desc, pair_buffers.index((p - 1) % PAIR_BUFFERS), bars.index((p - 1) % PAIR_BUFFERS),
                          pid_m, pid_n, p - 1 + PAIR_BUFFERS)
    return partial


@gluon.jit
def _swiglu_backward_epilogue(acc, iteration, pid_m, pid_n, M, N, preact_desc, grad_preact_desc, act_desc, act_ptr,
                              partial_ptr, pair_buffers, act_buffers, bars, timeline_ptr, stamp_base, stamping):
    """Pieces 0 .. PAIR_BUFFERS - 1 were prefetched at the tile's start; the others reuse their buffers."""
    row_layout: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    left, right = _halves(acc)
    q0, q1 = _halves(left)
    q2, q3 = _halves(right)
    args = (iteration, pid_m, pid_n, preact_desc, grad_preact_desc, act_desc, act_ptr, M, N, pair_buffers,
            act_buffers, bars, timeline_ptr, stamp_base, stamping)
    partial = gl.convert_layout(_epilogue_step(q0, 0, *args), row_layout)
    partial += gl.convert_layout(_epilogue_step(q1, 1, *args), row_layout)
    partial += gl.convert_layout(_epilogue_step(q2, 2, *args), row_layout)
    partial += gl.convert_layout(_epilogue_step(q3, 3, *args), row_layout)
    rows = pid_m * BM + gl.arange(0, BM, layout=row_layout)
    gl.store(partial_ptr + rows * gl.cdiv(N, BN) + pid_n, partial, mask=rows < M)


@gluon.jit
def _consumer(a_slots, b_slots, ready, empty, turn, M, N, K, out_ptr, preact_desc, grad_preact_desc, act_desc,
              partial_ptr, my_pairs, my_acts, my_bars, timeline_ptr, WHICH: gl.constexpr, EPILOGUE: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    num_pid_m, num_pid_n = gl.cdiv(M, BM), gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    my_tiles = gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), gl.num_programs(0))
    if WHICH == 0:
        mbarrier.arrive(turn.index(0))  # consumer 0 takes the first turn
    for local in range(WHICH, my_tiles, 2):
        tile = gl.program_id(0) + local * gl.num_programs(0)
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n)
        if EPILOGUE == 1:  # the epilogue's first PAIR_BUFFERS pieces load while the mainloops run
            tma.store_wait(pendings=0)
            for p in gl.static_range(PAIR_BUFFERS):
                _issue_piece_load(preact_desc, my_pairs.index(p), my_bars.index(p), pid_m, pid_n, p)
        base = local * k_steps  # ring position of this tile's first k-slice (the producer's order)
        stamping = (gl.program_id(0) == 0) & (local // 2 < TIMELINE_TILES)
        stamp_base = (WHICH * TIMELINE_TILES + local // 2) * STAMPS
        if TIMELINE:
            if stamping:
                _stamp(timeline_ptr, stamp_base, local)
        mbarrier.wait(turn.index(WHICH), (local // 2) & 1)
        if TIMELINE:
            if stamping:
                _stamp(timeline_ptr, stamp_base + 1, local)
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
        for kk in range(k_steps):
            count = base + kk
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            acc = warpgroup_mma(a_slots.index(slot), b_slots.index(slot), acc, use_acc=kk > 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))  # the previous slice's MMA is done: free its slot
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=kk > 0)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((base + k_steps - 1) % STAGES))
        mbarrier.arrive(turn.index(1 - WHICH))  # the tensor cores pass to the other consumer
        if TIMELINE:
            if stamping:
                _stamp(timeline_ptr, stamp_base + 2, local)
        if EPILOGUE == 0:
            rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
            cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
            row, col = gl.expand_dims(rows, 1).to(gl.int64), gl.expand_dims(cols, 0)
            gl.store(out_ptr + row * N + col, acc.to(out_ptr.dtype.element_ty), mask=(row < M) & (col < N))
        else:
            _swiglu_backward_epilogue(acc, local // 2, pid_m, pid_n, M, N, preact_desc, grad_preact_desc, act_desc,
                                      out_ptr, partial_ptr, my_pairs, my_acts, my_bars, timeline_ptr, stamp_base,
                                      stamping)
    tma.store_wait(pendings=0)


@gluon.jit
def pingpong_gemm_kernel(a_desc, b_desc, out_ptr, preact_desc, grad_preact_desc, act_desc, partial_ptr, timeline_ptr,
                         M, N, K, EPILOGUE: gl.constexpr):
    a_slots = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_slots = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BK, BN], b_desc.layout)
    # per consumer: PAIR_BUFFERS [BM, 2 QUARTER] pre-activation / gradient pair buffers and two act buffers
    pairs0 = gl.allocate_shared_memory(preact_desc.dtype, [PAIR_BUFFERS, BM, 2 * QUARTER], preact_desc.layout)
    pairs1 = gl.allocate_shared_memory(preact_desc.dtype, [PAIR_BUFFERS, BM, 2 * QUARTER], preact_desc.layout)
    act_buffers: gl.constexpr = 1 if ACT_IN_REGISTERS else 2  # one unused placeholder when act skips them
    acts0 = gl.allocate_shared_memory(act_desc.dtype, [act_buffers, BM, QUARTER], act_desc.layout)
    acts1 = gl.allocate_shared_memory(act_desc.dtype, [act_buffers, BM, QUARTER], act_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    bars0 = gl.allocate_shared_memory(gl.int64, [PAIR_BUFFERS, 1], mbarrier.MBarrierLayout())
    bars1 = gl.allocate_shared_memory(gl.int64, [PAIR_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(PAIR_BUFFERS):
        mbarrier.init(bars0.index(i), count=1)
        mbarrier.init(bars1.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (a_slots, b_slots, ready, empty, turn, M, N, K, out_ptr, preact_desc, grad_preact_desc, act_desc,
                     partial_ptr, pairs0, acts0, bars0, timeline_ptr, 0, EPILOGUE)),
        (_consumer, (a_slots, b_slots, ready, empty, turn, M, N, K, out_ptr, preact_desc, grad_preact_desc, act_desc,
                     partial_ptr, pairs1, acts1, bars1, timeline_ptr, 1, EPILOGUE)),
        (_producer, (a_desc, b_desc, a_slots, b_slots, ready, empty, M, N, K)),
    ], [CONSUMER_WARPS, 1], [232, 40])


# --------------------------------------------------------------------------------------------------
def _descriptor(t, block):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    block = [int(b) for b in block]
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def pingpong(a, b, preact=None, epilogue=1, timeline=None):
    """``a`` [M, K] @ ``b`` [K, N]; epilogue 0: the product (bf16); 1: SwiGLU backward outputs.
    ``timeline``: int64 [2, TIMELINE_TILES, STAMPS] for the stamps (with CODAGEN_GLUON_TIMELINE=1)."""
    m, k = a.shape
    n = b.shape[1]
    bm, bn, bk, quarter = BM.value, BN.value, BK.value, QUARTER.value
    out = torch.empty(m, n, device=a.device, dtype=a.dtype)
    if epilogue:
        grad_preact = torch.empty(m, 2 * n, device=a.device, dtype=a.dtype)
        partial = torch.empty(m, triton.cdiv(n, bn), device=a.device, dtype=torch.float32)
        epilogue_descs = (_descriptor(preact, [bm, 2 * quarter]), _descriptor(grad_preact, [bm, 2 * quarter]),
                          _descriptor(out, [bm, quarter]))
    else:
        partial = out
        epilogue_descs = (_descriptor(out, [bm, 2 * quarter]),) * 2 + (_descriptor(out, [bm, quarter]),)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = (min(tiles, torch.cuda.get_device_properties(a.device).multi_processor_count),)
    if timeline is None:
        timeline = torch.empty(1, device=a.device, dtype=torch.int64)
    pingpong_gemm_kernel[grid](_descriptor(a, [bm, bk]), _descriptor(b, [bk, bn]), out, *epilogue_descs, partial,
                               timeline, m, n, k, EPILOGUE=epilogue, num_warps=CONSUMER_WARPS.value)
    return (grad_preact, out, partial.sum(1)) if epilogue else out


def compile_only(epilogue: int = 1, dump: str | None = None) -> int:
    """Compile for sm_90 without a GPU: shared memory, warps, wgmma count, and ptxas's register/spill report."""
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(rows, cols):
        layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {cols}],{layout!r}>"
    bm, bn, bk, quarter = BM.value, BN.value, BK.value, QUARTER.value
    signature = {"a_desc": desc(bm, bk), "b_desc": desc(bk, bn), "out_ptr": "*bf16",
                 "preact_desc": desc(bm, 2 * quarter), "grad_preact_desc": desc(bm, 2 * quarter),
                 "act_desc": desc(bm, quarter), "partial_ptr": "*fp32", "timeline_ptr": "*i64",
                 "M": "i32", "N": "i32", "K": "i32",
                 "EPILOGUE": "constexpr"}
    source = GluonASTSource(pingpong_gemm_kernel, signature, constexprs={"EPILOGUE": epilogue})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": CONSUMER_WARPS.value})
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:  # Triton's cubin carries no spill count: ask ptxas
        with open(f"{tmp}/kernel.ptx", "w") as f:
            f.write(ptx)
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f"{tmp}/kernel.ptx", "-o",
                                 f"{tmp}/kernel.cubin"], capture_output=True, text=True).stderr
    spills = " ".join(line.strip() for line in report.splitlines() if "spill" in line)
    print(f"epilogue {epilogue}: shared {kernel.metadata.shared} B, warps {kernel.metadata.num_warps}, "
          f"wgmma {ptx.count('wgmma.mma_async')}, setmaxnreg {ptx.count('setmaxnreg')}; ptxas: {spills}")
    if dump:
        for ext in ("ttgir", "ptx"):
            with open(f"{dump}/pingpong_epilogue{epilogue}.{ext}", "w") as f:
                f.write(kernel.asm[ext])
    return 0


def timeline_report(a, b, preact) -> dict:
    """Mean phase times (us) of CTA 0's consumers over tiles 1 .. TIMELINE_TILES - 2 of one SwiGLU-backward run."""
    stamps = torch.zeros(2, TIMELINE_TILES.value, STAMPS.value, device=a.device, dtype=torch.int64)
    pingpong(a, b, preact, timeline=stamps)
    t = stamps.double().cpu() / 1e3  # us
    phases = {"turn wait": t[..., 1] - t[..., 0], "mainloop": t[..., 2] - t[..., 1],
              **{f"piece {p}": t[..., 3 + p] - t[..., 2 + p] for p in range(4)},
              "epilogue": t[..., 6] - t[..., 2]}
    phases["period"] = torch.cat((t[:, 1:, 0] - t[:, :-1, 0], torch.zeros(2, 1, dtype=t.dtype)), dim=1)
    inner = slice(1, TIMELINE_TILES.value - 1)
    return {name: round(v[:, inner].mean().item(), 3) for name, v in phases.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", nargs="+", default=["d2048", "llama3-1b", "llama3-8b"])
    args = p.parse_args(argv)
    from codagen.backends import execute
    from codagen.bench.common import environment, median_ms
    from codagen.epilogue import library

    torch.manual_seed(0)
    records = []
    # ragged edges first: M, N not tile multiples (TMA zero-fills the operands, the masks drop the rest)
    a = torch.randn(1000, 520, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(520, 1000, device="cuda", dtype=torch.bfloat16) / 520 ** 0.5
    preact = torch.randn(1000, 2000, device="cuda", dtype=torch.bfloat16)
    ref = execute(library.swiglu_backward(), a, b, preact=preact)
    grad_preact, act, z_dz = pingpong(a, b, preact)
    print("ragged 1000x1000x520: product err", (pingpong(a, b, epilogue=0).float() - (a @ b).float()).abs().max().item(),
          "grad_preact err", (grad_preact.float() - ref["grad_preact"].float()).abs().max().item(),
          "act err", (act.float() - ref["act"].float()).abs().max().item(), flush=True)
    shapes = {"d2048": (16384, 5632, 2048), "llama3-1b": (16384, 8192, 2048), "llama3-8b": (16384, 14336, 4096)}
    variant = {"schedule": ",".join(_schedule), "ablate": "+".join(sorted(_ablate)),
               "sigmoid": "fast" if FAST_SIGMOID else "precise"}
    for name in args.shapes:
        m, n, k = shapes[name]
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        preact = torch.randn(m, 2 * n, device="cuda", dtype=torch.bfloat16)
        # correctness: the product, then the SwiGLU-backward outputs against codagen's Triton kernel
        want = a @ b
        got = pingpong(a, b, epilogue=0)
        product_err = (got.float() - want.float()).abs().max().item()
        ref = execute(library.swiglu_backward(), a, b, preact=preact)
        grad_preact, act, z_dz = pingpong(a, b, preact)
        errs = {"grad_preact": (grad_preact.float() - ref["grad_preact"].float()).abs().max().item(),
                "act": (act.float() - ref["act"].float()).abs().max().item(),
                "z_dz": (z_dz - ref["partial_z_dz"].float().sum(1)).abs().max().item() / z_dz.abs().max().item()}
        times = {"cublas_gemm": median_ms(lambda: torch.mm(a, b), 25, 200),
                 "pingpong_plain": median_ms(lambda: pingpong(a, b, epilogue=0), 25, 200),
                 "pingpong_swiglu_bwd": median_ms(lambda: pingpong(a, b, preact), 25, 200),
                 "codagen_swiglu_bwd": median_ms(lambda: execute(library.swiglu_backward(), a, b, preact=preact),
                                                 25, 200)}
        for provider, ms in times.items():
            records.append({"suite": "gluon_pingpong", "name": "swiglu_backward", "pass": "bwd",
                            "shape": {"M": m, "N": n, "K": k, "model": name}, "provider": provider, "median_ms": ms,
                            **variant})
        print(f"{name:10s} M{m} N{n} K{k}  product err {product_err:.3g}  " +
              "  ".join(f"{key} err {v:.3g}" for key, v in errs.items()))
        print(f"{name:10s} " + "  ".join(f"{key} {v:.3f} ms" for key, v in times.items()), flush=True)
        if TIMELINE:
            phases = timeline_report(a, b, preact)
            records.append({"suite": "gluon_pingpong", "name": "swiglu_backward_timeline_us",
                            "shape": {"M": m, "N": n, "K": k, "model": name}, "phases": phases, **variant})
            print(f"{name:10s} timeline (us): " + "  ".join(f"{key} {v:.2f}" for key, v in phases.items()),
                  flush=True)
    if args.out:
        with open(f"{args.out}/gluon_pingpong.json", "w") as f:
            json.dump({"env": environment(), "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        sys.exit(compile_only(0) or compile_only(1))
    sys.exit(main())
