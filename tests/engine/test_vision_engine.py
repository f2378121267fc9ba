"""The tiny vision-language model served by vLLM (CPU, no torchvision) behind the gateway: an
OpenAI chat call with an image returns token ids, the record keeps the prompt as the engine
expanded it (one run of placeholder tokens per image, as the model's processor counts them),
and the model's own forward pass (pixel inputs through its processor, its mRoPE positions)
gives the engine's logprobs of the response to < 1e-3."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image, ImageDraw

from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayThread
from rollover.modelzoo.tiny_vl import IMAGE_PAD
from rollover.vision.inputs import image_runs, load_image_processor, pixel_inputs, position_ids
from tests.conftest import ADMIN_KEY

pytestmark = pytest.mark.vllm


def picture(text: str, size: tuple[int, int]) -> bytes:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((3, 8), text, fill="black")
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def served(vision_model, vision_engine):
    with GatewayThread(admin_key=ADMIN_KEY) as gateway:
        asyncio.run(vision_engine.register_with_gateway(gateway.url, ADMIN_KEY))
        yield vision_model, vision_engine, gateway


def test_an_image_call_through_the_gateway_is_recorded_as_the_engine_expanded_it(served) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model_dir, engine, gateway = served
    admin = httpx.Client(base_url=gateway.url, headers={"x-api-key": ADMIN_KEY}, timeout=120)
    assert admin.get("/api/models").json()[0]["max_images"] == 2
    rollout = admin.post("/api/rollouts", json=[{"input": {}}]).json()[0]["rollout_id"]
    admin.patch(f"/api/rollouts/{rollout}", json={"status": {"state": "running", "last_attempt_id": "a1"}})
    images = [picture("37+45", (140, 28)), picture("9", (56, 56))]
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}
        for data in images
    ]
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": [content[0], {"type": "text", "text": "and"}, content[1]]}],
        "max_tokens": 12,
    }
    url = f"{gateway.url}/proxy/rollout/{rollout}/attempt/a1/mode/train/openai/v1/chat/completions"
    headers = {"Authorization": f"Bearer {scoped_key(ADMIN_KEY, rollout, 'a1')}"}
    response = httpx.post(url, json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    [event] = admin.get(f"/api/rollouts/{rollout}/events", params={"event_type": "model_request"}).json()
    record = event["data"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    processor = load_image_processor(model_dir)
    pixels = pixel_inputs(processor, [admin.get(f"/api/images/{i['sha256']}").content for i in record["images"]])
    assert image_runs(record["prompt_token_ids"], image_id) == list(pixels.tokens) == [5, 4]
    # Three images: more than the engine takes, refused by the gateway before the engine.
    too_many = httpx.post(url, json=body | {"messages": [{"role": "user", "content": content * 2}]}, headers=headers)
    assert too_many.status_code == 400 and "at most 2" in too_many.json()["reason"]

    # The trainer's recompute of the response: the model's own inputs give the engine's logprobs.
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = record["prompt_token_ids"] + record["response_token_ids"]
    input_ids = torch.tensor([ids])
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        logits = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids(model, input_ids, mask, pixels.image_grid_thw, image_id),
            pixel_values=pixels.pixel_values,
            image_grid_thw=pixels.image_grid_thw,
        ).logits[0, :-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[0, 1:, None])[:, 0]
    n = len(record["response_token_ids"])
    mine = logprobs[-n:]
    engines = torch.tensor(record["response_logprobs"])
    assert (mine - engines).abs().max().item() < 1e-3, (mine, engines)


def test_the_engine_is_started_for_images_and_no_videos(served) -> None:
    _, engine, _ = served
    command = engine.command()
    assert command[command.index("--limit-mm-per-prompt") + 1] == '{"image": 2, "video": 0}'
    assert Path(engine.log_path).read_text().count("Traceback") == 0


@pytest.mark.parametrize("keep_requests", [False, True], ids=["drained", "partial rollout"])
def test_a_picture_seen_before_a_weight_load_is_answered_after_it(vision_model, vision_engine, keep_requests) -> None:
    """A weight load drops the vision encoder's cached outputs with the KV blocks, so the same
    picture after it is encoded anew (vLLM 0.32 on CPU died of an "Encoder cache miss" there),
    whether the load drained the engine or kept its requests (partial rollout)."""
    url = "data:image/png;base64," + base64.b64encode(picture("12*3", (112, 28))).decode()
    body = {
        "model": vision_engine.served_model_name,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
        "max_tokens": 4,
        "temperature": 1.0,
    }
    with vision_engine.client(120) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    vision_engine.keep_requests = keep_requests
    try:
        asyncio.run(vision_engine.load_weights(vision_model))
    finally:
        vision_engine.keep_requests = False
    with vision_engine.client(120) as http:
        for _ in range(2):
            again = http.post("/v1/chat/completions", json=body)
            assert again.status_code == 200, again.text
        assert http.get("/health").status_code == 200
