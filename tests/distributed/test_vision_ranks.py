"""A vision-language model's update on 2 ranks (FSDP2, gloo) is the update of 1 rank: samples
with pictures of different sizes and samples without any, split unevenly, so one rank's forward
passes may hold no image while the other's do; with the vision tower trained, frozen, and with
LoRA on the language model (whose adapter is all that moves)."""

from __future__ import annotations

import io
import json
import pickle
import random

import pytest
import torch
from PIL import Image

from rollover.modelzoo.tiny_vl import build_tiny_vl_model
from rollover.training.samples import RolloutScore, Sample, UpdateBatch
from rollover.vision.inputs import load_image_processor, pixel_inputs
from tests.distributed.test_update_ranks import launch, relative_difference

pytestmark = pytest.mark.slow  # two launches of real ranks

MODES = {
    "trained": [],
    "frozen": ["actor_rollout_ref.model.freeze_vision_tower=true"],
    "lora": ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.actor.optim.lr=1e-2"],
}


def vision_samples(model_dir) -> UpdateBatch:
    processor = load_image_processor(model_dir)
    image_id = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    rng = random.Random(3)
    samples = []
    sizes = [(56, 28), None, (84, 56), (28, 28), None, (112, 28), (56, 56)]
    for i, size in enumerate(sizes):
        pixels = None
        image_tokens: list[int] = []
        if size is not None:
            buffer = io.BytesIO()
            Image.new("RGB", size, (rng.randrange(256), rng.randrange(256), rng.randrange(256))).save(buffer, "PNG")
            pixels = pixel_inputs(processor, [buffer.getvalue()])
            image_tokens = [image_id] * pixels.tokens[0]
        text = [rng.randrange(3, 900) for _ in range(rng.randrange(4, 20))]
        ids = [2, *image_tokens, *text]
        prompt = 1 + len(image_tokens) + 2
        length = len(ids)
        behaviour = [0.0] * prompt + [-rng.uniform(0.5, 4.0) for _ in range(length - prompt)]
        samples.append(
            Sample(
                f"r{i}",
                f"g{i // 2}",
                ids,
                [0] * prompt + [1] * (length - prompt),
                behaviour,
                [0] * length,
                float(i % 2),
                images=() if pixels is None else (f"image{i}",),
                pixels=pixels,
            )
        )
    return UpdateBatch(samples, [RolloutScore(s.rollout_id, s.group_id, s.reward) for s in samples])


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    model_dir = build_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl") / "model", hidden_size=64, max_image_tokens=16)
    folders = {}
    for n_ranks in (1, 2):
        work = tmp_path_factory.mktemp(f"vision-{n_ranks}")
        (work / "samples.pkl").write_bytes(pickle.dumps((vision_samples(model_dir), 7)))
        (work / "modes.json").write_text(json.dumps(list(MODES.items())))
        launch(n_ranks, model_dir, work, "modes")
        folders[n_ranks] = work
    return model_dir, folders


@pytest.mark.parametrize("mode", list(MODES))
def test_two_ranks_take_the_step_one_rank_takes(updates, mode: str) -> None:
    _, folders = updates
    one, two = (torch.load(folders[n] / f"{mode}.pt", weights_only=True) for n in (1, 2))
    # Looser than the text models' 1e-5: each rank's vision tower attends over its own images'
    # patches, so float sums run in another order (measured 2.4e-5 to 3.1e-5 on 2 CPU ranks).
    assert relative_difference(one, two) < 1e-4
    metrics = [pickle.loads((folders[n] / f"{mode}.pkl").read_bytes()) for n in (1, 2)]
    assert metrics[0]["actor/pg_loss"] == pytest.approx(metrics[1]["actor/pg_loss"], rel=1e-4, abs=1e-6)


def test_the_modes_train_what_they_say(updates) -> None:
    from safetensors.torch import load_file

    model_dir, folders = updates
    # The gathered weights carry Qwen2-VL's checkpoint names (`visual.*`, `model.layers.*`), as
    # the file does.
    start = load_file(str(model_dir / "model.safetensors"))
    trained, frozen = (torch.load(folders[2] / f"{m}.pt", weights_only=True) for m in ("trained", "frozen"))

    def moved(weights: dict[str, torch.Tensor], part: str) -> bool:
        names = [n for n in weights if part in n and n in start]
        assert names, part
        return any(not torch.equal(weights[n], start[n]) for n in names)

    assert moved(trained, "visual.") and moved(trained, "model.layers.")
    assert not moved(frozen, "visual.") and moved(frozen, "model.layers.")
    lora = torch.load(folders[2] / "lora.pt", weights_only=True)
    adapters = [n for n in lora if "lora_" in n]
    assert adapters and not any("visual" in n for n in adapters)
