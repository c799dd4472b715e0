"""The example GPT (paramshard.models.gpt): shapes, tied weights, seeds, and that it learns."""

from __future__ import annotations

import pytest
import torch

from paramshard.models.gpt import GPT, CharTokenizer, GPTConfig, get_batch, lm_loss, load_text


def tiny_gpt(seed: int = 0, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny(**overrides))


def test_gpt_forward_shape_and_tied_weight() -> None:
    model = tiny_gpt()
    idx = torch.randint(model.config.vocab_size, (3, 16))
    assert model(idx).shape == (3, 16, model.config.vocab_size)
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names


def test_gpt_untied_has_separate_head() -> None:
    model = tiny_gpt(tie_weights=False)
    assert model.lm_head.weight is not model.wte.weight
    assert "lm_head.weight" in dict(model.named_parameters())


def test_gpt_same_seed_same_params() -> None:
    a, b = tiny_gpt(seed=3), tiny_gpt(seed=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(tiny_gpt(seed=4).wte.weight, a.wte.weight)


def test_gpt_loss_goes_down_on_pydoc_text() -> None:
    text = load_text()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    assert tokenizer.decode(data[:200]) == text[:200]
    model = tiny_gpt(vocab_size=tokenizer.vocab_size)
    optimizer = torch.optim.AdamW(model.param_groups(weight_decay=0.1), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        x, y = get_batch(data, 16, model.config.block_size, generator)
        assert torch.equal(x[:, 1:], y[:, :-1])
        loss = lm_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # From about ln(vocab) = 4.6 nats to about 3.1: it learns character frequencies and more.
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.6


def test_gpt_config_rejects_bad_heads() -> None:
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig.tiny(n_head=3)
