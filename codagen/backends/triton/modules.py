"""Generated kernel modules: a program's source, written to a real file in the cache and imported.

``@triton.jit`` and ``@gluon.jit`` read a function's source with ``inspect``, so a generated kernel must
live in a file, at module level. A module is loaded once per process and interpreter mode: for CPU
tensors the same file is loaded a second time with ``triton.knobs.runtime.interpret`` set, so its
functions become interpreted ones.
"""
from __future__ import annotations

import importlib.util
import sys
import threading

from triton import knobs

from codagen.epilogue.ir import Program

from . import persistent, pingpong
from .configs import atomic_write, cache_dir
from .tuning import library_versions, program_key, source_hash

__all__ = ["program_source", "load_kernel"]


def program_source(program: Program, dtypes: str = "any", arch: str = "any", schedule: str = "persistent") -> str:
    """Readable source of ``program``'s fused kernel: the generated ``tl`` kernel, or with
    ``schedule="pingpong"`` the Gluon ping-pong kernel (Hopper)."""
    header = f"# dtypes: {dtypes}; arch: {arch}; {library_versions()}\n"
    if schedule == "pingpong":
        return pingpong.generate(program, header=header)
    return persistent.generate(program, header=header)


_modules: dict[tuple[str, bool], object] = {}
_modules_lock = threading.Lock()


def load_kernel(program: Program, *, dtypes: str, arch: str, interpret: bool, schedule: str = "persistent",
                function: str = "kernel"):
    """The ``<name>_<function>`` JIT function (``kernel``, or the persistent module's ``split_k_kernel``) of
    ``program``'s ``schedule`` module, from a real file in the cache. The file name hashes the program, dtypes,
    arch, schedule and library versions."""
    key_text = "\n".join([program_key(program), dtypes, arch, library_versions()] +
                         ([f"pingpong {pingpong.GENERATOR_VERSION}"] if schedule == "pingpong" else []))
    digest = source_hash(key_text)
    with _modules_lock:
        module = _modules.get((digest, interpret))
        if module is None:
            stem = program.name + ("_pingpong" if schedule == "pingpong" else "")
            path = cache_dir() / "triton" / "kernels" / f"{stem}_{digest}.py"
            source = program_source(program, dtypes, arch, schedule)
            if not path.exists() or path.read_text() != source:
                atomic_write(path, source)
            mod_name = f"codagen_kernels.{stem}_{digest}{'_interpreted' if interpret else ''}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(spec)
            previous = knobs.runtime.interpret
            knobs.runtime.interpret = interpret
            try:
                spec.loader.exec_module(module)
            finally:
                knobs.runtime.interpret = previous
            sys.modules[mod_name] = module
            _modules[(digest, interpret)] = module
    return getattr(module, f"{program.name}_{function}")
