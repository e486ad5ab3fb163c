"""The Triton backend: generate, cache, load, tune and launch a program's fused kernel.

CUDA tensors run compiled kernels; CPU tensors run the same kernels in the Triton interpreter. The
interpreter is normally chosen once, by ``TRITON_INTERPRET=1`` before ``import triton``; here it is
chosen per call: the generated module is loaded a second time with ``triton.knobs.runtime.interpret``
set (so its ``@triton.jit`` functions become interpreted ones), and while it runs, the ``@triton.jit``
functions of ``triton.language`` itself (``tl.zeros``, ``tl.sum``, ...) are called the interpreter's
way (:func:`_interpreting`). Nothing needs exporting before import and GPU kernels are unaffected.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import codagen
from codagen.backends import on_device
from codagen.epilogue.bind import BoundProgram, cdiv
from codagen.epilogue.ir import Gemm, Program, ProgramError, Store, TileInput

from . import codegen
from .configs import KernelConfig, TuningCache, cache_dir, candidates, gemm_layout, interpreter_config
from .gluon_support import pingpong_unsupported

__all__ = ["TritonBackend", "program_source", "load_kernel", "tuning_key", "kernel_hash", "SUPPORTED_DTYPES"]

#: operand dtypes the Triton backend multiplies (float64 stays with the reference backend)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
                 torch.int32: "i32", torch.int64: "i64"}


def _pingpong_version() -> str:
    from . import pingpong_codegen
    return pingpong_codegen.GENERATOR_VERSION


def _versions() -> str:
    import triton
    return f"codagen {codagen.__version__}, generator {codegen.GENERATOR_VERSION}, triton {triton.__version__}, torch {torch.__version__.split('+')[0]}"


_kernel_hashes: dict[str, str] = {}


def kernel_hash(program: Program) -> str:
    """Hash of the code a tuned choice is measured on: the generated ``tl`` kernel (without its version
    line), the device math it imports and, for a program the ping-pong schedule takes, the generated
    Gluon kernel and :mod:`.pingpong`. A choice stays valid until one of them changes, whatever else
    changes in the generators."""
    key = codegen.program_key(program)
    if key not in _kernel_hashes:
        def code_lines(source: str) -> list[str]:
            return [line for line in source.splitlines() if "generator version" not in line]
        here = Path(__file__).parent
        parts = code_lines(codegen.generate(program)) + [_code_of(here / "device_math.py")]
        if pingpong_unsupported() is None:  # the ping-pong kernels exist on this Triton
            from . import pingpong_codegen
            if pingpong_codegen.refusal(program) is None:
                parts += code_lines(pingpong_codegen.generate(program)) + [_code_of(here / "pingpong.py")]
        _kernel_hashes[key] = codegen.source_hash(*parts)
    return _kernel_hashes[key]


def _code_of(path: Path) -> str:
    """A module's lines without docstrings, comment lines and blank lines, so editing those keeps tuned
    choices (a trailing comment still counts). Line-based, not ``ast.dump``: that differs between Python
    versions, and the shipped table must match on every one."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return "\n".join(line.strip() for number, line in enumerate(source.splitlines(), 1)
                     if number not in docstrings and line.strip() and not line.strip().startswith("#"))


def tuning_key(gpu: str, bound: BoundProgram, tma_mainloop: bool, tma_epilogue_ok: bool,
               versions: str | None = None) -> str:
    """What a tuned choice is cached under: GPU name, Triton and torch versions (``versions``: these
    instead of the installed ones), the program and its kernel's code (:func:`kernel_hash`), operand and
    input dtypes, TMA eligibility and the shape bucket (M, N, K rounded up to powers of two)."""
    if versions is None:
        import triton
        versions = f"triton {triton.__version__}, torch {torch.__version__.split('+')[0]}"

    def bucket(x: int) -> int:
        return 1 << max(0, (x - 1).bit_length())
    tensors = ",".join(f"{n}:{_TRITON_DTYPE.get(t.dtype, t.dtype)}" for n, t in sorted(bound.tensors.items()))
    return (f"{gpu}|{versions}|"
            f"{bound.program.name}:{kernel_hash(bound.program)}|a:{_TRITON_DTYPE[bound.dtype]},{tensors}|"
            f"tma:{int(tma_mainloop)}{int(tma_epilogue_ok)}|M{bucket(bound.m)} N{bucket(bound.n)} K{bucket(bound.k)}")


