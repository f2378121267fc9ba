"""Updates of a vision-language model (the tiny Qwen2-VL) on samples with images: the pixels
reach the update (what Agent Lightning #559 found missing), through the model's own processor
and positions; turns merge with their images in order; the vision tower is frozen by a key and
left out of LoRA's adapters."""

from __future__ import annotations

import asyncio
import io
import random
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from rollover.config import load_config
from rollover.modelzoo.tiny_vl import IMAGE_PAD, build_tiny_vl_model
from rollover.training.actor import Actor
from rollover.training.images import SampleImages
from rollover.training.logprobs import token_logprobs, token_logprobs_and_sum_pi_squared
from rollover.training.samples import RolloutScore, Sample, UpdateBatch, build_samples, collate
from rollover.training.update_settings import ActorSettings
from rollover.vision.inputs import expand_placeholders, load_image_processor, pixel_inputs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl") / "model", max_image_tokens=16)


def picture(text: str, background: str = "white") -> bytes:
    image = Image.new("RGB", (56, 28), background)
    ImageDraw.Draw(image).text((4, 8), text, fill="gray")
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def policy_of(model_dir: Path, *overrides: str) -> Actor:
    torch.manual_seed(0)
    config = load_config(
        None,
        [
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.actor.optim.lr=3e-3",
            "trainer.device=cpu",
            "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
            *overrides,
        ],
    )
    return Actor.load(model_dir, ActorSettings.from_config(config))


def image_sample(policy: Actor, model_dir: Path, data: bytes, reward: float, rid: str) -> Sample:
    """One call: an image and a question, answered `5`; its behaviour logprobs the policy's own."""
    tokenizer = policy.tokenizer
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pixels = pixel_inputs(load_image_processor(model_dir), [data])
    ids = expand_placeholders(tokenizer(prompt, add_special_tokens=False)["input_ids"], image_id, pixels.tokens)
    response = tokenizer("5<|im_end|>", add_special_tokens=False)["input_ids"]
    sample = Sample(
        rid,
        "g",
        ids + response,
        [0] * len(ids) + [1] * len(response),
        [0.0] * (len(ids) + len(response)),
        [0] * (len(ids) + len(response)),
        reward=reward,
        images=(rid,),
        pixels=pixels,
    )
    sample.behaviour_logprobs = [0.0, *response_logprobs(policy, [sample])[0].tolist()]
    return sample


def response_logprobs(policy: Actor, samples: list[Sample]) -> list[torch.Tensor]:
    batch = collate(samples, policy.pad_token_id)
    with torch.no_grad():
        logprobs = token_logprobs(
            policy.model,
            batch["input_ids"],
            batch["attention_mask"],
            pixel_values=batch.get("pixel_values"),
            image_grid_thw=batch.get("image_grid_thw"),
        )
    return [logprobs[row, : len(s) - 1] for row, s in enumerate(samples)]


def answer_logprob(policy: Actor, sample: Sample) -> float:
    [logprobs] = response_logprobs(policy, [sample])
    mask = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
    return float(logprobs[mask].sum())


def update(policy: Actor, samples: list[Sample]) -> dict[str, float]:
    rollouts = [RolloutScore(s.rollout_id, s.group_id, s.reward) for s in samples]
    return policy.update(UpdateBatch(samples, rollouts), random.Random(0), lr=3e-3)


def visual_and_text(policy: Actor) -> tuple[torch.Tensor, torch.Tensor]:
    named = dict(policy.model.named_parameters())
    visual = next(p for n, p in named.items() if ".visual." in f".{n}" and n.endswith("qkv.weight"))
    text = next(p for n, p in named.items() if "language_model" in n and n.endswith("q_proj.weight"))
    return visual.detach().clone(), text.detach().clone()


def test_the_update_sees_the_image(model_dir: Path) -> None:
    """Two rollouts differ only in their image: the rewarded one's answer becomes likelier than
    the other's. Text-only training could not tell them apart (the gap would stay 0)."""
    policy = policy_of(model_dir)
    good = image_sample(policy, model_dir, picture("7", "black"), 1.0, "good")
    bad = image_sample(policy, model_dir, picture("3", "white"), 0.0, "bad")
    assert good.input_ids == bad.input_ids  # the same tokens: only the pixels differ
    gap_before = answer_logprob(policy, good) - answer_logprob(policy, bad)
    for _ in range(8):
        for sample in (good, bad):  # sampled by the current policy, as on-policy rollouts are
            sample.behaviour_logprobs = [0.0, *response_logprobs(policy, [sample])[0].tolist()]
        update(policy, [good, bad])
    gap_after = answer_logprob(policy, good) - answer_logprob(policy, bad)
    assert gap_after - gap_before > 0.5, (gap_before, gap_after)


