"""Kernels compiled ahead from a trace's fake tensors (``codagen.backends.triton.ahead``,
``codagen.models.compile_ahead``): the stand-ins specialize as the tensors do, a dry run submits compilations and
launches nothing, the dry runs of a compiled training step and of an eager one's fake trace reach every fused GEMM
the step launches, and on the GPU the first step, compiled or eager, compiles none of codagen's kernels itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime import _async_compile  # noqa: E402

import codagen  # noqa: E402
from codagen.backends.triton import TritonBackend, ahead  # noqa: E402
from codagen.ops import _custom_op  # noqa: E402

transformers = pytest.importorskip("transformers")
from ..models.conftest import build  # noqa: E402


@pytest.fixture
def in_dry_run():
    token = ahead._tracing.set(True)
    yield
    ahead._tracing.reset(token)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32])
def test_stand_ins_specialize_as_their_tensors(dtype, in_dry_run):
    """What Triton compiles for (dtype, 16-byte alignment) is the same for a tensor and its stand-in, for
    whole tensors and for views at offsets of 1 to 8 elements."""
    backend = make_backend(GPUTarget("cuda", 90, 32))
    base = torch.zeros(64, 48, dtype=dtype)
    views = [base, base[1:], base[:, 2:], base[:, 4:], base[:, 8:], base[:, 1:], base.t()]
    for view in views:
        for align in (True, False):
            want = native_specialize_impl(backend, view, False, True, align)
            got = native_specialize_impl(backend, ahead._Operand(view), False, True, align)
            assert got == want, (view.storage_offset(), view.stride(), got, want)
    stand_in = ahead._Operand(base[:, 4:])
    assert (stand_in.dtype, stand_in.shape, stand_in.stride()) == (dtype, [64, 44], (48, 1))


class _Kernel:
    """A stand-in JIT function: records launches and warmups."""

    def __init__(self):
        self.launched, self.warmed = [], []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launched.append((grid, args, meta))

    def warmup(self, *args, grid, **meta):
        self.warmed.append((grid, args, meta, _async_compile.active_mode.get()))


def test_launch_kernel_compiles_instead_in_a_dry_run(monkeypatch):
    kernel, x = _Kernel(), torch.randn(8, 16)
    monkeypatch.setattr(ahead, "_mode", _async_compile.AsyncCompileMode(None))
    ahead.launch_kernel(kernel, (4,), x, 16, BLOCK=32)
    assert len(kernel.launched) == 1 and kernel.launched[0][1][0] is x and kernel.warmed == []
    ahead.dry_run(lambda: None, (), {})  # no CUDA tensor: nothing to do
    token = ahead._tracing.set(True)
    try:
        ahead.launch_kernel(kernel, (4,), x[:, 2:], 16, BLOCK=32, num_warps=4)
    finally:
        ahead._tracing.reset(token)
    assert len(kernel.launched) == 1, "a dry run launched a kernel"
    ((grid, args, meta, mode),) = kernel.warmed
    assert grid == (4,) and meta == dict(BLOCK=32, num_warps=4) and args[1] == 16
    assert isinstance(args[0], ahead._Operand) and args[0].data_ptr() == 8 and args[0].shape == [8, 14]
    assert mode is ahead._mode and _async_compile.active_mode.get() is None


def test_dry_run_runs_the_implementation_while_tracing_unless_turned_off(monkeypatch):
    seen = []
    monkeypatch.setattr(ahead, "_on_cuda", lambda values: True)
    ahead.dry_run(lambda x, scale: seen.append((x, scale, ahead.tracing())), (1,), {"scale": 2})
    assert seen == [(1, 2, True)] and not ahead.tracing()
    ahead.dry_run(lambda: 1 / 0, (), {})  # a failing dry run is dropped
    monkeypatch.setenv("CODAGEN_COMPILE_AHEAD", "0")
    ahead.dry_run(lambda *args, **kwargs: seen.append("ran"), (1,), {"scale": 2})
    assert seen == [(1, 2, True)]


@pytest.fixture
def planned(monkeypatch):
    """The fused GEMMs planned in dry runs (``dry``) and launched (``real``), as (program, m, n, k, config), and the
    kernels dry runs would compile (``submitted``: they specialize on the program and config, not sizes). Dry runs
    are allowed on CPU tensors (the Triton backend in the interpreter)."""
    planned = {"dry": [], "real": [], "submitted": set()}
    real_launch = TritonBackend._launch

    def recording_launch(self, bound, launch, cfg, outs):
        if ahead.tracing():
            planned["dry"].append((bound.program.name, bound.m, bound.n, bound.k, cfg))
            planned["submitted"].add((bound.program.name, cfg))
            return None
        planned["real"].append((bound.program.name, bound.m, bound.n, bound.k, cfg))
        return real_launch(self, bound, launch, cfg, outs)

    monkeypatch.setattr(TritonBackend, "_launch", recording_launch)
    monkeypatch.setattr(ahead, "_on_cuda", lambda values: any(isinstance(v, torch.Tensor) for v in values))
    monkeypatch.setattr(_custom_op, "compile_ahead", ahead.dry_run)
    return planned


def test_dry_runs_reach_every_fused_gemm_of_a_compiled_step(planned):
    """Under torch.compile the ops' dry runs (forward and backward, during tracing) plan the same fused
    GEMMs with the same configurations as the first real step launches (CPU: the Triton backend in the
    interpreter)."""
    model = codagen.patch(build("llama"))
    ids = torch.randint(0, 64, (2, 8))
    torch._dynamo.reset()
    with codagen.use_backend("triton"):
        compiled = torch.compile(model, backend="aot_eager")
        compiled(input_ids=ids, labels=ids).loss.backward()
    real, dry = set(planned["real"]), set(planned["dry"])
    names = {name for name, *_ in real}
    assert {"rms_qkv_rope", "rms_gate_up_swiglu", "input_grad", "rms_norm_backward"} <= names, names
    assert real <= dry, f"launched without a dry run: {sorted(real - dry, key=str)}"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_eager_first_step_trace_reaches_every_fused_gemm(monkeypatch, planned, family):
    """In eager mode the first training forward at a new signature is traced on fake tensors first: its ops'
    dry runs plan every fused GEMM the real step (forward and backward) then launches, with the same
    configurations. The trace touches no real parameter, gradient or hook, runs once per signature, and stops
    once a trace needs no new kernel (CPU: the Triton backend in the interpreter)."""
    from codagen.models import compile_ahead
    monkeypatch.setattr(compile_ahead, "compiles_ahead", lambda device: True)
    monkeypatch.setattr(compile_ahead, "compiling_ahead", lambda: len(planned["submitted"]))
    model = codagen.patch(build(family))
    calls = []
    model.register_forward_hook(lambda module, args, output: calls.append(output.loss))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.randint(0, 64, (2, 8))
    with codagen.use_backend("triton"):
        model(input_ids=ids, labels=ids).loss.backward()
        real, dry = set(planned["real"]), set(planned["dry"])
        names = {name for name, *_ in real}
        qkv = {"qwen2": "rms_qkv_rope_bias", "qwen3": "rms_qkv_rope_qk_norm"}.get(family, "rms_qkv_rope")
        assert {qkv, "rms_gate_up_swiglu", "input_grad", "rms_norm_backward"} <= names, names
        assert real <= dry, f"launched without a dry run: {sorted(real - dry, key=str)}"
        assert len(calls) == 1 and not isinstance(calls[0], torch._subclasses.FakeTensor)
        for name, p in model.named_parameters():
            assert torch.equal(p, before[name]) and type(p.grad) is torch.Tensor, name
        planned["dry"].clear()
        model(input_ids=ids, labels=ids).loss.backward()  # the same signature: no second trace
        assert planned["dry"] == []
        with torch.no_grad():
            model(input_ids=ids, labels=ids)  # without autograd: no trace
        assert planned["dry"] == []
        model(input_ids=ids[:, :4], labels=ids[:, :4])  # a new shape: traced again, but it needs no new kernel
        assert planned["dry"]
        planned["dry"].clear()
        model(input_ids=ids[:, :6], labels=ids[:, :6])  # so later new shapes are not traced
        assert planned["dry"] == []


def test_compiles_ahead_only_for_the_triton_backend_on_a_gpu(monkeypatch):
    from codagen.backends import compiles_ahead, compiling_ahead
    assert compiles_ahead(torch.device("cuda")) and not compiles_ahead(torch.device("cpu"))
    with codagen.use_backend("reference"):
        assert not compiles_ahead(torch.device("cuda"))
    monkeypatch.setenv("CODAGEN_COMPILE_AHEAD", "0")
    assert not compiles_ahead(torch.device("cuda"))
    mode = _async_compile.AsyncCompileMode(None)
    mode.future_kernels = {"a": None, "b": None}
    monkeypatch.setattr(ahead, "_mode", mode)
    assert compiling_ahead() == 2


def test_the_trace_runs_one_layer_of_each_kind():
    """Layers with the same parameters and attention (sliding window) launch the same kernels: the trace keeps
    the first of each kind; a layer whose parameters differ (a frozen one) or whose window differs is its own."""
    from codagen.models.compile_ahead import one_of_each
    layers = build("llama", num_hidden_layers=4).model.layers
    assert one_of_each(layers, lambda layer: None) == [layers[0]]
    windows = {id(layers[2]): 4}
    assert one_of_each(layers, lambda layer: windows.get(id(layer))) == [layers[0], layers[2]]
    layers[3].mlp.down_proj.weight.requires_grad_(False)
    assert one_of_each(layers, lambda layer: None) == [layers[0], layers[3]]


_GPU_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, transformers, triton
    import codagen
    compiles = []
    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        compiles.append((fn.module, fn.name, is_manual_warmup))
    triton.knobs.runtime.jit_cache_hook = hook
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      attn_implementation="sdpa")
    with torch.device("cuda"):
        model = codagen.patch(transformers.LlamaForCausalLM(config).to(torch.bfloat16).train())
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    compiled = torch.compile(model) if sys.argv[1] == "compile" else model
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        compiled(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    ours = [c for c in compiles if c[0].startswith("codagen")]
    print(json.dumps({"ahead": sum(1 for c in ours if c[2]), "on_launch": [c[:2] for c in ours if not c[2]]}))
""")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["compile", "eager"])
def test_gpu_first_step_compiles_no_codagen_kernel_on_launch(tmp_path, mode):
    """A fresh process (empty in-memory and on-disk Triton caches): every codagen kernel of a 2-layer training
    step, compiled or eager, compiles ahead (during tracing, or the eager step's fake trace); none compiles
    when the step launches it."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), CODAGEN_CACHE_DIR=str(tmp_path / "codagen"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env.pop("CODAGEN_TRITON_AUTOTUNE", None)
    done = subprocess.run([sys.executable, "-c", _GPU_SCRIPT, mode], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ahead"] >= 8 and result["on_launch"] == [], result
