"""Training convergence: a tiny LLaMA trained 30 steps with codagen and with eager PyTorch, from the
same init on the same batches, follows the same loss curve and ends at the same parameters.

float64, so the comparison is tight: in fp32, 30 Adam steps amplify last-bit differences of small
gradients (Adam divides by their running RMS) into ~1e-4 parameter differences, which says nothing
about the kernels; single fp32 steps are compared in test_models.py and test_hf.py."""
from __future__ import annotations

import torch

from codagen.models import Llama, LlamaConfig, ReferenceLlama


def test_training_matches_eager_pytorch():
    config = LlamaConfig(vocab_size=53, hidden_size=48, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, rope_theta=1000.0)
    fused = Llama(config, dtype=torch.float64)
    eager = ReferenceLlama(config).double()
    eager.load_state_dict(fused.to_hf_state_dict())
    # A learnable stream: each token is the previous one plus a per-sequence step, mod vocab.
    steps, batch, seq = 30, 4, 24
    starts = torch.randint(0, config.vocab_size, (steps, batch, 1))
    strides = torch.randint(1, 4, (steps, batch, 1))
    tokens = (starts + strides * torch.arange(seq + 1)) % config.vocab_size

    losses = {}
    for name, model in (("codagen", fused), ("eager", eager)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        losses[name] = []
        for step in range(steps):
            loss = model(tokens[step, :, :-1], tokens[step, :, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())

    torch.testing.assert_close(torch.tensor(losses["codagen"], dtype=torch.float64),
                               torch.tensor(losses["eager"], dtype=torch.float64), rtol=1e-9, atol=1e-9)
    assert losses["eager"][-1] < 0.8 * losses["eager"][0], "the model did not learn: the comparison is vacuous"
    final = fused.to_hf_state_dict()
    for name, p in eager.state_dict().items():
        torch.testing.assert_close(final[name], p, rtol=1e-7, atol=1e-8, msg=lambda m: f"{name}: {m}")
