"""codagen.integrations.torchtitan: torchtitan's Llama 3 with codagen's blocks trains like the stock model
(fp32, reference backend), keeps torchtitan's state-dict names, and runs under torchtitan's own FSDP step."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import codagen

from .conftest import run_distributed

torchtitan = pytest.importorskip("torchtitan", reason="torchtitan (0.3) is not installed: pip install torchtitan")
from torchtitan.config.override import derive  # noqa: E402
from torchtitan.models import llama3, qwen3  # noqa: E402
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.config_utils import get_attention_config  # noqa: E402

from codagen.integrations.torchtitan import model as tt  # noqa: E402

DIM, LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB, BATCH, SEQ = 64, 2, 4, 2, 128, 128, 2, 16


def tiny_config() -> llama3.Llama3Model.Config:
    """torchtitan's Llama 3 config at tiny sizes, with its ``llama`` RoPE scaling and depth-scaled inits."""
    layers = llama3._build_llama3_layers(
        n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=HIDDEN, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000, scaling="llama"))
    return llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)),
        layers=layers)


def tiny_qwen3_config() -> qwen3.Qwen3Model.Config:
    """torchtitan's dense Qwen3 config at tiny sizes: QK-norm, half-split RoPE, head_dim 32 != dim / heads."""
    head_dim = 32
    layers = qwen3._build_qwen3_layers(
        n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=head_dim, hidden_dim=HIDDEN,
        attn_backend="flex", rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=1000000.0))
    return qwen3.Qwen3Model.Config(
        dim=DIM, vocab_size=VOCAB, norm=qwen3._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=qwen3._LINEAR_INIT), layers=layers)


CONFIGS = {"llama3": tiny_config, "qwen3": tiny_qwen3_config}


def stock_model(config) -> torch.nn.Module:
    """The unconverted model with causal SDPA (torchtitan's flex attention has no backward on the CPU)."""
    layers = [derive(layer, type(layer), attention=derive(layer.attention, type(layer.attention),
                                                          inner_attention=ScaledDotProductAttention.Config()))
              for layer in config.layers]
    torch.manual_seed(0)
    model = derive(config, type(config), layers=layers).build()
    model.init_states()
    with torch.no_grad():  # norm weights away from 1, so that a norm applied in the wrong block shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def converted_model(stock, config=None):
    model = tt.convert_config(config or tiny_config()).build()
    model.verify_module_protocol()  # torchtitan's trainer checks every submodule is a torchtitan Module
    model.init_states()
    model.load_state_dict(stock.state_dict(), strict=True)
    return model


def loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def torchtitan_grads(model: tt.CodagenLlama3Model) -> dict[str, torch.Tensor]:
    """The gradients under torchtitan's names and layouts (through the state-dict hook's conversion)."""
    grads = {name: p.grad for name, p in model.named_parameters()}
    tt._to_torchtitan_layout(model, grads, "", None)
    return grads


def state_dict_of_grads(stock) -> dict[str, torch.Tensor]:
    """The stock model's gradients in its state-dict layout (its fused ``wqkv`` split by its own hook)."""
    holder = copy.deepcopy(stock)
    for p, q in zip(holder.parameters(), stock.parameters(), strict=True):
        p.data = q.grad if q.grad is not None else torch.zeros_like(q)
    return holder.state_dict()


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("kind", CONFIGS)
def test_converted_model_trains_like_torchtitan(kind):
    stock = stock_model(CONFIGS[kind]())
    model = converted_model(stock, CONFIGS[kind]())
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    want = loss(stock, tokens)
    want.backward()
    with codagen.use_backend("reference"):
        got = loss(model, tokens)
        got.backward()
    assert rel_err(got, want) < 1e-4
    grads, want_grads = torchtitan_grads(model), state_dict_of_grads(stock)
    assert set(grads) == set(want_grads)
    for name, g in want_grads.items():
        assert rel_err(grads[name], g) < 1e-4, name


def test_converter_rewrites_the_config():
    """``llama3.model_registry(flavor, converters=[CodagenConverter.Config()])`` gives codagen's model and block
    configs, with causal SDPA in place of torchtitan's flex attention (so the trainer builds no masks)."""
    spec = llama3.model_registry("debugmodel", converters=[tt.CodagenConverter.Config()])
    assert type(spec.model) is tt.CodagenLlama3Model.Config
    assert all(type(layer) is tt.CodagenBlock.Config for layer in spec.model.layers)
    assert all(isinstance(layer.attention.inner_attention, ScaledDotProductAttention.Config)
               for layer in spec.model.layers)
    assert isinstance(tiny_config().layers[0].attention.inner_attention, type(get_attention_config("flex")))


