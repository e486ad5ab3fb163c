"""Compile a generated kernel for Hopper (sm_90) without a GPU, for tests that read its PTX."""
from __future__ import annotations


def sm90_ptx(program, function: str, leading: dict[str, str], sizes: tuple[str, ...], constexprs: dict,
             num_warps: int, num_stages: int) -> str:
    """PTX of ``program``'s ``<name>_<function>`` for sm_90 with bf16 operands: ``leading`` the pointer
    arguments before the epilogue's (name -> Triton type), then the epilogue's inputs and outputs (tile values
    bf16, vectors and partials fp32), then the int32 ``sizes``, then ``constexprs``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from codagen.backends.triton.backend import load_kernel
    from codagen.epilogue.ir import TileInput
    kernel = load_kernel(program, dtypes="sm90-compile-check", arch="sm_90x", interpret=False, function=function)
    signature = dict(leading)
    for input_name, e in program.inputs.items():
        signature[f"{input_name}_ptr"] = "*bf16" if isinstance(e, TileInput) else "*fp32"
    for out in program.outputs:
        signature[f"{out.name}_ptr"] = "*fp32" if out.name.startswith("partial") else "*bf16"
    signature.update({size: "i32" for size in sizes})
    signature.update({k: "constexpr" for k in constexprs})
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                          "num_stages": num_stages})
    return compiled.asm["ptx"]
