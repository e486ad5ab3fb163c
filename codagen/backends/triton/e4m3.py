"""fp32 -> e4m3 codes by bit arithmetic, shared by the quantizing epilogue (``QuantizedStore``) and the rowwise quantize
row kernel (``codagen.ops.kernels.quantize``).

The codes are rounded to nearest even by integer operations on the fp32 bits rather than by Triton's fp8 conversion:
Triton 3.6's interpreter rounds some values a binade low there (``docs/notes/fp8-mainloop-compile.md``), and a kernel
must compute on CPU what it computes on the GPU. The kernels store the codes as uint8 (sm_80 has no e4m3 type), a
few integer operations per element in a store that moves 1 byte per element.
"""
import triton
import triton.language as tl

__all__ = ["e4m3_code"]


@triton.jit
def e4m3_code(v):
    """The e4m3fn code (in an int32) of fp32 ``v`` in [-448, 448], rounded to nearest even, its sign kept (as torch's
    cast keeps -0.0's).

    Normal results (|v| >= 2^-6): the code is ``(exponent + 7) << 3 | top 3 mantissa bits``, plus one where the 20
    dropped bits round up; a carry out of the mantissa steps the exponent, as adding 1 to the code does.
    Subnormal ones: the code is ``|v| / 2^-9`` rounded to nearest even, which adding and subtracting 2^23 does
    exactly in fp32 (``|v| * 512 < 8``), and code 8 is the smallest normal, 2^-6."""
    magnitude = tl.abs(v)
    bits = magnitude.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 127
    mantissa = bits & 0x7FFFFF
    top = mantissa >> 20
    dropped = mantissa & 0xFFFFF
    round_up = (dropped > 0x80000) | ((dropped == 0x80000) & ((top & 1) == 1))
    normal = ((exponent + 7) << 3) + top + round_up.to(tl.int32)
    subnormal = ((magnitude * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(magnitude < 0.015625, subnormal, normal)
    return code | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)  # the sign bit, -0.0's included