def test_the_converter_takes_fp8(monkeypatch):
    """``CodagenConverter.Config(fp8="blockwise")``: every block's GEMMs run blockwise in e4m3, and the loss stays
    within FP8's distance of the stock model's."""
    from codagen.ops import _fp8
    names = []
    execute = _fp8.execute
    monkeypatch.setattr(_fp8, "execute", lambda program, *a, **k: names.append(program.name) or execute(program, *a,
                                                                                                         **k))
    spec = llama3.model_registry("debugmodel", converters=[tt.CodagenConverter.Config(fp8="blockwise")])
    assert all(layer.fp8 == "blockwise" for layer in spec.model.layers)
    stock = stock_model(tiny_config()).bfloat16()
    model = tt.convert_config(tiny_config(), fp8="blockwise").build()
    model.init_states()
    model.load_state_dict(stock.state_dict(), strict=True)
    model.bfloat16()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    with codagen.use_backend("reference"):
        got = loss(model, tokens)
        got.backward()
    assert len(names) == LAYERS * 4 * 3 and all(name.endswith("_blockwise") for name in names)
    assert abs(got.item() - loss(stock, tokens).item()) <= 0.03 * got.item()
    with pytest.raises(ValueError, match="fp8: expected None or one of"):
        tt.convert_config(tiny_config(), fp8="e5m2")


def test_chunked_loss_hidden_states():
    """With ``_skip_lm_head`` (torchtitan's ChunkedLossWrapper) the model returns the final norm's output."""
    stock = stock_model(tiny_config())
    model = converted_model(stock)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    weights = torch.randn(BATCH, SEQ, DIM)
    stock._skip_lm_head = model._skip_lm_head = True
    want = stock(tokens)
    (want * weights).sum().backward()
    with codagen.use_backend("reference"):
        got = model(tokens)
        (got * weights).sum().backward()
    assert rel_err(got, want) < 1e-4
    grads, want_grads = torchtitan_grads(model), state_dict_of_grads(stock)
    assert grads.pop("lm_head.weight") is None
    for name, g in grads.items():
        assert rel_err(g, want_grads[name]) < 1e-4, name


