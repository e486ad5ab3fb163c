"""The Triton backend: plan and launch a program's fused kernel.

A call is checked (:meth:`TritonBackend._check`), planned once per call signature (the kernel from
:mod:`.modules`, TMA eligibility, a configuration from :mod:`.configs` or timed here) and launched:
compiled for CUDA tensors, in the Triton interpreter for CPU tensors (:mod:`.interpreter`).
"""
from __future__ import annotations

import functools
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import triton
import triton.testing
from triton.runtime.errors import OutOfResources

from codagen.backends.device import on_device
from codagen.epilogue.bind import BoundProgram, cdiv
from codagen.epilogue.ir import Gemm, Program, ProgramError, Store

from . import ahead, arrivals, dependent_launch, pingpong, targets
from .configs import KernelConfig, TuningCache, candidates, gemm_layout, interpreter_config
from .gluon_support import pingpong_unsupported
from .interpreter import check_numpy, interpreting
from .modules import load_kernel, program_source
from .switches import env_flag
from .targets import Target
from .tuning import TRITON_DTYPE, kernel_hash, tuning_key

__all__ = ["TritonBackend", "program_source", "load_kernel", "tuning_key", "kernel_hash", "SUPPORTED_DTYPES"]

#: operand dtypes the Triton backend multiplies (float64 stays with the reference backend)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)


def _scratch_alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _set_allocator() -> None:
    """Device-side tensor descriptors need a little global scratch memory per launch.

    Triton keeps the allocator in a ContextVar, which a new thread does not inherit: autograd runs
    backward on its own device threads, so this is set before every launch (a cheap ContextVar set),
    not once per process.
    """
    triton.set_allocator(_scratch_alloc)


set_scratch_allocator = _set_allocator  # for scripts that launch generated kernels themselves (bench/pingpong_ab.py)