def program_source(program: Program, dtypes: str = "any", arch: str = "any", schedule: str = "persistent") -> str:
    """Readable source of ``program``'s fused kernel: the generated ``tl``
    kernel, or with ``schedule="pingpong"`` the Gluon ping-pong kernel (Hopper)."""
    header = f"# dtypes: {dtypes}; arch: {arch}; {_versions()}\n"
    if schedule == "pingpong":
        from . import pingpong_codegen
        return pingpong_codegen.generate(program, header=header)
    return codegen.generate(program, header=header)


# --------------------------------------------------------------------------------------------------
# Loading generated modules
# --------------------------------------------------------------------------------------------------
_modules: dict[tuple[str, bool], object] = {}
_modules_lock = threading.Lock()


def load_kernel(program: Program, *, dtypes: str, arch: str, interpret: bool, schedule: str = "persistent"):
    """The ``<name>_kernel`` JIT function of ``program``'s ``schedule`` kernel, from a real module file
    in the cache.

    The file name hashes the program, dtypes, arch, schedule and library versions; ``@triton.jit`` reads
    its source with ``inspect``, so it must live in a file, at module level.
    """
    key_text = "\n".join([codegen.program_key(program), dtypes, arch, _versions()] +
                         ([f"pingpong {_pingpong_version()}"] if schedule == "pingpong" else []))
    digest = codegen.source_hash(key_text)
    with _modules_lock:
        module = _modules.get((digest, interpret))
        if module is None:
            stem = program.name + ("_pingpong" if schedule == "pingpong" else "")
            path = cache_dir() / "triton" / "kernels" / f"{stem}_{digest}.py"
            source = program_source(program, dtypes, arch, schedule)
            if not path.exists() or path.read_text() != source:
                from .configs import _atomic_write
                _atomic_write(path, source)
            mod_name = f"codagen_kernels.{stem}_{digest}{'_interpreted' if interpret else ''}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(spec)
            from triton import knobs
            previous = knobs.runtime.interpret
            knobs.runtime.interpret = interpret
            try:
                spec.loader.exec_module(module)
            finally:
                knobs.runtime.interpret = previous
            sys.modules[mod_name] = module
            _modules[(digest, interpret)] = module
    return getattr(module, f"{program.name}_kernel")


_interpret_lock = threading.RLock()
_interpreted_wrappers: dict = {}


@contextlib.contextmanager
def _interpreting():
    """Run ``triton.language``'s own ``@triton.jit`` helpers the interpreter's way, for one launch.

    The interpreter swaps ``triton.language`` builtins for numpy ones while it runs. Triton 3.6 puts
    back what a kernel launch swapped but not what an interpreted helper call swapped (e.g. ``tl.cdiv``'s
    module ``triton.language.core``); left so, a later compile in the same process (a real kernel for
    the GPU) fails inside ``tl.cdiv``. Every attribute swapped during the launch is restored here to
    the value it had before the launch."""
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    def call_interpreted(self, *args, **kwargs):
        wrapper = _interpreted_wrappers.get(self.fn)
        if wrapper is None:
            wrapper = _interpreted_wrappers[self.fn] = interpreter.InterpretedFunction(self.fn)
        return wrapper(*args, **kwargs)

    before: dict[tuple[int, str], tuple[object, str, object]] = {}
    set_attr = interpreter._LangPatchScope.set_attr

    def recording_set_attr(scope, obj, name, value):
        before.setdefault((id(obj), name), (obj, name, getattr(obj, name, interpreter._MISSING)))
        set_attr(scope, obj, name, value)

    with _interpret_lock, np.errstate(all="ignore"):  # masked-off lanes are computed too (log 0, x / 0)
        original = JITFunction.__call__
        JITFunction.__call__ = call_interpreted
        interpreter._LangPatchScope.set_attr = recording_set_attr
        try:
            yield
        finally:
            JITFunction.__call__ = original
            interpreter._LangPatchScope.set_attr = set_attr
            for obj, name, value in before.values():
                if value is interpreter._MISSING:
                    if name in vars(obj):
                        delattr(obj, name)
                else:
                    setattr(obj, name, value)


