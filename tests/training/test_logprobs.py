import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollover.training.logprobs import token_logprobs


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


LENGTHS = [7, 5, 3]


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        ids[row, n:] = 0  # right padding
        mask[row, :n] = 1
    return ids, mask


def _naive(model: LlamaForCausalLM, ids: torch.Tensor, temperature: float) -> list[list[float]]:
    # One forward per (row, position) on the unpadded prefix, then a full log-softmax.
    out = []
    for row, n in enumerate(LENGTHS):
        values = []
        for t in range(n - 1):
            prefix = ids[row : row + 1, : t + 1]
            logits = model(input_ids=prefix).logits[0, -1] / temperature
            values.append(torch.log_softmax(logits, dim=-1)[ids[row, t + 1]].item())
        out.append(values)
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("micro_batch_size", [None, 2])
def test_matches_naive_per_position_loop(
    model: LlamaForCausalLM,
    batch: tuple[torch.Tensor, torch.Tensor],
    temperature: float,
    micro_batch_size: int | None,
) -> None:
    ids, mask = batch
    with torch.no_grad():
        got = token_logprobs(model, ids, mask, temperature=temperature, micro_batch_size=micro_batch_size)
        expected = _naive(model, ids, temperature)
    assert got.shape == (len(LENGTHS), max(LENGTHS) - 1)
    assert got.dtype == torch.float32
    assert not got.requires_grad
    for row, n in enumerate(LENGTHS):
        assert got[row, : n - 1].tolist() == pytest.approx(expected[row], abs=1e-5)
    assert torch.isfinite(got).all()


def test_gradients_flow_in_grad_mode(model: LlamaForCausalLM, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    ids, mask = batch
    model.zero_grad()
    got = token_logprobs(model, ids, mask, micro_batch_size=1)
    assert got.requires_grad
    got[0, :3].sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    model.zero_grad()


def test_rejects_bad_arguments(model: LlamaForCausalLM, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    ids, mask = batch
    with pytest.raises(ValueError):
        token_logprobs(model, ids, mask, temperature=0.0)
    with pytest.raises(ValueError):
        token_logprobs(model, ids, mask[:, :-1])
