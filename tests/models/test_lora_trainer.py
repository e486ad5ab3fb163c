"""``transformers.Trainer`` fine-tunes a patched PEFT LoRA model: a few optimizer steps with gradient
accumulation 2 log the same losses, and end with the same LoRA weights, as the unpatched model.

SGD, as in ``tests/test_hf_trainer.py``: the final weights are linear in the summed gradients, so they compare
at fp32 precision. AdamW divides each element's step by its own gradient history, so an element whose
gradient sits at the fp32 rounding floor moves by up to ``lr`` either way on rounding alone: against a
float64 copy trained the same way, the unpatched fp32 model itself ends 5.6e-4 off in such an element
(``lr=1e-2``), whatever computes the gradients."""
from __future__ import annotations

import copy

import pytest
import torch

import codagen

from .conftest import build, lora_config

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


class TokenDataset(torch.utils.data.Dataset):
    """Equal-length random sequences, labels = input ids (no padding: every batch stacks as is)."""

    def __init__(self, count: int, seq: int, vocab: int):
        self.ids = torch.randint(0, vocab, (count, seq))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def collate(items):
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def train(model, dataset, output_dir) -> tuple[list[float], dict[str, torch.Tensor]]:
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        optim="sgd", learning_rate=0.5, logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no",
        dataloader_num_workers=0, lr_scheduler_type="constant", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate)
    with codagen.use_backend("reference"):
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_trainer_losses_match_unpatched(tmp_path, seed=0):
    torch.manual_seed(seed)  # fixed inputs: the test runs the same every time
    model = peft.get_peft_model(build("llama"), lora_config())
    reference = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    codagen.patch(model)
    dataset = TokenDataset(count=12, seq=16, vocab=67)
    want_losses, want = train(reference, dataset, tmp_path / "eager")
    got_losses, got = train(model, dataset, tmp_path / "codagen")
    assert len(got_losses) == 3 and len(set(want_losses)) == 3  # three steps, and training moves the loss
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=1e-4, atol=1e-6)
    assert set(got) == set(initial) and all(not torch.equal(got[n], initial[n]) for n in initial)
    for name, w in want.items():
        assert (w - initial[name]).abs().max() > 1e-4, f"{name} did not move"  # three SGD steps
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