@pytest.mark.parametrize("kind", CONFIGS)
def test_state_dict_round_trip_in_torchtitan_names(kind):
    stock = stock_model(CONFIGS[kind]())
    model = converted_model(stock, CONFIGS[kind]())
    saved = model.state_dict()
    want = stock.state_dict()
    assert list(saved) == list(want) or set(saved) == set(want)
    for name, t in want.items():
        assert torch.equal(saved[name], t), name
    fresh = tt.convert_config(CONFIGS[kind]()).build()
    fresh.init_states()
    fresh.load_state_dict(copy.deepcopy(saved), strict=True)
    for (name, p), (_, q) in zip(fresh.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    restored = stock_model(CONFIGS[kind]())
    with torch.no_grad():
        for p in restored.parameters():
            p.zero_()
    restored.load_state_dict(saved, strict=True)
    for name, t in restored.state_dict().items():
        assert torch.equal(t, want[name]), name


@pytest.mark.parametrize("setting, message", [
    ({"spmd_backend": "spmd_types"}, "spmd_backend"),
    ({"spmd_backend": "partial_dtensor", "context_parallel_degree": 2}, "context_parallel_degree"),
    ({"spmd_backend": "partial_dtensor", "tensor_parallel_degree": 2, "async_tp": True}, "async_tensor_parallel")])
def test_rejects_unsupported_parallelism(setting, message):
    from torchtitan.config import CompileConfig, ParallelismConfig

    setting = dict(setting)
    async_tp = setting.pop("async_tp", False)

    class TrainerConfig:
        parallelism = ParallelismConfig(**setting)
        compile = CompileConfig(enable=async_tp, enable_async_tensor_parallel=async_tp)
    with pytest.raises(NotImplementedError, match=message):
        tt.convert_config(tiny_config()).update_from_config(config=TrainerConfig())


@pytest.mark.parametrize("tp, sequence_parallel, want", [(2, True, True), (2, False, False), (1, True, False)])
def test_sequence_parallel_is_read_from_the_trainer_config(tp, sequence_parallel, want):
    """The converted config's ``update_from_config`` records whether tensor parallelism splits the residual stream
    by rows (the stock part is a stand-in here: torchtitan's imports its trainer, which needs tensorboard)."""
    from torchtitan.config import CompileConfig, ParallelismConfig

    class StockConfig:
        @staticmethod
        def update_from_config(model_config, *, config, **kwargs):
            pass

    class TrainerConfig:
        parallelism = ParallelismConfig(spmd_backend="partial_dtensor", tensor_parallel_degree=tp,
                                        enable_sequence_parallel=sequence_parallel)
        compile = CompileConfig()
    config = tt.convert_config(tiny_config())
    tt._update_from_config(config, StockConfig, TrainerConfig())
    assert config.codagen_sequence_parallel is want


def test_rejects_document_masks():
    model = converted_model(stock_model(tiny_config()))
    with pytest.raises(NotImplementedError, match="attention masks"):
        model(torch.zeros(1, 4, dtype=torch.long), attention_masks=object())


def _torchtitan_step(rank, world, kind, stock_state, tokens, tp=1, sequence_parallel=False, compile_backend=None,
                     checkpointing=False, chunked=False):
    """One forward/backward of the converted model through torchtitan's ``parallelize_llama`` / ``_qwen3``: tensor
    parallelism over ``tp`` ranks, FSDP over the other ``world // tp``, each data-parallel rank on its share of
    ``tokens``. ``checkpointing``: torchtitan's full activation checkpointing; ``compile_backend``: its per-block
    ``torch.compile``; ``chunked``: the loss is torchtitan's ``ChunkedLossWrapper`` (the LM head and loss per
    sequence chunk, the decoder's backward after them), set up as torchtitan's trainer does. Returns the full
    gradients and state dict in torchtitan's names, torchtitan's clipped gradient norm, the gradients'
    placements and those of block 0's ``wo`` and ``wqkv``."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import parallel_dims as parallel_dims_module
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.distributed.utils import clip_grad_norm_

    parallel_dims_module.device_type = "cpu"  # torchtitan's device_type is "cuda" even on a CPU-only torch
    dp = world // tp
    parallelism = ParallelismConfig(data_parallel_shard_degree=dp, tensor_parallel_degree=tp,
                                    enable_sequence_parallel=sequence_parallel, spmd_backend="partial_dtensor")
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    config = tt.convert_config(CONFIGS[kind]())
    model = derive(config, type(config), codagen_sequence_parallel=tp > 1 and sequence_parallel).build()
    model.init_states()
    model.load_state_dict(stock_state, strict=True)
    parallelize = {"llama3": llama3.parallelize_llama, "qwen3": qwen3.parallelize_qwen3}[kind]
    parallelize(model, parallel_dims=parallel_dims, training=TrainingConfig(mixed_precision_param="float32"),
                parallelism=parallelism, compile_config=CompileConfig(enable=compile_backend is not None,
                                                                      backend=compile_backend or "inductor"),
                ac_config=FullAC.Config() if checkpointing else None, dump_folder="")
    compiled = [getattr(block, "_compiled_call_impl", None) is not None for block in model.layers.values()]
    assert compiled == [compile_backend is not None] * LAYERS
    for module in model.modules():  # torchtitan divides by the global token count itself (gradient divide factor
        if isinstance(module, FSDPModule):  # 1), which gloo runs as a plain sum, having no PREMUL_SUM
            module.set_force_sum_reduction_for_comms(True)
    dp_rank = parallel_dims.get_mesh("fsdp").get_local_rank() if dp > 1 else 0
    rows = tokens.shape[0] // dp
    mine = tokens[dp_rank * rows:(dp_rank + 1) * rows]
    with codagen.use_backend("reference"):
        if chunked:
            loss_fn = ChunkedLossWrapper.Config(num_chunks=2, loss_fn=CrossEntropyLoss.Config()).build()
            loss_fn.set_lm_head(model.lm_head)
            model._skip_lm_head = True
            total_tokens = torch.tensor(float(tokens[:, 1:].numel()))  # torchtitan's global_valid_tokens
            loss_fn(model(mine[:, :-1]), mine[:, 1:], total_tokens)[0].backward()
        else:
            (loss(model, mine) / dp).backward()
    grad_norm = clip_grad_norm_(list(model.parameters()), max_norm=1e9)  # what torchtitan's trainer runs next
    grads = {name.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor() if isinstance(p.grad, DTensor)
             else p.grad for name, p in model.named_parameters()}
    tt._to_torchtitan_layout(model, grads, "", None)
    block = model.layers["0"]
    block = getattr(block, "_checkpoint_wrapped_module", block)
    return {"grads": grads, "grad_norm": grad_norm,
            "state": {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in model.state_dict().items()},
            "grad_placements": {p.grad.placements for p in model.parameters()},
            "block_placements": {str(block.wo.weight.placements), str(block.wqkv.weight.placements)}}


def _step_matches_stock(kind, world, **options) -> dict:
    """:func:`_torchtitan_step` on ``world`` gloo ranks against the stock model on the whole batch: every gradient,
    the clipped gradient norm and the state dict (torchtitan's names, the stock values). Returns the step's
    result."""
    stock = stock_model(CONFIGS[kind]())
    tokens = torch.randint(0, VOCAB, (2 * BATCH, SEQ + 1))
    loss(stock, tokens).backward()
    got = run_distributed(world, functools.partial(_torchtitan_step, **options), kind, stock.state_dict(), tokens)
    want = state_dict_of_grads(stock)
    assert set(got["grads"]) == set(want)
    for name, g in want.items():
        assert rel_err(got["grads"][name], g) < 1e-4, name
    assert rel_err(got["grad_norm"], torch.nn.utils.get_total_norm([p.grad for p in stock.parameters()])) < 1e-4
    for name, t in stock.state_dict().items():
        assert torch.equal(got["state"][name], t), name
    return got


@pytest.mark.parametrize("kind, compile_backend, chunked", [("llama3", None, False), ("llama3", "aot_eager", False),
                                                             ("qwen3", None, False), ("llama3", None, True)])
def test_fsdp_through_torchtitan_parallelize(kind, compile_backend, chunked):
    """Two gloo ranks under torchtitan's own FSDP2 + activation-checkpointing (+ per-block ``torch.compile``,
    ``fullgraph=True``; + torchtitan's chunked loss, which reshards the LM head's unit before the decoder's
    backward) steps: every gradient equals the stock model's on the whole batch, and the sharded state dict has
    torchtitan's names and values."""
    got = _step_matches_stock(kind, 2, compile_backend=compile_backend, checkpointing=True, chunked=chunked)
    assert got["grad_placements"] == {(torch.distributed.tensor.Shard(0),)}


@pytest.mark.parametrize("kind, dp, sequence_parallel, compile_backend", [
    ("llama3", 1, False, None), ("llama3", 1, True, None), ("qwen3", 1, True, None), ("llama3", 2, True, None),
    ("llama3", 1, True, "aot_eager")])
def test_tensor_parallel_through_torchtitan_parallelize(kind, dp, sequence_parallel, compile_backend):
    """torchtitan's own tensor-parallel step (``tensor_parallel_degree`` 2, with and without sequence
    parallelism; with ``dp`` 2 FSDP on top, 4 ranks; with per-block ``torch.compile``): every gradient and
    torchtitan's clipped gradient norm equal the stock model's on the whole batch, and the state dict has
    torchtitan's names and the stock values."""
    got = _step_matches_stock(kind, 2 * dp, tp=2, sequence_parallel=sequence_parallel, compile_backend=compile_backend)
    assert any("Shard(dim=1)" in p for p in got["block_placements"]), got["block_placements"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_gpu_two_x_rule(monkeypatch):
    """On the GPU (Triton backend, bf16): the converted model's loss and gradients against the stock model in
    float64 err at most twice as much as the stock model in bf16 (+1e-6)."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    stock = stock_model(tiny_config()).cuda()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device="cuda")
    runs = {"float64": copy.deepcopy(stock).double(), "torchtitan_bf16": copy.deepcopy(stock).bfloat16(),
            "codagen_bf16": converted_model(stock).cuda().bfloat16()}
    results = {}
    for name, model in runs.items():
        with codagen.use_backend("triton" if name == "codagen_bf16" else "reference"):
            value = loss(model, tokens)
            value.backward()
        grads = torchtitan_grads(model) if name == "codagen_bf16" else state_dict_of_grads(model)
        results[name] = {"loss": value.detach().double(), **{k: g.double() for k, g in grads.items()}}
    exact = results.pop("float64")
    assert rel_err(results["codagen_bf16"].pop("loss"), exact.pop("loss")) <= 2 ** -8
    for key, want in exact.items():
        ours, theirs = rel_err(results["codagen_bf16"][key], want), rel_err(results["torchtitan_bf16"][key], want)
        assert ours <= 2 * theirs + 1e-6, f"{key}: codagen {ours:.2e} vs torchtitan bf16 {theirs:.2e}"


def test_the_package_exports_what_the_docs_name():
    """``codagen.integrations.torchtitan`` re-exports the model module's public names, among them every
    ``Codagen...`` class the README and docs/ name."""
    import re
    from pathlib import Path

    from codagen.integrations import torchtitan as package
    root = Path(__file__).resolve().parents[2]
    named = {name for path in [root / "README.md", *(root / "docs").rglob("*.md")]
             for name in re.findall(r"\bCodagen[A-Z]\w*", path.read_text())}
    assert "CodagenQwen3Model" in named
    assert sorted(package.__all__) == sorted(tt.__all__)
    missing = sorted(name for name in named | set(tt.__all__) if not hasattr(package, name))
    assert not missing, f"codagen.integrations.torchtitan does not export {missing}"
