"""The vision calc example: its pictures, its Agent Lightning-style agent through a real gateway
(the plain OpenAI client with an image part), and 2 training steps of the whole system with the
tiny vision-language model served by vLLM."""

from __future__ import annotations

import io
import os
from pathlib import Path

import httpx
import pytest
from PIL import Image

from examples.vision_calc.agent import VisionCalcAgent
from examples.vision_calc.task import CELL, WIDTH, render, user_message
from rollover.config import load_config
from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayThread
from rollover.launch import run_training
from rollover.metrics import read_jsonl
from rollover.store import RolloutStore
from rollover.testing.stub_upstream import StubUpstream
from tests.conftest import ADMIN_KEY

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "vision_calc" / "config.yaml"


def test_the_expression_is_only_in_the_picture() -> None:
    data = render("37+45")
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == (CELL * WIDTH, CELL) and image.format == "PNG"
        gray = image.convert("L")
        # Every character cell has ink; the picture is the same for the same expression.
        for cell in range(5):
            assert gray.crop((cell * CELL, 0, (cell + 1) * CELL, CELL)).getextrema()[0] < 128
    assert render("37+45") == data and render("37+45", seed=1) != data
    message = user_message("37+45")
    assert "37" not in str([p for p in message["content"] if p["type"] == "text"])


def test_the_agent_lightning_style_agent_sends_its_picture_through_the_gateway(monkeypatch) -> None:
    with StubUpstream() as stub, GatewayThread(admin_key=ADMIN_KEY) as gateway:
        admin = httpx.Client(base_url=gateway.url, headers={"x-api-key": ADMIN_KEY}, timeout=30)
        admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url, "max_images": 1}])
        rid = admin.post("/api/rollouts", json=[{"input": {}}]).json()[0]["rollout_id"]
        admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running", "last_attempt_id": "a1"}})
        monkeypatch.setenv("AGL_OPENAI_BASE_URL", f"{gateway.url}/proxy/rollout/{rid}/attempt/a1/mode/train/openai/v1")
        monkeypatch.setenv("AGL_EVENT_URL", f"{gateway.url}/api/rollouts/{rid}/attempt/a1/events")
        monkeypatch.setenv("AGL_KEY", scoped_key(ADMIN_KEY, rid, "a1"))
        VisionCalcAgent().run({"id": "t1", "expression": "37+45", "answer": 82})
        sent = stub.behaviour.requests[-1]["messages"][1]["content"]
        assert sent[0]["type"] == "image_url" and sent[0]["image_url"]["url"].startswith("data:image/png;base64,")
        events = admin.get(f"/api/rollouts/{rid}/events").json()
        [call] = [e["data"] for e in events if e["event_type"] == "model_request"]
        assert call["images"][0]["width"] == CELL * WIDTH
        [reward] = [e["data"] for e in events if e["event_type"] == "reward"]
        assert reward == {"value": 0.0}  # the stand-in engine echoes: no answer


@pytest.mark.vllm
@pytest.mark.slow
def test_two_training_steps_on_pictures(tmp_path, monkeypatch, vision_model, vision_engine) -> None:
    """The whole system: vLLM serves the (briefly warmed up) tiny Qwen2-VL, agents send their
    pictures, two updates train on them and their weights reach the engine."""
    from rollover.testing.engine import restore_weights

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    config = load_config(
        CONFIG,
        [
            f"actor_rollout_ref.model.path={vision_model}",
            "actor_rollout_ref.rollout.limit_images=2",
            f"trainer.default_local_dir={tmp_path}",
            "trainer.experiment_name=vc",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            "data.val_batch_size=4",
            "algorithm.filter_groups.enable=false",
        ],
    )
    try:
        assert run_training(config, engine=vision_engine) == 0
    finally:
        restore_weights(vision_engine, vision_model)
    rows = [r for r in read_jsonl(tmp_path / "vc" / "metrics.jsonl") if "training/async/n_completed_rollouts" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["training/n_image_mismatch_samples"] == 0 and row["rollouts/n_samples"] > 0
        assert row["rollouts/n_failed"] == 0
    import asyncio

    store = RolloutStore(tmp_path / "vc" / "store.db", read_only=True)
    try:
        rollouts = asyncio.run(store.list_rollouts())
        bundle = asyncio.run(store.triplets(rollouts[0].rollout_id))
        assert bundle.triplets and all(t.images and len(t.images) == 1 for t in bundle.triplets)
        stored = asyncio.run(store.images(list({t.images[0] for t in bundle.triplets if t.images})))
        assert stored and all(media == "image/png" for media, _ in stored.values())
    finally:
        store.close()
