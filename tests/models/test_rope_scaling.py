"""RoPE scaling types beyond ``default``/``linear``/``llama3``: YaRN (static frequencies and an attention factor
that scales cos and sin, folded into the Q/K rows or the QK-norm weights), LongRoPE and dynamic NTK (frequencies
the rotary module picks per forward from the largest position). The patched model trains and generates as the
unpatched one in fp32 on CPU, on both sides of the switch the frequencies make."""
from __future__ import annotations

import copy

import pytest

from codagen.models import decode_graphs, families, patch

from .conftest import BACKENDS, assert_same_training, build, lm_inputs, lora_config
from .test_hf_generate import assert_generates_as_unpatched
from .test_lora import assert_matches, wrap

transformers = pytest.importorskip("transformers")

HEAD_PAIRS = 4  # head_dim 8 in the tiny configs (hidden 32, 4 heads)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 8,
            "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0]}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}

CASES = {  # name -> (family, config overrides)
    "llama_yarn": ("llama", dict(rope_parameters={"rope_theta": 10000.0, **YARN})),
    "qwen2_yarn": ("qwen2", dict(rope_parameters={"rope_theta": 10000.0, **YARN})),  # Q/K/V biases scaled too
    "qwen3_yarn": ("qwen3", dict(rope_parameters={"rope_theta": 10000.0, **YARN})),  # the QK-norm weights scaled
    "phi3_longrope": ("phi3", dict(original_max_position_embeddings=8, rope_parameters={"rope_theta": 10000.0,
                                                                                      **LONGROPE})),
    "llama_dynamic": ("llama", dict(max_position_embeddings=8, rope_parameters={"rope_theta": 10000.0, **DYNAMIC})),
    # Phi-4-mini's: LongRoPE over three quarters of each head (here half: 2 of 4 pairs)
    "phi3_partial_longrope": ("phi3", dict(original_max_position_embeddings=8, rope_parameters={
        "rope_theta": 10000.0, **LONGROPE, "short_factor": [1.0, 2.0], "long_factor": [4.0, 16.0],
        "partial_rotary_factor": 0.5})),
}


def model_of(case: str, **overrides):
    family, fields = CASES[case]
    if family == "qwen3":
        fields = dict(fields, head_dim=8)
    return build(family, **fields, **overrides)


def test_the_cases_scale():
    """YaRN's and LongRoPE's attention factor is not 1 and the position-dependent types are recognised."""
    for case in ("llama_yarn", "phi3_longrope", "phi3_partial_longrope"):
        assert model_of(case).model.rotary_emb.attention_scaling > 1.01
    assert families.rope_from_positions(model_of("phi3_longrope"))
    assert families.rope_from_positions(model_of("llama_dynamic"))
    assert not families.rope_from_positions(model_of("llama_yarn"))


@pytest.mark.parametrize("seq", [6, 20])  # below and above LongRoPE's original length and dynamic's max positions
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_trains_as_unpatched(case, backend, seq):
    assert_same_training(model_of(case), lm_inputs(seq=seq), backend=backend)


@pytest.mark.parametrize("case", ["qwen2_yarn", "phi3_longrope"])
def test_lora(case):
    family = CASES[case][0]
    targets = [n for _, names in families.lora_slots(families.FAMILIES[family]) for n in names]
    model = wrap(model_of(case), lora_config(targets))
    reference = copy.deepcopy(model)
    patch(model)
    assert_matches(model, reference, lm_inputs(seq=20))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_generate_matches_unpatched(case, cache):
    """Prompts of 7 tokens and 6 new ones: LongRoPE's and dynamic RoPE's frequencies switch during decoding."""
    model = model_of(case, max_position_embeddings=64) if case != "llama_dynamic" else model_of(case)
    assert_generates_as_unpatched(model.eval(), cache)


def test_frequencies_from_positions_keep_decode_steps_eager():
    """A captured decode graph would replay one step's frequencies: those models' steps run eagerly."""
    for case, replays in (("phi3_longrope", False), ("llama_dynamic", False), ("llama_yarn", True)):
        graphs = decode_graphs._ModelGraphs()
        graphs.check(patch(model_of(case)).eval())
        assert graphs.eligible == replays, case