# --------------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------------
@dataclass
class _Launch:
    """Everything one launch needs except the config."""
    kernel: object
    dtypes: str
    arch: str
    args: list
    m: int
    n: int
    k: int
    tma_mainloop: bool
    tma_epilogue_ok: bool
    upcast: bool
    precision: str
    interpret: bool
    portable: bool = False  # the device math without inline PTX (interpreter, AMD: .targets)
    pdl: bool = False  # launched as a programmatic dependent (decode rows: .dependent_launch)
    pingpong_kernel: object = None  # loaded on first use
    split_k_kernel: object = None  # loaded on first use
    pingpong_slots: dict = field(default_factory=dict)  # piece width -> tile-operand slots
    metas: dict = field(default_factory=dict)  # config -> the kernel's constexpr arguments

    def pingpong(self, program: Program):
        if self.pingpong_kernel is None:
            self.pingpong_kernel = load_kernel(program, dtypes=self.dtypes, arch=self.arch, interpret=False,
                                               schedule="pingpong")
        return self.pingpong_kernel

    def split_k(self, program: Program):
        if self.split_k_kernel is None:
            self.split_k_kernel = load_kernel(program, dtypes=self.dtypes, arch=self.arch, interpret=self.interpret,
                                              function="split_k_kernel")
        return self.split_k_kernel


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a 16-byte aligned base, a row stride that is a non-zero multiple of 16 bytes."""
    if t.dim() != 2 or t.shape[1] == 0:
        return False
    return ahead.byte_offset(t) % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


class TritonBackend:
    """Fused Triton kernels: one launch per program (see the package docstring).

    ``config``: force one :class:`KernelConfig` (tests, benchmarks); otherwise :meth:`_choose` picks one.
    ``autotune``: time the candidates of a (program, dtypes, shape bucket) that has no tuned entry on
    this GPU on its first use, and cache the fastest; default from ``CODAGEN_TRITON_AUTOTUNE`` (``1``
    times, unset or ``0`` never does: the tuned entry, else the nearest tuned entry, else a heuristic,
    see :mod:`.configs`). ``CODAGEN_TRITON_RETUNE=1`` (with tuning on) times keys that have an entry too.
    ``tma``: ``False`` forces the pointer-load mainloop and epilogue even where TMA is possible.
    ``choices``: tuning key -> where its config came from (``tuned``, ``nearest``, ``layout``,
    ``heuristic``, ``timed``), and ``chosen``: tuning key -> that config, for ``codagen tune`` and the benchmarks.
    """
    name = "triton"

    def __init__(self, config: KernelConfig | None = None, autotune: bool | None = None, tma: bool = True,
                 verbose: bool | None = None):
        self.config = config
        self.autotune = autotune
        self.tma = tma
        self.verbose = verbose
        self.tuning = TuningCache()
        self.launches = 0           # kernel launches made by this backend object (tests count them)
        self.plans_made = 0         # call signatures planned (kernel loaded, config chosen): tests count them
        self._plans: dict[tuple, tuple[Program, _Launch, KernelConfig]] = {}
        self.last_config: KernelConfig | None = None
        self.choices: dict[str, str] = {}
        self.chosen: dict[str, KernelConfig] = {}

    # -- checks ------------------------------------------------------------------------------------
    def _check(self, bound: BoundProgram) -> tuple[bool, Target | None]:
        """(interpret?, the GPU's :class:`.targets.Target`, ``None`` when interpreted); raises on what this backend
        cannot run."""
        dev = bound.device
        name, fp8 = bound.program.name, bound.dtype == torch.float8_e4m3fn
        if bound.dtype not in SUPPORTED_DTYPES:
            raise ProgramError(f"{name}: the triton backend multiplies float16, bfloat16, float32 or float8_e4m3fn "
                               f"operands, got a: {bound.dtype}; use backend='reference' for {bound.dtype}")
        if dev.type == "cpu":
            check_numpy()
            return True, None
        if dev.type != "cuda":
            raise ProgramError(f"{name}: the triton backend runs CUDA tensors (compiled) and CPU "
                               f"tensors (interpreted), got device {dev}")
        try:
            target = targets.of_device(dev)
        except RuntimeError as error:
            raise ProgramError(f"{name}: {error}") from None
        if fp8 and target.fp8_mma is None:
            raise ProgramError(f"{name}: float8_e4m3fn operands need an e4m3 matrix instruction, which "
                               f"{target.name} lacks (targets with one: "
                               f"{[t.name for t in targets.TARGETS.values() if t.fp8_mma]})")
        return False, target

    def _prepare(self, bound: BoundProgram, interpret: bool, target: Target | None) -> _Launch:
        program = bound.program
        dtypes = ",".join(f"{n}:{TRITON_DTYPE.get(t.dtype, str(t.dtype))}" for n, t in
                          [("a", bound.a)] + sorted(bound.tensors.items()))
        arch = "interpreter" if interpret else target.name
        kernel = load_kernel(program, dtypes=dtypes, arch=arch, interpret=interpret)
        m, n, k = bound.m, bound.n, bound.k
        tma_hw = interpret or target.tma
        tma_mainloop = self.tma and tma_hw and k > 0 and _tma_ok(bound.a) and _tma_ok(bound.b)
        tiles = [bound.tensors[name] for name, e in program.inputs.items() if e.kind == "tile"]
        tiles += [bound.tensors[o.name] for o in program.outputs if isinstance(o, Store) and o.accumulate]
        tma_epilogue_ok = self.tma and tma_hw and all(_tma_ok(t) for t in tiles)
        if tma_epilogue_ok:  # the outputs we allocate have the row lengths N*w in their store dtype
            for o in program.outputs:
                if isinstance(o, Store) and not o.accumulate:
                    row_bytes = o.value.width.columns(n) * torch.empty((), dtype=bound.store_dtype(o)).element_size()
                    tma_epilogue_ok &= row_bytes % 16 == 0 and row_bytes > 0
        fp32 = bound.dtype == torch.float32
        return _Launch(kernel=kernel, dtypes=dtypes, arch=arch, args=[], m=m, n=n, k=k, tma_mainloop=tma_mainloop,
                       tma_epilogue_ok=tma_epilogue_ok,
                       upcast=interpret and bound.dtype in (torch.bfloat16, torch.float8_e4m3fn),
                       precision="ieee" if interpret else target.dot_precision(fp32),
                       interpret=interpret, portable=interpret or target.portable,
                       pdl=not interpret and target.ptx
                       and dependent_launch.enabled(m, bound.device))

    # -- launching ---------------------------------------------------------------------------------
    def _launch(self, bound: BoundProgram, launch: _Launch, cfg: KernelConfig, outs: dict[str, torch.Tensor]):
        with on_device(bound.device):
            self._launch_here(bound, launch, cfg, outs)

    def _launch_here(self, bound: BoundProgram, launch: _Launch, cfg: KernelConfig, outs: dict[str, torch.Tensor]):
        program = bound.program
        if cfg.schedule == "pingpong":  # validated once per call signature, in _choose
            slots = launch.pingpong_slots.get(cfg.sub_n)
            if slots is None:
                slots = pingpong.input_slots(bound, cfg.sub_n, _smem_limit(bound.device))
                launch.pingpong_slots[cfg.sub_n] = slots
            pingpong.launch(launch.pingpong(program), bound, outs, cfg.sub_n, slots, _num_sms(bound.device))
            self.launches += 1
            return
        if cfg.split_k > 1:
            kernel = launch.split_k(program)
            grid, meta = launch.metas.get(cfg) or self._split_k_meta(bound, launch, cfg)
            args = _split_k_arguments(bound, launch, cfg, outs)
        else:
            kernel = launch.kernel
            grid, meta = launch.metas.get(cfg) or self._meta(bound, launch, cfg)
            args = _persistent_arguments(bound, launch, outs)
        if launch.interpret:
            with interpreting():
                kernel[grid](*args, **meta)
        else:
            _set_allocator()
            ahead.launch_kernel(kernel, grid, *args, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        self.launches += 1

    def _compile_ahead(self, bound: BoundProgram, launch: _Launch, pool: list[KernelConfig]) -> None:
        """Compile the persistent kernel of every config in ``pool`` at once, in worker threads (Triton's
        compiler releases the GIL, and ``ptxas`` is a process of its own), so that timing them one after
        the other finds them compiled. Compilation specializes on dtypes, 16-byte alignment and the ints,
        not on addresses: the outputs are passed as their dtypes (Triton's ``warmup`` takes a dtype for a
        tensor), nothing is allocated. A config that fails here fails again, and is handled, when timed."""
        calls = []
        for cfg in pool:
            # compiled when timed: the ping-pong kernel's host-side descriptors need the outputs; split-K is
            # another kernel of the module
            if cfg.schedule == "pingpong" or cfg.split_k > 1:
                continue
            outs = {name: bound.tensors[name] if shape is None else dtype
                    for name, shape, dtype in bound.output_specs(cfg.block_m, cfg.block_n)}
            grid, meta = launch.metas.get(cfg) or self._meta(bound, launch, cfg)
            calls.append(functools.partial(launch.kernel.warmup, *_persistent_arguments(bound, launch, outs),
                                           grid=grid, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        if len(calls) < 2:
            return

        def compile_one(call):
            try:
                with on_device(bound.device):  # a worker thread starts on the default device
                    call()
            except Exception:  # noqa: BLE001 - reported by the timing run of the same config
                pass
        compile_one(calls[0])  # the first compile of a kernel sets up its binder: not from two threads at once
        with ThreadPoolExecutor(max_workers=min(len(calls) - 1, os.cpu_count() or 1)) as workers:
            list(workers.map(compile_one, calls[1:]))

    def _grid(self, bound: BoundProgram, launch: _Launch, work: int) -> tuple[int]:
        """A persistent grid over ``work`` tiles: one program per SM at most."""
        if launch.interpret:
            return (min(work, 3),)  # several tiles per program: the persistent loop is exercised
        return (min(work, _num_sms(bound.device)),)

    def _split_k_meta(self, bound: BoundProgram, launch: _Launch, cfg: KernelConfig) -> tuple[tuple[int], dict]:
        """``(grid, constexpr arguments)`` of a split-K launch, kept in ``launch.metas``: persistent over
        tiles x K ranges."""
        meta = dict(_common_meta(launch, cfg), SPLIT_K=cfg.split_k, TMA_EPILOGUE=False)
        launch.metas[cfg] = self._grid(bound, launch, _tiles(launch, cfg) * cfg.split_k), meta
        return launch.metas[cfg]

    def _meta(self, bound: BoundProgram, launch: _Launch, cfg: KernelConfig) -> tuple[tuple[int], dict]:
        """``(grid, constexpr arguments)`` of a persistent launch of ``cfg``, kept in ``launch.metas``:
        they depend on the call signature and the config only."""
        grid = self._grid(bound, launch, _tiles(launch, cfg))
        meta = dict(_common_meta(launch, cfg), GROUP_M=cfg.group_m,
                    TMA_EPILOGUE=cfg.tma_epilogue and launch.tma_epilogue_ok)
        if bound.program.gemm.low_rank:  # the rank loop's step: at least the dot's minimum inner size 16, at most
            # BLOCK_K
            meta["BLOCK_R"] = max(16, min(cfg.block_k, 1 << (bound.r - 1).bit_length()))
        launch.metas[cfg] = grid, meta
        return grid, meta

    def clear_plans(self) -> None:
        """Forget every planned call signature: each plans again on its next call (after launch settings
        such as :mod:`.dependent_launch`'s changed; a captured CUDA graph keeps the launches it recorded)."""
        self._plans.clear()

    def run(self, bound: BoundProgram) -> dict[str, torch.Tensor]:
        interpret, target = self._check(bound)
        if bound.m == 0 or bound.n == 0:
            cfg = self.config or (interpreter_config(bound.program) if interpret
                                  else KernelConfig(128, 256, 64, 3, 8, 2))
            return bound.allocate_outputs(cfg.block_m, cfg.block_n)
        if ahead.tracing():
            return self._compile_for_trace(bound, interpret, target)
        launch, cfg, specs = self._plan(bound, interpret, target)
        outs = bound.allocate_outputs(cfg.block_m, cfg.block_n, specs)
        self._launch(bound, launch, cfg, outs)
        self.last_config = cfg
        return outs

    def _compile_for_trace(self, bound: BoundProgram, interpret: bool,
                           target: Target | None) -> dict[str, torch.Tensor]:
        """A dry run's call (fake tensors, :mod:`.ahead`): the kernel of the config a real call would choose
        submitted for compilation, the outputs allocated (fakes). Nothing is remembered: the real call plans
        again with real addresses. A key that would be timed is left to its real call (which compiles its
        candidates at once)."""
        launch = self._prepare(bound, interpret, target)
        if not interpret and self.config is None and self._times(self._tuning_key(bound, launch)):
            return bound.allocate_outputs(128, 256)
        cfg = self._choose(bound, launch, interpret)
        outs = bound.allocate_outputs(cfg.block_m, cfg.block_n)
        launches = self.launches
        self._launch(bound, launch, cfg, outs)
        self.launches = launches  # nothing ran
        return outs

    def _plan(self, bound: BoundProgram, interpret: bool,
              target: Target | None) -> tuple[_Launch, KernelConfig, tuple]:
        """The kernel, config and output specs (:meth:`BoundProgram.output_specs`) for this call, remembered
        per call signature.

        Loading the kernel and choosing its config cost a millisecond or more of Python (candidate
        pruning, cache keys); a training step repeats the same few signatures, so after the first
        call a step pays one dictionary lookup per launch instead (``plans_made`` counts the misses).
        """
        a, b = bound.a, bound.b
        signature = (id(bound.program), a.device, a.dtype, a.shape, b.shape, a.data_ptr() % 16, b.data_ptr() % 16,
                     *[(name, t.dtype, t.shape, t.data_ptr() % 16) for name, t in bound.tensors.items()])
        plan = self._plans.get(signature)
        if plan is None or plan[0] is not bound.program:  # the id of a collected program can be reused
            launch = self._prepare(bound, interpret, target)
            cfg = self._choose(bound, launch, interpret)
            plan = (bound.program, launch, cfg, bound.output_specs(cfg.block_m, cfg.block_n))
            self._plans[signature] = plan
            self.plans_made += 1
        return plan[1], plan[2], plan[3]

    def launcher(self, bound: BoundProgram):
        """``(launch, outputs, config)``: a zero-argument function that re-runs the kernel into
        ``outputs`` (allocated once, poisoned). For benchmarks, which time the kernel alone."""
        interpret, target = self._check(bound)
        if bound.m == 0 or bound.n == 0:
            raise ProgramError(f"{bound.program.name}: nothing to launch for M = {bound.m}, N = {bound.n}")
        launch, cfg, specs = self._plan(bound, interpret, target)
        outs = bound.allocate_outputs(cfg.block_m, cfg.block_n, specs)
        return (lambda: self._launch(bound, launch, cfg, outs)), outs, cfg

    # -- tuning ------------------------------------------------------------------------------------
    def _choose(self, bound: BoundProgram, launch: _Launch, interpret: bool) -> KernelConfig:
        if self.config is not None:
            if self.config.split_k > 1 and bound.program.gemm.low_rank:
                raise ProgramError(f"{bound.program.name}: split_k > 1 is not supported with a low-rank operand "
                                   f"pair; use split_k=1")
            if self.config.schedule == "pingpong":
                name = bound.program.name
                if (reason := pingpong_unsupported()) is not None:
                    raise ProgramError(f"{name}: {reason}; use a persistent configuration")
                reason = pingpong.refusal(bound.program)
                if reason:
                    raise ProgramError(f"{name}: the ping-pong kernel cannot compute this program: {reason}; "
                                       f"use a persistent configuration")
                if interpret or not (launch.tma_mainloop and launch.tma_epilogue_ok):
                    raise ProgramError(f"{name}: the ping-pong kernel runs on sm_90 with K > 0 and every operand "
                                       "TMA-aligned (row strides and base addresses multiples of 16 bytes)")
                reason = pingpong.refuses(bound, self.config.sub_n, _smem_limit(bound.device))
                if reason:
                    raise ProgramError(f"{name}: the ping-pong kernel cannot run these tensors: {reason}")
            return self.config
        if interpret:
            return interpreter_config(bound.program)
        pool = self._candidates(bound, launch)
        key = self._tuning_key(bound, launch)
        if len(pool) > 1 and self._times(key):
            cfg, source = self._tune(bound, launch, pool, key), "timed"
        else:
            lookup = key
            if key not in self.tuning:  # until it has a choice of its own, the nearest tuned relative's stands in
                lookup = next((stand_in for stand_in in (self._tuning_key(relative, launch)
                                                         for relative in _tuning_relatives(bound))
                               if stand_in in self.tuning), key)
            cfg, source = self.tuning.choose(lookup, gemm_layout(bound.program), bound.program, pool, bound.k)
        self.choices[key], self.chosen[key] = source, cfg
        return cfg

    def _times(self, key: str) -> bool:
        """Whether a call with tuning key ``key`` times its candidates (on its first use)."""
        return self._autotuning() and (key not in self.tuning or env_flag("CODAGEN_TRITON_RETUNE", default=False))

    def _autotuning(self) -> bool:
        if self.autotune is not None:
            return self.autotune
        return env_flag("CODAGEN_TRITON_AUTOTUNE", default=False)

    def _candidates(self, bound: BoundProgram, launch: _Launch) -> list[KernelConfig]:
        """The configurations this GPU can run for these tensors, best guess first."""
        dev = bound.device
        smem_limit = _smem_limit(dev)
        pool = candidates(bound.program, target=targets.of_device(dev).name,
                          operand_bytes=bound.a.element_size(), smem_limit=smem_limit, tma=launch.tma_mainloop,
                          tma_epilogue=launch.tma_epilogue_ok, m=bound.m, n=bound.n, num_sms=_num_sms(dev))
        if any(cfg.schedule == "pingpong" for cfg in pool):  # the estimate assumed 2-byte tiles
            pool = [cfg for cfg in pool
                    if cfg.schedule != "pingpong" or not pingpong.refuses(bound, cfg.sub_n, smem_limit)]
        return pool

    def tuning_trials(self, bound: BoundProgram):
        """``(key, pool, trial)`` of ``bound`` on its GPU: its tuning key, the configurations that can run
        it, and ``trial(cfg)``, a zero-argument run of one (tuning over several shapes: bench/tune_buckets.py)."""
        launch = self._prepare(bound, *self._check(bound))
        return (self._tuning_key(bound, launch), self._candidates(bound, launch),
                functools.partial(self._trial, bound, launch))

    def _trial(self, bound: BoundProgram, launch: _Launch, cfg: KernelConfig):
        """A zero-argument function that runs ``cfg`` into scratch outputs (accumulated outputs are
        cloned, so timing never changes the caller's tensors)."""
        scratch = {**bound.tensors, **{n: bound.tensors[n].clone() for n in bound.program.accumulated_outputs()}}
        sb = BoundProgram(bound.program, bound.a, bound.b, bound.m, bound.n, bound.k, scratch)
        outs = sb.allocate_outputs(cfg.block_m, cfg.block_n)
        return lambda: self._launch(sb, launch, cfg, outs)

    def _tuning_key(self, bound: BoundProgram, launch: _Launch) -> str:
        return tuning_key(torch.cuda.get_device_name(bound.device), bound, launch.tma_mainloop, launch.tma_epilogue_ok)

    def _tune(self, bound: BoundProgram, launch: _Launch, pool: list[KernelConfig], key: str) -> KernelConfig:
        verbose = self.verbose if self.verbose is not None else True
        start = time.perf_counter()
        announced = False
        timings: dict[str, float] = {}
        best, best_ms = None, float("inf")
        self._compile_ahead(bound, launch, pool)
        for i, cfg in enumerate(pool):
            run = self._trial(bound, launch, cfg)
            try:
                ms = self._time(run)
            except OutOfResources as e:
                timings[cfg.short()] = float("nan")
                if verbose and announced:
                    print(f"  {cfg.short()}: out of resources ({e})", file=sys.stderr)
                continue
            timings[cfg.short()] = ms
            if ms < best_ms:
                best, best_ms = cfg, ms
            elapsed = time.perf_counter() - start
            if verbose and (announced or elapsed > 2.0):
                if not announced:
                    print(f"codagen: tuning {bound.program.name} M={bound.m} N={bound.n} K={bound.k} "
                          f"({len(pool)} configs)", file=sys.stderr)
                    announced = True
                print(f"  [{i + 1}/{len(pool)}] {cfg.short()}: {ms:.3f} ms", file=sys.stderr)
        if best is None:
            raise RuntimeError(f"{bound.program.name}: no kernel configuration fits this GPU; tried "
                               f"{[c.short() for c in pool]}")
        if verbose and announced:
            print(f"  -> {best.short()} ({best_ms:.3f} ms)", file=sys.stderr)
        self.tuning.put(key, best, timings, gemm_layout(bound.program))
        return best

    @staticmethod
    def _time(run) -> float:
        """Median milliseconds of ``run`` (one candidate's launch); the first call compiles it (and raises
        ``OutOfResources`` for a candidate that does not fit)."""
        run()
        return triton.testing.do_bench(run, warmup=10, rep=40, return_mode="median")


def _persistent_arguments(bound: BoundProgram, launch: _Launch, outs: dict) -> list:
    """The persistent kernel's positional arguments: operands, the low-rank pair, inputs, outputs, sizes."""
    gemm = bound.program.gemm
    args = [bound.a, bound.b] + [bound.tensors[name] for name in gemm.operand_tensors]
    return args + _epilogue_tensors(bound, outs) + [launch.m, launch.n, launch.k] + ([bound.r] if gemm.low_rank else [])


def _split_k_arguments(bound: BoundProgram, launch: _Launch, cfg: KernelConfig, outs: dict) -> list:
    """The split-K kernel's positional arguments: operands, a scratch ``[split_k * M, N]`` for the K ranges' fp32
    partial tiles, an arrival counter per output tile (its last range sums the partials: :mod:`.arrivals`),
    inputs, outputs, sizes."""
    partial = torch.empty(cfg.split_k * launch.m, launch.n, dtype=torch.float32, device=bound.device)
    operand_tensors = [bound.tensors[name] for name in bound.program.gemm.operand_tensors]
    return ([bound.a, bound.b, *operand_tensors, partial, arrivals.counters(bound.device, _tiles(launch, cfg))]
            + _epilogue_tensors(bound, outs) + [launch.m, launch.n, launch.k])


def _tiles(launch: _Launch, cfg: KernelConfig) -> int:
    """Output tiles of a launch of ``cfg``."""
    return cdiv(launch.m, cfg.block_m) * cdiv(launch.n, cfg.block_n)


def _common_meta(launch: _Launch, cfg: KernelConfig) -> dict:
    """The constexprs every GEMM kernel of a module takes, the persistent and the split-K one alike, with
    programmatic dependent launch's (:mod:`.dependent_launch`: its ``PDL`` constexpr and launch option)."""
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EPILOGUE_SPLIT=cfg.epilogue_split,
                SUB_N=cfg.sub_n, TMA_MAINLOOP=launch.tma_mainloop, UPCAST_OPERANDS=launch.upcast,
                DOT_PRECISION=launch.precision, FLATTEN=not launch.interpret, PORTABLE=launch.portable,
                PREFETCH_K=dependent_launch.PREFETCH_K if launch.pdl else 0,
                **dependent_launch.launch_options(launch.pdl))


def _epilogue_tensors(bound: BoundProgram, outs: dict) -> list:
    """What every kernel's epilogue takes, in order: the program's inputs, then its outputs' tensors."""
    program = bound.program
    outputs = [outs[name] for name in program.output_tensors]
    if program.quantized_codes:  # e4m3 codes as their bits: a uint8 pointer on every target (sm_80 has no e4m3 type)
        outputs = [_as_bits(t) if name in program.quantized_codes else t
                   for name, t in zip(program.output_tensors, outputs)]
    return [bound.tensors[name] for name in program.inputs] + outputs


def _as_bits(out):
    """An e4m3 tensor viewed as uint8, or the uint8 dtype for e4m3 where a dtype stands in for the tensor
    (:meth:`TritonBackend._compile_ahead`)."""
    return torch.uint8 if out is torch.float8_e4m3fn else out.view(torch.uint8)


def _tuning_relatives(bound: BoundProgram) -> list[BoundProgram]:
    """The programs whose tuned choices stand in for ``bound``'s, nearest first: its ``tuning_stand_in`` chain
    (the same GEMM with more epilogue stores, or a like epilogue on the same tiles), each program followed by
    itself without the low-rank pair (which adds a short R loop to the base program's mainloop)."""
    relatives, program = [], bound.program
    while program is not None:
        # a stand-in may read fewer inputs (the QKV program without its bias): its key names only its own
        dropped = set(bound.program.inputs) - set(program.inputs)
        tensors = {name: t for name, t in bound.tensors.items() if name not in dropped}
        if program is not bound.program:
            relatives.append(BoundProgram(program, bound.a, bound.b, bound.m, bound.n, bound.k, tensors))
        if program.gemm.low_rank:
            base = Program(program.name, Gemm(program.gemm.a_layout, program.gemm.b_layout), program.outputs,
                           doc=program.doc)
            tensors = {name: t for name, t in tensors.items() if name not in ("a2", "b2")}
            relatives.append(BoundProgram(base, bound.a, bound.b, bound.m, bound.n, bound.k, tensors))
        program = program.tuning_stand_in
    return relatives


def _smem_limit(device: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 232448)


@functools.cache
def _num_sms_index(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    return _num_sms_index(device.index if device.index is not None else torch.cuda.current_device())
