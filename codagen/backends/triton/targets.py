"""The GPU targets the Triton backend compiles for, and what each one offers the kernels.

A :class:`Target` is what the backend's choices read instead of a compute capability alone: whether the chip has
TMA descriptors (the Hopper and Blackwell copy engine: the TMA mainloop and epilogue), whether the Gluon ping-pong
kernel runs there (sm_90 only: Triton 3.6 applies ``warp_specialize`` elsewhere differently or not at all), the
shared memory (LDS on AMD) one program may take, whether inline PTX exists (the device math's fast ``sigmoid`` and
``cos``/``sin``; elsewhere :mod:`.device_math`'s portable formulas, as in the interpreter), the ``tl.dot`` input
precisions it accepts, and the instruction families its matrix multiplies compile to, bf16 and e4m3 (what the compile
matrix checks in the assembly: ``tests/backends/test_compile_matrix.py``).

Supported: NVIDIA sm_80 (A100), sm_86 / sm_89 (RTX 30 / 40, L40), sm_90 (H100, H200), sm_100 (B200), sm_120
(RTX 50); AMD gfx942 (MI300) and gfx950 (MI350). Measured: sm_90 only; the others are compiled in CI
(``docs/triton.md``, "Targets").
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

__all__ = ["Target", "TARGETS", "of_device", "compile_target", "families"]


@dataclass(frozen=True)
class Target:
    name: str             # "sm_90", "gfx942"
    backend: str          # Triton's backend: "cuda" or "hip"
    arch: int | str       # Triton's GPUTarget arch: 90, "gfx942"
    warp_size: int
    shared_memory: int    # bytes one program may take (the opt-in limit; the device's property wins at run time)
    tma: bool             # TMA descriptors: the TMA mainloop and epilogue
    pingpong: bool        # the warp-specialized Gluon kernel (.pingpong)
    ptx: bool             # inline PTX (the device math's fast paths)
    dot_precisions: tuple[str, ...]  # tl.dot input_precision values accepted
    mma: str              # what a bf16 tl.dot compiles to, as it appears in the assembly
    pool: str             # the configurations' family in .configs: "sm90", "blackwell" (TMA), "ampere", "cdna"
    fp8_mma: str | None = None  # in the assembly of an e4m3 tl.dot, beside mma (None: no e4m3 instruction: refused)

    @property
    def portable(self) -> bool:
        """The device math without inline PTX (as in the interpreter)."""
        return not self.ptx

    def dot_precision(self, fp32_operands: bool) -> str:
        """``tl.dot``'s input precision: IEEE fp32 for fp32 operands, else tf32 where accepted (bf16 and fp16
        operands ignore it)."""
        return "ieee" if fp32_operands or "tf32" not in self.dot_precisions else "tf32"


def _nvidia(name: str, arch: int, shared_memory: int, mma: str, pool: str, tma: bool = False,
            pingpong: bool = False, fp8_mma: str | None = None) -> Target:
    return Target(name, "cuda", arch, 32, shared_memory, tma=tma, pingpong=pingpong, ptx=True,
                  dot_precisions=("tf32", "tf32x3", "ieee"), mma=mma, pool=pool, fp8_mma=fp8_mma)


def _amd(arch: str, lds: int, fp8_mma: str | None = None) -> Target:
    """AMD CDNA: wave64, no TMA, no inline PTX, no tf32."""
    return Target(arch, "hip", arch, 64, lds, tma=False, pingpong=False, ptx=False,
                  dot_precisions=("ieee", "bf16x3", "bf16x6"), mma="v_mfma", pool="cdna", fp8_mma=fp8_mma)


TARGETS = {t.name: t for t in (
    _nvidia("sm_80", 80, 166912, "mma.sync", "ampere"),
    _nvidia("sm_86", 86, 101376, "mma.sync", "ampere"),
    _nvidia("sm_89", 89, 101376, "mma.sync", "ampere", fp8_mma="row.col.f32.e4m3.e4m3"),
    _nvidia("sm_90", 90, 232448, "wgmma", "sm90", tma=True, pingpong=True, fp8_mma="f32.e4m3.e4m3"),
    _nvidia("sm_100", 100, 232448, "tcgen05", "blackwell", tma=True, fp8_mma="kind::f8f6f4"),
    _nvidia("sm_120", 120, 101376, "mma.sync", "ampere", fp8_mma="row.col.f32.e4m3.e4m3"),
    _amd("gfx942", 65536),  # its FP8 is FNUZ: an e4m3 (OCP) tl.dot compiles to fp16 MFMA
    _amd("gfx950", 163840, fp8_mma="_f8f6f4"),
)}


@functools.cache
def _of_index(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        name = props.gcnArchName.split(":")[0]
    else:
        major, minor = torch.cuda.get_device_capability(index)
        name = f"sm_{major}{minor}"
        if name not in TARGETS and major in (9, 10, 12):  # sm_90a, sm_103, sm_121: the family's target
            name = f"sm_{major}0"
    target = TARGETS.get(name)
    if target is None:
        raise RuntimeError(f"codagen's triton backend compiles for {', '.join(TARGETS)}; "
                           f"{torch.cuda.get_device_name(index)} is {name}: use backend='reference'")
    if target.name != "sm_90":  # said once per GPU: what runs here instead of the measured Hopper kernels
        warnings.warn(f"codagen: {torch.cuda.get_device_name(index)} ({target.name}) runs {families(target)}; "
                      f"these kernels are compiled in CI but not measured off sm_90", stacklevel=2)
    return target


def families(target: Target) -> str:
    """The kernel families the backend chooses from on ``target``, in words."""
    mainloop = "TMA loads" if target.tma else "pointer loads"
    pingpong = ", and the warp-specialized ping-pong kernel" if target.pingpong else ", no ping-pong kernel"
    math = "" if target.ptx else ", portable device math (no inline PTX)"
    return f"the persistent tl kernel with {mainloop} ({target.mma}){pingpong}{math}"


def of_device(device: torch.device) -> Target:
    """The target of CUDA (or ROCm) ``device``, read once per GPU; an unknown chip is refused, naming the known ones."""
    return _of_index(device.index if device.index is not None else torch.cuda.current_device())


def compile_target(target: Target):
    """Triton's ``GPUTarget`` of ``target`` (compiling without that GPU: the compile matrix, bench scripts)."""
    from triton.backends.compiler import GPUTarget
    return GPUTarget(target.backend, target.arch, target.warp_size)
