"""Evaluation outputs of a patched model: without autograd, ``labels`` give the loss and the logits, as
transformers does (``Trainer.evaluate`` / ``predict`` with ``compute_metrics`` read the logits); with autograd
the loss alone (the fused cross-entropy keeps no logits). ``shift_labels`` alone give logits and no loss."""
from __future__ import annotations

import copy

import pytest
import torch

import codagen
from codagen.models import patch

from .conftest import BACKENDS, build, lm_inputs
from .test_hf_trainer import ragged_dataset, tiny_model, word_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_items", [False, True])
def test_no_grad_labels_give_loss_and_logits(num_items, backend):
    model = build("qwen3").eval()
    reference = copy.deepcopy(model)
    inputs = lm_inputs()
    if num_items:
        inputs["num_items_in_batch"] = torch.tensor(17)
    with torch.no_grad():
        want = reference(**inputs)
        patch(model)
        with codagen.use_backend(backend):
            got = model(**inputs)
    assert got.logits is not None and got.logits.shape == want.logits.shape
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-6)


def test_labels_with_autograd_give_the_loss_alone():
    model = patch(build("llama"))
    with codagen.use_backend("reference"):
        assert model(**lm_inputs()).logits is None


@pytest.mark.parametrize("grad", [False, True])
def test_shift_labels_alone_give_logits_and_no_loss(grad):
    model = build("llama")
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 67, (2, 9))
    shifted = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    with torch.set_grad_enabled(grad):
        want = reference(input_ids=ids, shift_labels=shifted)
        patch(model)
        with codagen.use_backend("reference"):
            got = model(input_ids=ids, shift_labels=shifted)
    assert want.loss is None and got.loss is None
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)


def test_shift_labels_with_labels_take_the_loss_from_shift_labels():
    model = build("llama")
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 67, (2, 9))
    shifted = torch.randint(0, 67, (2, 9))  # unrelated to labels: the loss shows which one was used
    want = reference(input_ids=ids, labels=ids, shift_labels=shifted).loss
    patch(model)
    with codagen.use_backend("reference"):
        got = model(input_ids=ids, labels=ids, shift_labels=shifted).loss
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def _metrics(prediction):
    """Accuracy, and the mean logit of each target: a random model's accuracy may be 0, its target logit is not."""
    logits, labels = prediction.predictions, prediction.label_ids
    logits = logits[0] if isinstance(logits, tuple) else logits
    logits, targets = torch.as_tensor(logits[:, :-1]), torch.as_tensor(labels[:, 1:])
    keep = targets != -100
    target_logit = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return {"accuracy": float((logits.argmax(-1)[keep] == targets[keep]).float().mean()),
            "target_logit": float(target_logit[keep].mean())}


def _trainer(model, tmp_path):
    tokenizer = word_tokenizer()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[],
                                          use_cpu=True, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, eval_dataset=ragged_dataset(tokenizer, rows=8),
                                data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
                                compute_metrics=_metrics)


def test_trainer_evaluate_and_predict_match_unpatched(tmp_path):
    model = tiny_model()
    reference = copy.deepcopy(model)
    want = _trainer(reference, tmp_path / "reference")
    got = _trainer(patch(model), tmp_path / "patched")
    want_metrics, got_metrics = want.evaluate(), got.evaluate()
    assert got_metrics["eval_target_logit"] != 0
    torch.testing.assert_close(got_metrics["eval_target_logit"], want_metrics["eval_target_logit"],
                               rtol=1e-4, atol=1e-5)
    assert got_metrics["eval_accuracy"] == want_metrics["eval_accuracy"]
    torch.testing.assert_close(got_metrics["eval_loss"], want_metrics["eval_loss"], rtol=1e-4, atol=1e-6)
    want_prediction = want.predict(want.eval_dataset)
    got_prediction = got.predict(got.eval_dataset)
    assert got_prediction.predictions.shape == want_prediction.predictions.shape
    torch.testing.assert_close(torch.as_tensor(got_prediction.predictions),
                               torch.as_tensor(want_prediction.predictions), rtol=1e-4, atol=1e-5)
    assert got_prediction.metrics["test_accuracy"] == want_prediction.metrics["test_accuracy"]