def _scratch_alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _set_allocator() -> None:
    """Device-side tensor descriptors need a little global scratch memory per launch.

    Triton keeps the allocator in a ContextVar, which a new thread does not inherit: autograd runs
    backward on its own device threads, so this is set before every launch (a cheap ContextVar set),
    not once per process.
    """
    import triton
    triton.set_allocator(_scratch_alloc)


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
    pingpong_kernel: object = None  # loaded on first use
    pingpong_slots: dict = field(default_factory=dict)  # piece width -> tile-operand slots

    def pingpong(self, program: Program):
        if self.pingpong_kernel is None:
            self.pingpong_kernel = load_kernel(program, dtypes=self.dtypes, arch=self.arch, interpret=False,
                                               schedule="pingpong")
        return self.pingpong_kernel


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a 16-byte aligned base, a row stride that is a non-zero multiple of 16 bytes."""
    if t.dim() != 2 or t.shape[1] == 0:
        return False
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


class TritonBackend:
    """Fused Triton kernels: one launch per program (see the package docstring).

    ``config``: force one :class:`KernelConfig` (tests, benchmarks); otherwise :meth:`_choose` picks one.
    ``autotune``: time the candidates of a (program, dtypes, shape bucket) that has no tuned entry on
    this GPU on its first use, and cache the fastest; default from ``CODAGEN_TRITON_AUTOTUNE`` (``1``
    times, unset or ``0`` never does: the tuned entry, else the nearest tuned entry, else a heuristic,
    see :mod:`.configs`). ``CODAGEN_TRITON_RETUNE=1`` (with tuning on) times keys that have an entry too.
    ``tma``: ``False`` forces the pointer-load mainloop and epilogue even where TMA is possible.
    ``choices``: tuning key -> where its config came from (``tuned``, ``nearest``, ``layout``,
    ``heuristic``, ``timed``), for ``codagen tune`` and the benchmarks.
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
        self._plans: dict[tuple, tuple[Program, _Launch, KernelConfig]] = {}
        self.last_config: KernelConfig | None = None
        self.choices: dict[str, str] = {}

    # -- checks ------------------------------------------------------------------------------------
    def _check(self, bound: BoundProgram) -> tuple[bool, int]:
        """(interpret?, compute capability major); raises on what this backend cannot run."""
        dev = bound.device
        if bound.dtype not in SUPPORTED_DTYPES:
            raise ProgramError(f"{bound.program.name}: the triton backend multiplies float16, bfloat16 or float32 "
                               f"operands, got a: {bound.dtype}; use backend='reference' for {bound.dtype}")
        if dev.type == "cpu":
            return True, 0
        if dev.type != "cuda":
            raise ProgramError(f"{bound.program.name}: the triton backend runs CUDA tensors (compiled) and CPU "
                               f"tensors (interpreted), got device {dev}")
        major, minor = torch.cuda.get_device_capability(dev)
        if major < 8:
            raise ProgramError(f"{bound.program.name}: the triton backend needs an NVIDIA GPU of compute "
                               f"capability 8.0 or newer (Ampere, Ada, Hopper), got {major}.{minor} "
                               f"({torch.cuda.get_device_name(dev)})")
        return False, major

    def _prepare(self, bound: BoundProgram, interpret: bool, major: int) -> _Launch:
        program = bound.program
        dtypes = ",".join(f"{n}:{_TRITON_DTYPE.get(t.dtype, str(t.dtype))}" for n, t in
                          [("a", bound.a)] + sorted(bound.tensors.items()))
        arch = "interpreter" if interpret else f"sm_{major}x"
        kernel = load_kernel(program, dtypes=dtypes, arch=arch, interpret=interpret)
        m, n, k = bound.m, bound.n, bound.k
        tma_hw = interpret or major in (9, 10)
        tma_mainloop = self.tma and tma_hw and k > 0 and _tma_ok(bound.a) and _tma_ok(bound.b)
        tiles = [bound.tensors[name] for name, e in program.inputs.items() if isinstance(e, TileInput)]
        tiles += [bound.tensors[o.name] for o in program.outputs if isinstance(o, Store) and o.accumulate]
        tma_epilogue_ok = self.tma and tma_hw and all(_tma_ok(t) for t in tiles)
        if tma_epilogue_ok:  # the outputs we allocate have the row lengths N*w in their store dtype
            for o in program.outputs:
                if isinstance(o, Store) and not o.accumulate:
                    row_bytes = o.value.width.columns(n) * torch.empty((), dtype=bound.store_dtype(o)).element_size()
                    tma_epilogue_ok &= row_bytes % 16 == 0 and row_bytes > 0
        return _Launch(kernel=kernel, dtypes=dtypes, arch=arch, args=[], m=m, n=n, k=k, tma_mainloop=tma_mainloop,
                       tma_epilogue_ok=tma_epilogue_ok,
                       upcast=interpret and bound.dtype == torch.bfloat16,
                       precision="ieee" if bound.dtype == torch.float32 or interpret else "tf32",
                       interpret=interpret)

    # -- launching ---------------------------------------------------------------------------------
    def _launch(self, bound: BoundProgram, launch: _Launch, cfg: KernelConfig, outs: dict[str, torch.Tensor]):
        with on_device(bound.device):
            self._launch_here(bound, launch, cfg, outs)

    def _launch_here(self, bound: BoundProgram, launch: _Launch, cfg: KernelConfig, outs: dict[str, torch.Tensor]):
        program = bound.program
        if cfg.schedule == "pingpong":  # validated once per call signature, in _choose
            from . import pingpong
            slots = launch.pingpong_slots.get(cfg.sub_n)
            if slots is None:
                slots = launch.pingpong_slots[cfg.sub_n] = pingpong.input_slots(bound, cfg.sub_n, _smem_limit(bound.device))
            pingpong.launch(launch.pingpong(program), bound, outs, cfg.sub_n, slots, _num_sms(bound.device))
            self.launches += 1
            return
        low_rank = program.gemm.low_rank
        args = [bound.a, bound.b] + ([bound.tensors["a2"], bound.tensors["b2"]] if low_rank else [])
        args += [bound.tensors[name] for name in program.inputs]
        args += [outs[o.name] for o in program.outputs]
        args += [launch.m, launch.n, launch.k] + ([bound.r] if low_rank else [])
        num_tiles = cdiv(launch.m, cfg.block_m) * cdiv(launch.n, cfg.block_n)
        if launch.interpret:
            grid = (min(num_tiles, 3),)  # several tiles per program: the persistent loop is exercised
        else:
            grid = (min(num_tiles, _num_sms(bound.device)),)
        meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                    EPILOGUE_SPLIT=cfg.epilogue_split, SUB_N=cfg.sub_n, TMA_MAINLOOP=launch.tma_mainloop,
                    TMA_EPILOGUE=cfg.tma_epilogue and launch.tma_epilogue_ok, UPCAST_OPERANDS=launch.upcast,
                    DOT_PRECISION=launch.precision, FLATTEN=not launch.interpret, INTERPRETER=launch.interpret)
        if low_rank:  # the rank loop's step: at least the dot's minimum inner size 16, at most BLOCK_K
            meta["BLOCK_R"] = max(16, min(cfg.block_k, 1 << (bound.r - 1).bit_length()))
        if launch.interpret:
            with _interpreting():
                launch.kernel[grid](*args, **meta)
        else:
            _set_allocator()
            launch.kernel[grid](*args, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        self.launches += 1

    def run(self, bound: BoundProgram) -> dict[str, torch.Tensor]:
        interpret, major = self._check(bound)
        if bound.m == 0 or bound.n == 0:
            cfg = self.config or (interpreter_config(bound.program) if interpret
                                  else KernelConfig(128, 256, 64, 3, 8, 2))
            return bound.allocate_outputs(cfg.block_m, cfg.block_n)
        launch, cfg = self._plan(bound, interpret, major)
        outs = bound.allocate_outputs(cfg.block_m, cfg.block_n)
        self._launch(bound, launch, cfg, outs)
        self.last_config = cfg
        return outs

    def _plan(self, bound: BoundProgram, interpret: bool, major: int) -> tuple[_Launch, KernelConfig]:
        """The kernel and config for this call, remembered per call signature.

        Loading the kernel and choosing its config cost a millisecond or more of Python (candidate
        pruning, cache keys); a training step repeats the same few signatures, so after the first
        call a step pays one dictionary lookup per launch instead.
        """
        signature = (id(bound.program), bound.device, bound.dtype, tuple(bound.a.shape), tuple(bound.b.shape),
                     bound.a.data_ptr() % 16, bound.b.data_ptr() % 16,
                     tuple((name, t.dtype, tuple(t.shape), t.data_ptr() % 16) for name, t in bound.tensors.items()))
        plan = self._plans.get(signature)
        if plan is None or plan[0] is not bound.program:  # the id of a collected program can be reused
            launch = self._prepare(bound, interpret, major)
            plan = (bound.program, launch, self._choose(bound, launch, interpret))
            self._plans[signature] = plan
        return plan[1], plan[2]

    def launcher(self, bound: BoundProgram):
        """``(launch, outputs, config)``: a zero-argument function that re-runs the kernel into
        ``outputs`` (allocated once, poisoned). For benchmarks, which time the kernel alone."""
        interpret, major = self._check(bound)
        if bound.m == 0 or bound.n == 0:
            raise ProgramError(f"{bound.program.name}: nothing to launch for M = {bound.m}, N = {bound.n}")
        launch, cfg = self._plan(bound, interpret, major)
        outs = bound.allocate_outputs(cfg.block_m, cfg.block_n)
        return (lambda: self._launch(bound, launch, cfg, outs)), outs, cfg

    # -- tuning ------------------------------------------------------------------------------------
    def _choose(self, bound: BoundProgram, launch: _Launch, interpret: bool) -> KernelConfig:
        if self.config is not None:
            if self.config.schedule == "pingpong":
                name = bound.program.name
                if (reason := pingpong_unsupported()) is not None:
                    raise ProgramError(f"{name}: {reason}; use a persistent configuration")
                from . import pingpong, pingpong_codegen
                reason = pingpong_codegen.refusal(bound.program)
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
        if self._autotuning() and len(pool) > 1 and (key not in self.tuning or _env_flag("CODAGEN_TRITON_RETUNE")):
            cfg, source = self._tune(bound, launch, pool, key), "timed"
        else:
            lookup = key
            if bound.program.gemm.low_rank and key not in self.tuning:
                # a low-rank program adds a short R loop to its base program's mainloop: until it has a
                # choice of its own, the base program's choice (or its fastest persistent candidate) stands in
                base_key = self._tuning_key(_without_low_rank(bound), launch)
                lookup = base_key if base_key in self.tuning else key
            cfg, source = self.tuning.choose(lookup, gemm_layout(bound.program), bound.program, pool, bound.k)
        self.choices[key] = source
        return cfg

    def _autotuning(self) -> bool:
        if self.autotune is not None:
            return self.autotune
        return _env_flag("CODAGEN_TRITON_AUTOTUNE")

    def _candidates(self, bound: BoundProgram, launch: _Launch) -> list[KernelConfig]:
        """The configurations this GPU can run for these tensors, best guess first."""
        dev = bound.device
        smem_limit = _smem_limit(dev)
        pool = candidates(bound.program, major=torch.cuda.get_device_capability(dev)[0],
                          operand_bytes=bound.a.element_size(), smem_limit=smem_limit, tma=launch.tma_mainloop,
                          tma_epilogue=launch.tma_epilogue_ok, m=bound.m, n=bound.n, num_sms=_num_sms(dev))
        if any(cfg.schedule == "pingpong" for cfg in pool):  # the estimate assumed 2-byte tiles
            from . import pingpong
            pool = [cfg for cfg in pool if cfg.schedule != "pingpong" or not pingpong.refuses(bound, cfg.sub_n, smem_limit)]
        return pool

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
        from triton.runtime.errors import OutOfResources
        verbose = self.verbose if self.verbose is not None else True
        start = time.perf_counter()
        announced = False
        timings: dict[str, float] = {}
        best, best_ms = None, float("inf")
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
        import triton.testing
        run()
        return triton.testing.do_bench(run, warmup=10, rep=40, return_mode="median")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes")


def _without_low_rank(bound: BoundProgram) -> BoundProgram:
    """``bound`` as its base program (the same GEMM without the low-rank pair): its tuning key."""
    program = bound.program
    base = Program(program.name, Gemm(program.gemm.a_layout, program.gemm.b_layout), program.outputs, doc=program.doc)
    tensors = {name: t for name, t in bound.tensors.items() if name not in ("a2", "b2")}
    return BoundProgram(base, bound.a, bound.b, bound.m, bound.n, bound.k, tensors)


def _smem_limit(device: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 232448)


@functools.lru_cache(maxsize=None)
def _num_sms_index(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    return _num_sms_index(device.index if device.index is not None else torch.cuda.current_device())
