"""Store bytes per rollout for an agent that re-sends one screenshot every turn.

A gateway over a store file and the stand-in engine (registered as one that takes images); one
rollout of `--turns` calls, each sending the whole conversation so far, the same screenshot in
its first message (as a computer-use agent re-sends its screen). Printed: how much the store
file grew, against one image plus the records' text (what storing each image once costs at
best), and against what keeping every call's image in its record would cost.

    python benchmarks/image_store.py [--turns 10] [--size 640x400]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sqlite3
import sys
import tempfile
from contextlib import closing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ADMIN = "bench-admin-key"


def screenshot(width: int, height: int) -> bytes:
    """A screen-like picture: flat panels with noisy text-like rows (PNG compresses it as a real
    screen, not as pure noise)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = np.full((height, width, 3), 240, dtype=np.uint8)
    pixels[:32] = (40, 60, 90)
    for row in range(48, height - 8, 18):
        length = int(rng.integers(width // 4, width - 16))
        pixels[row : row + 10, 16:length] = rng.integers(0, 120, (10, length - 16, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def file_bytes(path: Path) -> int:
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages, size = conn.execute("PRAGMA page_count").fetchone()[0], conn.execute("PRAGMA page_size").fetchone()[0]
        return int(pages * size)


def main(argv: list[str] | None = None) -> int:
    import httpx

    from rollover.gateway.keys import scoped_key
    from rollover.gateway.server import GatewayThread
    from rollover.testing.stub_upstream import StubUpstream

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--size", default="640x400", help="the screenshot's WIDTHxHEIGHT")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))
    image = screenshot(width, height)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    with tempfile.TemporaryDirectory() as scratch, StubUpstream() as stub:
        path = Path(scratch) / "store.db"
        with GatewayThread(store=str(path), admin_key=ADMIN) as gateway:
            admin = httpx.Client(base_url=gateway.url, headers={"x-api-key": ADMIN}, timeout=60)
            admin.post("/api/models", json=[{"model": "policy", "endpoint": stub.base_url, "max_images": 1}])
            rid = admin.post("/api/rollouts", json=[{"input": {}}]).json()[0]["rollout_id"]
            admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running", "last_attempt_id": "a1"}})
            before = file_bytes(path)
            proxy = f"{gateway.url}/proxy/rollout/{rid}/attempt/a1/mode/train/openai/v1/chat/completions"
            headers = {"Authorization": f"Bearer {scoped_key(ADMIN, rid, 'a1')}"}
            screen = {"type": "image_url", "image_url": {"url": url}}
            messages: list[dict] = [
                {"role": "user", "content": [screen, {"type": "text", "text": "What is on screen?"}]}
            ]
            for turn in range(args.turns):
                answer = httpx.post(proxy, json={"model": "policy", "messages": messages}, headers=headers, timeout=60)
                answer.raise_for_status()
                messages += [
                    {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"turn {turn}: click the next button"},
                ]
        grew = file_bytes(path) - before
        with closing(sqlite3.connect(path)) as conn:
            records = sum(row[0] for row in conn.execute("SELECT length(data) FROM events WHERE rollout_id=?", (rid,)))
            stored_images = conn.execute("SELECT count(*), coalesce(sum(length(data)), 0) FROM images").fetchone()
    inline = records + args.turns * len(url)  # every record keeping its call's data: URL
    result = {
        "turns": args.turns,
        "image_bytes": len(image),
        "records_text_bytes": records,
        "images_stored": stored_images[0],
        "store_growth_bytes": grew,
        "one_image_plus_text_bytes": len(image) + records,
        "ratio_to_one_image_plus_text": grew / (len(image) + records),
        "inline_bytes_estimate": inline,
        "ratio_inline_to_stored": inline / max(grew, 1),
        "loadavg": os.getloadavg()[0],
    }
    print(
        f"{args.turns} turns re-sending a {width}x{height} screenshot ({len(image)} bytes of PNG): "
        f"the store grew {grew} bytes = {result['ratio_to_one_image_plus_text']:.3f}x one image plus the "
        f"records' text ({records} bytes); {stored_images[0]} image stored; keeping each call's image in its "
        f"record would take ~{inline} bytes ({result['ratio_inline_to_stored']:.1f}x). load {result['loadavg']:.1f}"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