def test_pi_old_of_an_image_sample_is_the_models_own_forward_pass(model_dir: Path) -> None:
    """With behaviour logprobs taken from the model, the update's importance ratios are 1."""
    policy = policy_of(model_dir, "algorithm.rollout_correction.rollout_is=token")
    samples = [image_sample(policy, model_dir, picture(str(d)), float(d % 2), f"r{d}") for d in range(3)]
    metrics = update(policy, samples)
    assert abs(metrics["rollout_corr/kl"]) < 1e-5 and metrics["actor/behaviour_mismatch_abs"] < 1e-5


@pytest.mark.parametrize("frozen", [True, False])
def test_freeze_vision_tower(model_dir: Path, frozen: bool) -> None:
    policy = policy_of(model_dir, f"actor_rollout_ref.model.freeze_vision_tower={str(frozen).lower()}")
    visual, text = visual_and_text(policy)
    update(
        policy,
        [
            image_sample(policy, model_dir, picture("7"), 1.0, "a"),
            image_sample(policy, model_dir, picture("1"), 0.0, "b"),
        ],
    )
    visual_after, text_after = visual_and_text(policy)
    assert not torch.equal(text, text_after)
    assert torch.equal(visual, visual_after) == frozen


def test_lora_adapts_the_language_model_only(model_dir: Path) -> None:
    policy = policy_of(model_dir, "actor_rollout_ref.model.lora_rank=4")
    adapted = [n for n, _ in policy.model.named_parameters() if "lora_" in n]
    assert adapted and all("language_model" in n for n in adapted)
    assert not any(".visual." in n for n in adapted)
    metrics = update(
        policy,
        [
            image_sample(policy, model_dir, picture("7"), 1.0, "a"),
            image_sample(policy, model_dir, picture("1"), 0.0, "b"),
        ],
    )
    assert metrics["actor/grad_norm"] > 0


def test_several_policies_train_each_adapter_on_its_own_image_samples(model_dir: Path) -> None:
    """Two policies (a LoRA adapter each): image samples of one move its adapter alone, and
    π_old goes through that adapter with the image (the importance ratios are 1)."""
    from dataclasses import replace

    from rollover.training import lora

    policy = policy_of(
        model_dir,
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.rollout.max_loras=2",
        "agentlightning.policies={reader: {}, writer: {}}",
        "algorithm.rollout_correction.rollout_is=token",
    )

    def adapter(name: str) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in policy.model.named_parameters() if f".{name}." in n}

    lora.activate(policy.model, "reader")  # the behaviour logprobs are the reader's own
    samples = [
        replace(image_sample(policy, model_dir, picture(digit), reward, f"r{digit}"), policy="reader")
        for digit, reward in (("7", 1.0), ("1", 0.0))
    ]
    reader, writer = adapter("reader"), adapter("writer")
    metrics = update(policy, samples)
    assert abs(metrics["rollout_corr/kl"]) < 1e-5 and metrics["actor/behaviour_mismatch_abs"] < 1e-5
    assert metrics["policy/reader/n_samples"] == 2 and "policy/writer/actor/pg_loss" not in metrics
    moved = adapter("reader")
    assert any(not torch.equal(reader[n], moved[n]) for n in reader), "the reader's adapter did not move"
    assert all(torch.equal(writer[n], p) for n, p in adapter("writer").items()), "the writer moved"


def test_turns_merge_with_their_images_in_order() -> None:
    first = {"prompt_token_ids": [1, 9, 9, 2], "response_token_ids": [3], "policy_version": 0, "images": ["a"]}
    second = {
        "prompt_token_ids": [1, 9, 9, 2, 3, 4, 9, 9, 2],
        "response_token_ids": [5],
        "policy_version": 0,
        "images": ["a", "b"],
    }
    [merged] = build_samples("r", "g", [first, second], 1.0, None)
    assert merged.images == ("a", "b") and merged.loss_mask == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    # The same placeholder ids with another first image do not continue the sample.
    other = second | {"images": ["c", "b"]}
    assert [s.images for s in build_samples("r", "g", [first, other], 1.0, None)] == [("a",), ("c", "b")]


