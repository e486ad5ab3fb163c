"""Device math shared by the generated GEMM epilogues and the row kernels (``codagen.ops.kernels``).

Each function takes ``PORTABLE``: where there is no inline PTX (the Triton interpreter, AMD GPUs:
:mod:`.targets`) it computes the same formula with ``tl``'s own functions (numpy's in the interpreter).

``sigmoid``. ``tl.sigmoid`` is ``1 / (1 + exp(-x))`` with denormal-safe ``ex2`` and ``div.full``: ptxas
wraps both in range checks and rescaling (about 12 instructions per element). An epilogue runs on one
or two warps per scheduler, so its time is instruction latency, not throughput; the SwiGLU backward's
epilogue spends most of it here (docs/notes/swiglu-backward-epilogue.md). ``ex2.approx.ftz`` + ``rcp.approx.ftz`` are 4
instructions with the same accuracy (relative error ~2**-22 each); flushing denormals changes nothing
representable: exp(-x) is denormal only where the sigmoid is 1 in fp32, and overflows to inf where it
is below fp32's normal range (rcp(inf) = 0).

``cos_sin``. RoPE needs ``cos`` and ``sin`` of angles ``position * frequency`` up to ~10^4 rad. libdevice's precise
``sinf``/``cosf`` carry a Payne-Hanek slow path that keeps a local-memory array per thread (seen in the
cubin as stack bytes and ``ld.local``); the reduction below plus the hardware approximations has none.
Forward (the QKV epilogue) and backward (B1) use the same function, so B1 rotates by exactly the
angle the forward used.
"""
import triton
import triton.language as tl

__all__ = ["cos_sin", "sigmoid", "SIGMOID_PTX"]


@triton.jit
def cos_sin(theta, PORTABLE: tl.constexpr):
    """(cos, sin) of fp32 angles: reduced to [-pi, pi] by 2*pi in three parts (Cody-Waite, exact
    products in fma), then the hardware approximations (MUFU, abs error < 2**-20 on [-pi, pi]).
    ``PORTABLE`` (no inline PTX): ``tl.cos``/``tl.sin`` of the reduced angle."""
    k = tl.floor(theta * 0.15915494309189535 + 0.5)
    r = tl.fma(k, -6.28125, theta)                  # 6.28125 has 8 significant bits: k * it is exact
    r = tl.fma(k, -0.0019353071693331003, r)        # fp32(2 pi - 6.28125), exact in fp32
    r = tl.fma(k, -1.0253376606378076e-11, r)       # 2 pi - 6.28125 - the above
    if PORTABLE:
        c = tl.cos(r)
        s = tl.sin(r)
    else:
        c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1)
    return c, s


#: the PTX of ``sigmoid`` (also the Gluon kernels', which cannot call a ``tl`` function): t = -x log2 e,
#: t = 2**t, t = 1 + t, 1 / t; 0fBFB8AA3B is -log2(e) as fp32
SIGMOID_PTX = tl.constexpr("{ .reg .f32 t; mul.ftz.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; "
                           "add.ftz.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }")


@triton.jit
def sigmoid(x, PORTABLE: tl.constexpr):
    """1 / (1 + 2**(-x log2 e)) on fp32, in four instructions (see the module docstring)."""
    if PORTABLE:
        return 1.0 / (1.0 + tl.exp(-x))
    return tl.inline_asm_elementwise(SIGMOID_PTX, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
