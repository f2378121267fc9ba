"""The viewer's HTTP surface: JSON errors, the key, loopback by default, the page's files."""

from __future__ import annotations

import httpx
import pytest

from rollover.cli.main import main
from rollover.viewer.app import ViewerThread, access_key, is_loopback
from rollover.viewer.data import RunFolder
from tests.viewer.runfolder import write_run


@pytest.fixture
def run_dir(tmp_path):
    return write_run(tmp_path / "run")


@pytest.fixture
def viewer(run_dir):
    with ViewerThread(RunFolder(run_dir)) as server:
        yield server


def test_api_and_page(viewer):
    with httpx.Client(base_url=viewer.url, headers=viewer.headers, timeout=30) as http:
        assert http.get("api/run").json()["n"] == 2
        assert http.get("api/metrics").json()["total"] == 4
        assert [r["step"] for r in http.get("api/metrics", params={"since": 3}).json()["rows"]] == [2]
        listing = http.get("api/rollouts", params={"state": "succeeded", "mode": "train", "limit": 2}).json()
        assert listing["total"] == 3 and len(listing["rollouts"]) == 2
        assert len(http.get("api/groups/g0").json()["rollouts"]) == 2
        assert http.get("api/rollouts/r-g0-0").json()["samples"][0]["n_loss_tokens"] == 5
        assert len(http.get("api/timeline").json()["steps"]) == 2
        page = http.get("")
        assert page.status_code == 200 and "static/app.js" in page.text
        for name in ("app.js", "style.css"):
            assert http.get(f"static/{name}").status_code == 200
        # no CDN, no build step: the page loads nothing from elsewhere
        for name in ("", "static/app.js", "static/style.css"):
            body = http.get(name).text
            assert "http://" not in body.replace("http://www.w3.org/2000/svg", "") and "https://" not in body


@pytest.mark.parametrize(
    "path,status",
    [
        ("api/rollouts/nope", 404),
        ("api/groups/nope", 404),
        ("api/rollouts?state=sleeping", 422),
        ("api/rollouts?step=-1", 422),
        ("api/metrics?since=x", 422),
        ("static/..%2Fapp.py", 404),
        ("static/nothing.js", 404),
    ],
)
def test_errors_are_json(viewer, path, status):
    response = httpx.get(viewer.url + path, headers=viewer.headers, timeout=30)
    assert response.status_code == status
    assert set(response.json()) == {"error", "reason"}


def test_a_key_guards_everything_and_lands_in_a_cookie(run_dir):
    with ViewerThread(RunFolder(run_dir), key="secret") as server, httpx.Client(base_url=server.url) as http:
        refused = http.get("api/run")
        assert refused.status_code == 401 and set(refused.json()) == {"error", "reason"}
        assert http.get("api/run", headers={"x-api-key": "wrong"}).status_code == 401
        assert http.get("api/run", headers={"Authorization": "Bearer secret"}).status_code == 200
        landing = http.get("", params={"key": "secret"})
        assert landing.status_code == 303 and "key=" not in landing.headers["location"]
        assert http.get("api/run").status_code == 200  # the cookie from the landing


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4") and not is_loopback("example.org")
    assert access_key("mine") == "mine"
    generated = access_key(None)  # always a key, loopback or not: any local process reaches loopback
    assert generated and generated != access_key(None)


def test_the_viewer_refuses_a_foreign_host_and_a_missing_key(viewer):
    with httpx.Client(base_url=viewer.url, timeout=30) as http:
        assert http.get("api/run").status_code == 401  # no key, even on loopback
        for host in ("localhost:1234", "127.0.0.1", "[::1]:8765"):
            assert http.get("api/run", headers={**viewer.headers, "Host": host}).status_code == 200, host
        # DNS rebinding: a page at attacker.example that resolves to 127.0.0.1
        for host in ("attacker.example", "attacker.example:8765", "127.0.0.1.attacker.example"):
            refused = http.get("api/run", headers={**viewer.headers, "Host": host})
            assert refused.status_code == 421 and set(refused.json()) == {"error", "reason"}, host
            assert http.get("healthz", headers={"Host": host}).status_code == 421


def test_view_command_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["view", str(tmp_path)]) == 2
    assert "neither store.db nor metrics.jsonl" in capsys.readouterr().err


def test_each_call_shows_its_images(tmp_path):
    """A call with an image (recorded as the gateway records it: by reference, the bytes once in
    the store) lists it beside its turn, and the page gets the picture back as it was sent."""
    import asyncio
    import hashlib
    import io

    from PIL import Image

    from rollover.store import EventCreate, RolloutCreate, RolloutState, RolloutStore, StatusFields
    from tests.viewer.runfolder import call_event

    run_dir = write_run(tmp_path / "run")
    buffer = io.BytesIO()
    Image.new("RGB", (56, 28), "teal").save(buffer, "PNG")
    data = buffer.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    event = call_event("user what is 2 + 3 ? assistant", "ANSWER: 5 <eos>", 1)
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"rollover-image:{sha}"}}]}
    image = {"sha256": sha, "media_type": "image/png", "width": 56, "height": 28, "bytes": len(data)}

    async def add(store: RolloutStore) -> None:
        await store.add_rollouts([RolloutCreate(rollout_id="r-img", metadata={"data_id": "gi", "enqueued_step": 0})])
        await store.update_status("r-img", StatusFields(state=RolloutState.RUNNING, last_attempt_id="a1"))
        record = event.data | {"request": {"messages": [message]}, "images": [image]}
        await store.record_event("r-img", "a1", "model_request", record, images=[(sha, "image/png", data)])
        await store.add_event("r-img", "a1", EventCreate(event_type="reward", data={"value": 1.0}))
        await store.update_status("r-img", StatusFields(state=RolloutState.SUCCEEDED))

    store = RolloutStore(run_dir / "store.db")
    try:
        asyncio.run(add(store))
    finally:
        store.close()
    with (
        ViewerThread(RunFolder(run_dir), key="k") as server,
        httpx.Client(base_url=server.url, timeout=30, headers={"x-api-key": "k"}) as http,
    ):
        [call] = http.get("api/rollouts/r-img").json()["calls"]
        assert call["images"] == [image]
        assert call["messages"] == [message]  # the page turns the reference into the picture
        picture = http.get(f"api/images/{sha}")
        assert picture.status_code == 200 and picture.content == data
        assert picture.headers["content-type"] == "image/png"
        assert http.get("api/images/" + "0" * 64).status_code == 404
        script = http.get("static/app.js").text
        assert "rollover-image:" in script and "call-images" in script
