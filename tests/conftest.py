"""Shared fixtures: a real gateway on loopback and a stand-in upstream."""

from __future__ import annotations

import http.server
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from rollover.gateway.server import GatewayThread
from rollover.testing.stub_upstream import StubUpstream

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

ADMIN_KEY = "test-admin-key"


@pytest.fixture
def gateway() -> Iterator[GatewayThread]:
    with GatewayThread(store=":memory:", admin_key=ADMIN_KEY) as server:
        yield server


@pytest.fixture
def stub() -> Iterator[StubUpstream]:
    with StubUpstream() as upstream:
        yield upstream


@pytest.fixture
def admin(gateway: GatewayThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30) as client:
        yield client


@contextmanager
def serve_http(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[int]:
    """A small HTTP server on loopback, on a thread, for as long as the block runs; its port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def foreign_server() -> Iterator[int]:
    """Another program's HTTP server (the port-race tests): 200 and a body that looks like a
    healthy gateway's and like vLLM's model list on every path; yields its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"status": "ok", "data": [{"id": "policy"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with serve_http(Handler) as port:
        yield port


# -- one warmed-up calc model and one vLLM server for the whole session -------------------


@pytest.fixture(scope="session")
def calc_model(tmp_path_factory):
    """The calc example's tiny model, built and warmed up locally once per session
    (ROLLOVER_TEST_CALC_MODEL names an already built one, to iterate faster locally)."""
    from examples.calc.prepare import MODEL_NAME, tiny_calc_model

    if os.environ.get("ROLLOVER_TEST_CALC_MODEL"):
        return Path(os.environ["ROLLOVER_TEST_CALC_MODEL"])
    return tiny_calc_model(tmp_path_factory.mktemp("calc-model") / MODEL_NAME)


@pytest.fixture(scope="session")
def tiny_model_dir(calc_model):
    """Engine tests run on the same model so the session needs a single vLLM server."""
    return calc_model


@pytest.fixture(scope="session")
def vllm_engine(calc_model, tmp_path_factory):
    from rollover.testing.engine import alive, engine_family, start_test_engine, vllm_available

    if not vllm_available():
        pytest.fail("vLLM is not installed: run scripts/setup.sh --dev")
    engine = start_test_engine(calc_model, log_path=tmp_path_factory.mktemp("vllm-log") / "vllm.log")
    try:
        yield engine
    finally:
        family = engine_family(engine)
        engine.stop()
        assert not alive(family), "vLLM processes left after stop()"


@pytest.fixture(scope="session")
def vision_model(tmp_path_factory):
    """The vision calc example's tiny Qwen2-VL, built and briefly warmed up once per session
    (enough for its format; the example's own warm-up is longer)."""
    from examples.vision_calc.prepare import tiny_vision_calc_model

    return tiny_vision_calc_model(tmp_path_factory.mktemp("vision-model") / "tiny-vl-warm", steps=30)


@pytest.fixture(scope="session")
def vision_engine(vision_model, tmp_path_factory):
    """vLLM serving `vision_model` (two images a prompt), shared by the session's image tests;
    a test that loads other weights loads the model back before it ends."""
    from rollover.testing.engine import alive, engine_family, start_test_engine

    engine = start_test_engine(
        vision_model, log_path=tmp_path_factory.mktemp("vision-vllm-log") / "vllm.log", limit_images=2
    )
    try:
        yield engine
    finally:
        family = engine_family(engine)
        engine.stop()
        assert not alive(family), "vLLM processes left after stop()"
