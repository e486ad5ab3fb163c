"""A warp-specialized ping-pong GEMM with the SwiGLU-backward epilogue (Hopper, Gluon).

The generated ``tl`` kernels run each tile's epilogue after its mainloop on the same warps, so an
epilogue that moves a lot of memory adds to the GEMM's time. The SwiGLU backward
(:func:`codagen.epilogue.library.swiglu_backward`: ``grad_act = grad_out @ W_down`` [M, F], reading the
interleaved pre-activation [M, 2F], writing ``grad_preact`` [M, 2F] and ``act`` [M, F]) moves five
bytes of epilogue traffic per output byte. This kernel is CUTLASS's "ping-pong" schedule written in
Gluon (Triton's explicit-layout language):

- one producer warp streams A/B k-slices by TMA into a ring of ``STAGES`` shared-memory slots;
- two consumer warpgroups take alternate 128 x 128 output tiles (accumulator in registers) and pass
  the tensor cores to each other with a pair of mbarriers at the end of each mainloop, so one runs its
  epilogue while the other runs its mainloop.

The epilogue takes the accumulator in four [128, 32] column pieces (register-local splits of the wgmma
layout). Each piece's ``(g, u)`` pairs arrive by TMA in shared memory (the first two are requested when
the tile starts, so they load under the other consumer's mainloop); ``(dg, du)`` are written back over
them and leave by TMA, as ``act`` does from its own buffer. The per-tile row sums of ``g dg + u du``
go to ``partial_z_dz[m, tile_n]`` as the generated kernels' RowPartial does.

It is a tuning candidate (``KernelConfig.schedule == "pingpong"``), timed against the generated
kernels on sm_90 when every operand is TMA-aligned; docs/triton.md has the measurements.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from codagen.epilogue import library
from codagen.epilogue.ir import Program

from .device_math import SIGMOID_PTX

__all__ = ["implements", "refuses", "launch", "compile_sm90", "BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "CONSUMER_WARPS",
           "SHARED_MEMORY"]

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
SHARED_MEMORY = 229704  # bytes, as compiled for sm_90 (a test checks it); the H100/H200 opt-in limit is 232448
STAGES = 4           # A/B ring slots of 32 KiB; with the epilogue buffers below 224 of the 227 KiB
CONSUMER_WARPS = 4   # one warpgroup per consumer
BM, BN, BK = gl.constexpr(BLOCK_M), gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K)
RING = gl.constexpr(STAGES)
WARPGROUP = gl.constexpr(CONSUMER_WARPS)
QUARTER = gl.constexpr(32)      # the epilogue works on [BM, BN / 4] column pieces
PAIR_BUFFERS = gl.constexpr(2)  # per consumer: (g, u) pieces in flight (pieces 0 and 1 prefetched)
GROUP = gl.constexpr(8)

_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def implements(program: Program) -> bool:
    """Whether ``program`` is the one this kernel computes (the library's SwiGLU backward)."""
    from .codegen import program_key
    return program_key(program) == program_key(library.swiglu_backward())


def refuses(bound) -> str | None:
    """Why this kernel cannot take these tensors (None if it can): the pre-activation must have the
    operands' dtype (one TMA layout for all; the generated kernels take any float dtype there)."""
    preact = bound.tensors["preact"]
    if bound.dtype not in _GL_DTYPE:
        return f"operands must be bfloat16 or float16, got {bound.dtype}"
    if preact.dtype != bound.dtype:
        return f"preact must have the operands' dtype {bound.dtype}, got {preact.dtype}"
    return None


@gluon.jit
def _sigmoid(x):
    # codagen.backends.triton.device_math.sigmoid's PTX: a Gluon kernel cannot call a tl function
    return gl.inline_asm_elementwise(SIGMOID_PTX, "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n):
    """Grouped (L2-friendly) tile order, as the generated kernels'."""
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
            slot = count % RING
            # a slot's first use passes at once (parity 1 of a fresh barrier counts as completed)
            mbarrier.wait(empty.index(slot), ((count // RING) & 1) ^ 1)
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
def _load_piece(preact_desc, buffer, bar, pid_m, pid_n, piece: gl.constexpr):
    mbarrier.expect(bar, preact_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(preact_desc, [pid_m * BM, pid_n * 2 * BN + piece * 2 * QUARTER], bar, buffer)


@gluon.jit
def _swiglu_backward_piece(grad_act, pair_buffer, act_buffer, bar, phase, grad_preact_desc, act_desc,
                           pid_m, pid_n, piece: gl.constexpr):
    """One [BM, QUARTER] column piece; returns its row sums of ``g dg + u du``."""
    layout: gl.constexpr = grad_act.type.layout
    pair_layout: gl.constexpr = gl.join(grad_act, grad_act).type.layout
    mbarrier.wait(bar, phase)
    pairs = pair_buffer.reshape([BM, QUARTER, 2])
    gate, up = gl.split(pairs.load(pair_layout).to(gl.float32))
    # split's result layout is the piece's written as a linear layout: the conversion is a no-op
    gate, up = gl.convert_layout(gate, layout), gl.convert_layout(up, layout)
    sig = _sigmoid(gate)
    silu = gate * sig
    d_gate = grad_act * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = grad_act * silu
    pairs.store(gl.join(d_gate, d_up).to(pair_buffer.dtype))
    act_buffer.store((silu * up).to(act_buffer.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(grad_preact_desc, [pid_m * BM, pid_n * 2 * BN + piece * 2 * QUARTER],
                                    pair_buffer)
    tma.async_copy_shared_to_global(act_desc, [pid_m * BM, pid_n * BN + piece * QUARTER], act_buffer)
    return gl.sum(gate * d_gate + up * d_up, axis=1)


@gluon.jit
def _epilogue_step(piece, p: gl.constexpr, iteration, pid_m, pid_n, preact_desc, grad_preact_desc, act_desc,
                   pair_buffers, act_buffers, bars):
    """Piece p, then the load of piece p + 1 into piece p - 1's buffer once piece p - 1's two stores
    have read it (piece p's are issued by then, so the wait rarely waits)."""
    loads_per_tile: gl.constexpr = (4 - p % PAIR_BUFFERS + PAIR_BUFFERS - 1) // PAIR_BUFFERS  # into p's buffer
    phase = (iteration * loads_per_tile + p // PAIR_BUFFERS) & 1
    partial = _swiglu_backward_piece(piece, pair_buffers.index(p % PAIR_BUFFERS), act_buffers.index(p % 2),
                                     bars.index(p % PAIR_BUFFERS), phase, grad_preact_desc, act_desc, pid_m, pid_n, p)
    if p >= 1 and p - 1 + PAIR_BUFFERS < 4:
        tma.store_wait(pendings=2)  # piece p - 1's stores are done with its buffers
        _load_piece(preact_desc, pair_buffers.index((p - 1) % PAIR_BUFFERS), bars.index((p - 1) % PAIR_BUFFERS),
                    pid_m, pid_n, p - 1 + PAIR_BUFFERS)
    return partial


@gluon.jit
def _consumer(a_slots, b_slots, ready, empty, turn, M, N, K, preact_desc, grad_preact_desc, act_desc,
              partial_ptr, pair_buffers, act_buffers, bars, WHICH: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    num_pid_m, num_pid_n = gl.cdiv(M, BM), gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    my_tiles = gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), gl.num_programs(0))
    if WHICH == 0:
        mbarrier.arrive(turn.index(0))  # consumer 0 takes the first turn
    for local in range(WHICH, my_tiles, 2):
        tile = gl.program_id(0) + local * gl.num_programs(0)
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n)
        # the first PAIR_BUFFERS pieces of (g, u) load while the mainloops run; their buffers are free
        # once the last tile's stores have read them
        tma.store_wait(pendings=0)
        for p in gl.static_range(PAIR_BUFFERS):
            _load_piece(preact_desc, pair_buffers.index(p), bars.index(p), pid_m, pid_n, p)
        base = local * k_steps  # ring position of this tile's first k-slice (the producer's order)
        mbarrier.wait(turn.index(WHICH), (local // 2) & 1)
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
        for kk in range(k_steps):
            count = base + kk
            slot = count % RING
            mbarrier.wait(ready.index(slot), (count // RING) & 1)
            acc = warpgroup_mma(a_slots.index(slot), b_slots.index(slot), acc, use_acc=kk > 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))  # the previous slice's MMA is done: free its slot
            mbarrier.arrive(empty.index((count + RING - 1) % RING), pred=kk > 0)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((base + k_steps - 1) % RING))
        mbarrier.arrive(turn.index(1 - WHICH))  # the tensor cores pass to the other consumer
        left, right = _halves(acc)
        q0, q1 = _halves(left)
        q2, q3 = _halves(right)
        args = (local // 2, pid_m, pid_n, preact_desc, grad_preact_desc, act_desc, pair_buffers, act_buffers, bars)
        partial = gl.convert_layout(_epilogue_step(q0, 0, *args), row_layout)
        partial += gl.convert_layout(_epilogue_step(q1, 1, *args), row_layout)
        partial += gl.convert_layout(_epilogue_step(q2, 2, *args), row_layout)
        partial += gl.convert_layout(_epilogue_step(q3, 3, *args), row_layout)
        rows = pid_m * BM + gl.arange(0, BM, layout=row_layout)
        gl.store(partial_ptr + rows.to(gl.int64) * num_pid_n + pid_n, partial, mask=rows < M)
    tma.store_wait(pendings=0)


@gluon.jit
def swiglu_backward_pingpong_kernel(a_desc, b_desc, preact_desc, grad_preact_desc, act_desc, partial_ptr, M, N, K):
    a_slots = gl.allocate_shared_memory(a_desc.dtype, [RING, BM, BK], a_desc.layout)
    b_slots = gl.allocate_shared_memory(b_desc.dtype, [RING, BK, BN], b_desc.layout)
    # per consumer: PAIR_BUFFERS [BM, 2 QUARTER] (g, u) -> (dg, du) buffers and two act buffers
    pairs0 = gl.allocate_shared_memory(preact_desc.dtype, [PAIR_BUFFERS, BM, 2 * QUARTER], preact_desc.layout)
    pairs1 = gl.allocate_shared_memory(preact_desc.dtype, [PAIR_BUFFERS, BM, 2 * QUARTER], preact_desc.layout)
    acts0 = gl.allocate_shared_memory(act_desc.dtype, [2, BM, QUARTER], act_desc.layout)
    acts1 = gl.allocate_shared_memory(act_desc.dtype, [2, BM, QUARTER], act_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    bars0 = gl.allocate_shared_memory(gl.int64, [PAIR_BUFFERS, 1], mbarrier.MBarrierLayout())
    bars1 = gl.allocate_shared_memory(gl.int64, [PAIR_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RING):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(PAIR_BUFFERS):
        mbarrier.init(bars0.index(i), count=1)
        mbarrier.init(bars1.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (a_slots, b_slots, ready, empty, turn, M, N, K, preact_desc, grad_preact_desc, act_desc,
                     partial_ptr, pairs0, acts0, bars0, 0)),
        (_consumer, (a_slots, b_slots, ready, empty, turn, M, N, K, preact_desc, grad_preact_desc, act_desc,
                     partial_ptr, pairs1, acts1, bars1, 1)),
        (_producer, (a_desc, b_desc, a_slots, b_slots, ready, empty, M, N, K)),
    ], [WARPGROUP, 1], [232, 40])  # warps and registers of the two worker partitions


# --------------------------------------------------------------------------------------------------
def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPE[t.dtype]))


def launch(a: torch.Tensor, b: torch.Tensor, preact: torch.Tensor, grad_preact: torch.Tensor, act: torch.Tensor,
           partial_z_dz: torch.Tensor, num_sms: int) -> None:
    """One launch: ``a`` [M, K] @ ``b`` [K, N] with the SwiGLU backward of ``preact`` [M, 2N] into
    ``grad_preact`` [M, 2N], ``act`` [M, N] and ``partial_z_dz`` [M, cdiv(N, BLOCK_N)] (fp32).
    Every tensor row-major, 16-byte aligned rows and base (the caller checks: the backend's TMA test)."""
    m, k = a.shape
    n = b.shape[1]
    quarter = QUARTER.value
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    swiglu_backward_pingpong_kernel[(min(tiles, num_sms),)](
        _descriptor(a, [BLOCK_M, BLOCK_K]), _descriptor(b, [BLOCK_K, BLOCK_N]),
        _descriptor(preact, [BLOCK_M, 2 * quarter]), _descriptor(grad_preact, [BLOCK_M, 2 * quarter]),
        _descriptor(act, [BLOCK_M, quarter]), partial_z_dz, m, n, k, num_warps=CONSUMER_WARPS)


def compile_sm90(dtype: torch.dtype = torch.bfloat16):
    """The kernel compiled for sm_90 without a GPU (tests and ``bench/gluon_pingpong.py --compile-only``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]

    def desc(rows, cols):
        layout = gl.NVMMASharedLayout.get_default_for([rows, cols], _GL_DTYPE[dtype])
        return f"tensordesc<{name}[{rows}, {cols}],{layout!r}>"
    quarter = QUARTER.value
    signature = {"a_desc": desc(BLOCK_M, BLOCK_K), "b_desc": desc(BLOCK_K, BLOCK_N),
                 "preact_desc": desc(BLOCK_M, 2 * quarter), "grad_preact_desc": desc(BLOCK_M, 2 * quarter),
                 "act_desc": desc(BLOCK_M, quarter), "partial_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32"}
    source = GluonASTSource(swiglu_backward_pingpong_kernel, signature, constexprs={})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": CONSUMER_WARPS})
