import math

import pytest
import torch

from rollover.training.loss.entropy import token_entropy


def _naive(logits: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits.double(), dim=-1)
    return -(p * p.log()).sum(dim=-1)


def _random_logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).requires_grad_(True)


def test_entropy_by_hand() -> None:
    # [0, 0]: ln 2;  [0, 0, 0, 0]: ln 4;  [0, ln 3]: p = (1/4, 3/4), H = -(¼ ln ¼ + ¾ ln ¾) ~ 0.5623;
    # one logit far above the rest: H ~ 0
    logits = torch.tensor(
        [[[0.0, 0.0, -1e4, -1e4], [0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -1e4, -1e4], [50.0, 0, 0, 0]]]
    )
    expected = [math.log(2), math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), 0.0]
    entropy = token_entropy(logits)
    assert entropy.shape == (1, 4)
    assert entropy.dtype == torch.float32
    assert entropy[0].tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 2, 7])
def test_chunked_equals_unchunked_in_value_and_gradient(chunk_size: int) -> None:
    # 3 x 5 = 15 tokens: chunk 1000 >= B·T is one chunk; 1, 2 and 7 leave ragged last chunks.
    whole_in, chunk_in = _random_logits(3, 5, 11), _random_logits(3, 5, 11)
    weights = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    whole = token_entropy(whole_in, chunk_size=1000)
    chunked = token_entropy(chunk_in, chunk_size=chunk_size)
    (whole * weights).sum().backward()
    (chunked * weights).sum().backward()
    assert torch.allclose(chunked, whole, atol=1e-6, rtol=0)
    assert whole_in.grad is not None and chunk_in.grad is not None
    assert torch.allclose(chunk_in.grad, whole_in.grad, atol=1e-6, rtol=0)


def test_equals_naive_reference_in_value_and_gradient() -> None:
    ours_in, naive_in = _random_logits(2, 4, 9), _random_logits(2, 4, 9)
    ours = token_entropy(ours_in, chunk_size=3)
    naive = _naive(naive_in)
    assert torch.allclose(ours.double(), naive, atol=1e-5, rtol=0)
    ours.sum().backward()
    naive.sum().backward()
    assert ours_in.grad is not None and naive_in.grad is not None
    assert torch.allclose(ours_in.grad, naive_in.grad, atol=1e-5, rtol=0)


def test_target_aligned_slice_is_not_copied_and_matches() -> None:
    # logits[:, :-1] cannot be viewed as [B·T, V]; the entropy is taken per sequence instead.
    logits = _random_logits(3, 6, 5)
    sliced = logits[:, :-1]
    assert not sliced.is_contiguous()
    assert torch.allclose(token_entropy(sliced, chunk_size=2), _naive(sliced).float(), atol=1e-5)


def test_backward_keeps_no_softmax_of_any_chunk() -> None:
    # Every tensor autograd saves for backward is a view of the logits themselves (the chunk
    # inputs of the checkpoints): no [chunk, V] softmax or float32 copy is kept.
    logits = _random_logits(2, 8, 50)
    storage = logits.untyped_storage().data_ptr()
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        entropy = token_entropy(logits, chunk_size=4)
    assert len(saved) == 4  # one per chunk: 16 tokens / 4
    assert all(pointer == storage for pointer in saved)
    entropy.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_low_precision_logits_give_float32_entropy() -> None:
    logits = torch.randn(2, 3, 8).to(torch.bfloat16)
    entropy = token_entropy(logits)
    assert entropy.dtype == torch.float32
    assert torch.allclose(entropy, _naive(logits.float()).float(), atol=1e-5)


def test_no_grad_path_matches() -> None:
    logits = _random_logits(2, 3, 6)
    with torch.no_grad():
        plain = token_entropy(logits, chunk_size=2)
    assert not plain.requires_grad
    assert torch.allclose(plain, token_entropy(logits, chunk_size=2).detach())
