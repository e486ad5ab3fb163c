"""A patched model trained by ``transformers.Trainer`` (padding collator, gradient accumulation) logs the
unpatched run's losses and ends at its parameters (SGD: Adam's normalized steps would magnify rounding
differences in near-zero gradients); bf16 mixed precision (accelerate's autocast) runs."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from codagen.models import patch

from .conftest import build

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


WORDS = "the a cat dog sat on mat ran fast slow red blue big small and then".split()


def word_tokenizer():
    """A word-level tokenizer over WORDS (ids 2..), ``<pad>`` 0, ``<unk>`` 1."""
    vocab = {"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


def ragged_dataset(tokenizer, rows=16):
    """Sentences of 3..12 words: every batch of 4 pads."""
    g = torch.Generator().manual_seed(0)
    sentences = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(n),), generator=g))
                 for n in torch.randint(3, 13, (rows,), generator=g)]
    return [tokenizer(s) for s in sentences]


def train(model, tmp_path, *, bf16=False, padding_side="right", steps=3, gradient_checkpointing=False, collator=None):
    tokenizer = word_tokenizer()
    tokenizer.padding_side = padding_side
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=steps,
        optim="sgd", learning_rate=0.5, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
        bf16=bf16, disable_tqdm=True, gradient_checkpointing=gradient_checkpointing)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=ragged_dataset(tokenizer),
        data_collator=collator or transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def tiny_model():
    return build("llama", vocab_size=len(WORDS) + 2, pad_token_id=0)


@pytest.mark.parametrize("padding_side,gradient_checkpointing", [("right", False), ("left", False), ("right", True)])
def test_trainer_matches_unpatched(tmp_path, padding_side, gradient_checkpointing):
    model = tiny_model()
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    want = train(reference, tmp_path / "reference", padding_side=padding_side)
    got = train(patch(model), tmp_path / "patched", padding_side=padding_side,
                gradient_checkpointing=gradient_checkpointing)
    assert len(got) == len(want) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-6)
    expected, start = dict(reference.named_parameters()), dict(initial.named_parameters())
    for name, p in model.named_parameters():
        assert (p - start[name]).abs().max() > 1e-5, f"{name} did not move"  # three small SGD steps
        torch.testing.assert_close(p, expected[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_trainer_bf16_autocast(tmp_path):
    """``bf16=True`` on CPU: accelerate runs the forward under ``torch.autocast("cpu", bfloat16)``, which the
    patched forward turns into a bf16 run of the fused ops; the losses follow the fp32 run's to bf16 accuracy."""
    model = tiny_model()
    reference = copy.deepcopy(model)
    want = train(reference, tmp_path / "reference")
    got = train(patch(model), tmp_path / "patched", bf16=True)
    assert all(math.isfinite(loss) for loss in got) and got != want  # bf16 rounding shows: autocast was on
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=3e-2, atol=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights


def test_trainer_packed_matches_unpatched(tmp_path):
    """DataCollatorWithFlattening: each batch one row of documents, position_ids restarting per document. The
    unpatched model separates them only without a cache (use_cache=False, see tests/models/test_hf_padding.py)."""
    model = build("llama", vocab_size=len(WORDS) + 2, pad_token_id=0, use_cache=False)
    reference = copy.deepcopy(model)
    collator = transformers.DataCollatorWithFlattening()
    want = train(reference, tmp_path / "reference", collator=collator)
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True)
    got = train(patch(model), tmp_path / "patched", collator=collator)
    assert seen and all("position_ids" in keys and "attention_mask" not in keys for keys in seen)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-6)
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, expected[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