def test_samples_get_their_pixels_and_mismatched_ones_are_dropped(model_dir: Path) -> None:
    images = SampleImages(model_dir, fetch=lambda sha: _fetched(sha))
    image_id = images.image_token_id
    # A 56x28 picture is 2 image tokens.
    good = Sample("r1", "g", [1, image_id, image_id, 2, 3], [0, 0, 0, 0, 1], [0.0] * 5, [0] * 5, 1.0, images=("x",))
    cut = Sample("r2", "g", [image_id, 2, 3], [0, 0, 1], [0.0] * 3, [0] * 3, 1.0, images=("x",))
    batch, dropped = asyncio.run(images.attach(UpdateBatch([good, cut], [])))
    assert batch.samples == [good] and dropped == 1
    assert good.pixels is not None and good.pixels.tokens == (2,)
    assert collate([good], 0)["image_grid_thw"].tolist() == [[1, 2, 4]]


async def _fetched(sha: str) -> bytes:
    assert sha == "x"
    return picture("x")


def test_a_saved_model_keeps_its_image_processor(model_dir: Path, tmp_path: Path) -> None:
    """A checkpoint (or the final model) reads images as the run did: resumed or served from it."""
    saved = policy_of(model_dir).save(tmp_path / "step_1" / "model")
    assert (saved / "preprocessor_config.json").read_text() == (model_dir / "preprocessor_config.json").read_text()
    assert load_image_processor(saved).merge_size == 2


def test_a_sample_reads_the_same_alone_and_in_a_padded_batch(model_dir: Path) -> None:
    """Rows of other lengths, with and without pictures, change nothing of a sample's logprobs:
    its images go to its own placeholders, its positions ignore the padding."""
    policy = policy_of(model_dir)
    first = image_sample(policy, model_dir, picture("7"), 1.0, "a")
    text_only = Sample("t", "g", first.input_ids[:3] + [5] * 30, [0, 0, 0] + [1] * 30, [0.0] * 33, [0] * 33, 0.0)
    second = image_sample(policy, model_dir, picture("2", "black"), 0.0, "b")
    alone = [response_logprobs(policy, [s])[0] for s in (first, text_only, second)]
    together = response_logprobs(policy, [first, text_only, second])
    for one, batched in zip(alone, together):
        assert torch.allclose(one, batched, atol=1e-5)


@pytest.mark.parametrize("lora", [False, True])
def test_pi_ref_and_sum_pi_squared_see_the_image(model_dir: Path, lora: bool) -> None:
    """The passes before the optimizer steps (π_old with Σπ², π_ref: the frozen model, or with
    LoRA the adapter switched off) give an image sample its pixels, as the loss's pass does."""
    policy = policy_of(
        model_dir,
        "actor_rollout_ref.actor.use_kl_loss=true",
        "algorithm.adv_estimator=optimal_token_baseline",
        *(["actor_rollout_ref.model.lora_rank=4"] if lora else []),
    )
    assert policy.reference is not None
    sample = image_sample(policy, model_dir, picture("7", "black"), 1.0, "a")
    other = image_sample(policy, model_dir, picture("3", "white"), 0.0, "b")  # the same tokens
    [with_image] = response_logprobs(policy, [sample])
    [recomputed] = policy.recompute([sample])
    assert recomputed.ref is not None and recomputed.sum_pi_squared is not None
    assert torch.allclose(recomputed.old, with_image, atol=1e-5)
    assert torch.allclose(recomputed.ref, with_image, atol=1e-5)  # the reference is the model as it started
    [other_image] = response_logprobs(policy, [other])
    assert not torch.allclose(recomputed.ref, other_image, atol=1e-4)
    batch = collate([sample], policy.pad_token_id)
    with torch.no_grad():
        _, squares = token_logprobs_and_sum_pi_squared(
            policy.model,
            batch["input_ids"],
            batch["attention_mask"],
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
        )
    assert torch.allclose(recomputed.sum_pi_squared, squares[0, : len(sample) - 1], atol=1e-5)


def test_the_gathered_weights_carry_the_checkpoints_names(model_dir: Path) -> None:
    """What the weight sync writes for the engine is named as the model's checkpoint is (vLLM
    reloaded transformers 5's in-memory names, `model.language_model.*`, into the wrong places)."""
    from safetensors import safe_open

    policy = policy_of(model_dir)
    weights = policy.full_state_dict(keep=True)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as checkpoint:
        names = set(checkpoint.keys())
        assert set(weights) == names
        for name in names:
            torch.testing.assert_close(weights[name], checkpoint.get_tensor(name))
