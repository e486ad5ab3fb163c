"""Bad input gets a clear error naming the argument and what was expected."""
import pytest
import torch

import codagen
from codagen.epilogue import ProgramError, library

EPS = 1e-6


def gate_up_args(m=8, d=16, n=12, dtype=torch.float32):
    return dict(a=torch.randn(m, d, dtype=dtype), b=torch.randn(n, d, dtype=dtype), rstd=torch.rand(m) + 0.5)


def call(program, a, b, **tensors):
    return codagen.execute(program, a, b, backend="reference", **tensors)


@pytest.mark.parametrize("mutate, match", [
    (lambda t: t.update(a=t["a"].to(torch.int32)), r"a: dtype torch.int32 is not supported; expected one of"),
    (lambda t: t.update(b=t["b"].half()), r"a and b must have one dtype, got a: torch.float32, b: torch.float16"),
    (lambda t: t.update(a=t["a"][None]), r"a: expected a 2-D matrix, got shape \(1, 8, 16\)"),
    (lambda t: t.update(b=torch.randn(12, 15)), r"inner dimensions differ.*K = 16 and 15"),
    (lambda t: t.update(a=torch.randn(16, 8).t()), r"a: expected a contiguous tensor.*call .contiguous\(\)"),
    (lambda t: t.update(rstd=torch.rand(7)), r"rstd: expected shape \[M\] = \(8,\), got \(7,\)"),
    (lambda t: t.update(rstd=torch.ones(8, dtype=torch.int64)), r"rstd: expected a floating-point vector"),
    (lambda t: t.update(rstd=torch.rand(8, device="meta")), r"rstd: expected device cpu \(that of a\), got meta"),
    (lambda t: t.update(rstd=torch.rand(16)[::2]), r"rstd: expected a contiguous tensor"),
    (lambda t: t.update(rstd="0.5"), r"rstd: expected a torch.Tensor"),
    (lambda t: t.pop("rstd"), r"missing tensor\(s\) \['rstd'\]"),
    (lambda t: t.update(residual=torch.randn(8, 12)), r"unexpected tensor\(s\) \['residual'\]; it takes \['rstd'\]"),
    (lambda t: t.update(b=torch.randn(11, 16)), r"pairs of columns \(2j, 2j\+1\) need an even N, got N = 11"),
])
def test_gate_up_swiglu_refuses(mutate, match):
    args = gate_up_args()
    mutate(args)
    with pytest.raises(ProgramError, match=match):
        call(library.rms_gate_up_swiglu(), **args)


def test_index_scalar_tile_and_accumulated_output_checks():
    m, d, vocab = 6, 8, 10
    a, b = torch.randn(m, d), torch.randn(vocab, d)
    good = dict(rstd=torch.rand(m), lse=torch.rand(m), target=torch.randint(0, vocab, (m,)),
                row_weight=torch.rand(m), grad_scale=torch.ones(1))
    prog = library.rms_lm_head_cross_entropy_backward()
    call(prog, a, b, **good)
    with pytest.raises(ProgramError, match=r"target: expected an integer index vector \(int32 or int64\)"):
        call(prog, a, b, **{**good, "target": good["target"].float()})
    with pytest.raises(ProgramError,
                       match=r"grad_scale: expected a one-element floating-point tensor, got shape \(2,\)"):
        call(prog, a, b, **{**good, "grad_scale": torch.ones(2)})
    with pytest.raises(ProgramError, match=r"residual: expected shape \[M, N\] = \(6, 8\), got \(6, 9\)"):
        call(library.residual_rms_stats(), a, torch.randn(8, d), residual=torch.randn(m, 9), norm_weight=torch.ones(8))
    with pytest.raises(ProgramError, match=r"preact: expected shape \[M, 2N\] = \(6, 20\)"):
        call(library.swiglu_backward(), a, torch.randn(d, vocab), preact=torch.randn(m, vocab))
    with pytest.raises(ProgramError, match=r"missing tensor\(s\) \['grad_weight'\]"):
        call(library.weight_grad(accumulate=True), torch.randn(m, 3), torch.randn(m, 4))
    with pytest.raises(ProgramError, match=r"grad_weight: expected shape \[M, N\] \(accumulated output\) = \(3, 4\)"):
        call(library.weight_grad(accumulate=True), torch.randn(m, 3), torch.randn(m, 4), grad_weight=torch.zeros(4, 3))


def test_empty_and_odd_shapes_work():
    out = call(library.rms_gate_up_swiglu(), torch.randn(0, 16), torch.randn(12, 16), rstd=torch.rand(0))
    assert out["out"].shape == (0, 6) and out["preact"].shape == (0, 12)
    # N odd is fine without pairs; K = 0 gives zeros
    out = call(library.residual_rms_stats(), torch.randn(3, 0), torch.randn(7, 0), residual=torch.randn(3, 7),
               norm_weight=torch.ones(7))
    assert out["residual_out"].shape == (3, 7)


def test_float64_runs_on_the_reference_backend():
    args = gate_up_args(dtype=torch.float64)
    out = call(library.rms_gate_up_swiglu(), **args)
    assert out["out"].dtype == torch.float64
