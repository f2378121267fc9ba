"""Where a proxied call's time goes inside Rollover's gateway, stage by stage, at concurrency 1.

`gateway_overhead.py` measures what the gateway adds to a call; this splits that into the
stages a call goes through, so a change can be aimed at the stage that costs. The gateway runs
as its own process, as in a run, with probes at the stage boundaries (timestamps taken in the
gateway, wrapped around the methods named below); calls come one at a time through the proxy to
the stand-in upstream, then directly to it.

Stages (median microseconds over the calls, the first `--warmup` left out):
  parse           the request's bytes parsed (uvicorn's httptools protocol, header timer)
  to handler      until the request's task runs the app
  to engine       app, key check, body, pause check, engine request built and written
  engine          until the engine's answer is in (the stand-in's time and two loopback hops)
  to record       answer parsed, the call's record built
  to commit       the record encoded, until the group commit runs (one turn of the event loop)
  commit          the SQLite transaction (BEGIN, INSERT, COMMIT)
  answer out      back in the handler, the response built and handed to the transport

Usage: python benchmarks/gateway_stages.py [--calls 3000] [--warmup 500] [--json]
The probes cost a few microseconds each. Stages are wall time: a write to a loopback socket can
hand the core to the process it wakes, so `to engine` and `answer out` hold some of the
engine's and the client's time too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gateway_overhead import ATTEMPT, CHAT, KEY, MODEL, json_headers, start_stub  # noqa: E402
from rollover.gateway.keys import scoped_key  # noqa: E402
from rollover.processes import die_with_parent, free_port, kill_group  # noqa: E402

# (stage, from mark, to mark), in a call's order
STAGES = [
    ("parse", "begin", "parsed"),
    ("to handler", "parsed", "handler"),
    ("to engine", "handler", "engine_sent"),
    ("engine", "engine_sent", "engine_answered"),
    ("to record", "engine_answered", "record"),
    ("to commit", "record", "commit"),
    ("commit", "commit", "committed"),
    ("answer out", "committed", "answered"),
]


# -- the gateway process, with probes --------------------------------------------------------


def serve_with_probes(port: int, store: str, report: str) -> None:
    from uvicorn.protocols.http import httptools_impl

    from rollover.config import GatewaySettings
    from rollover.gateway import asgi, connections, upstream
    from rollover.gateway.server import build_server, resolve
    from rollover.store import file, sqlite

    clock = time.perf_counter
    marks: dict[str, float] = {}
    calls: list[dict[str, float]] = []

    def probe(owner: Any, name: str, mark: str, after: bool = False) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def probed(*args: Any, **kwargs: Any) -> Any:
            if not after:
                marks[mark] = clock()
            result = original(*args, **kwargs)
            if after:
                marks[mark] = clock()
            return result

        setattr(owner, name, probed)

    def async_probe(owner: Any, name: str, mark: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        async def probed(*args: Any, **kwargs: Any) -> Any:
            marks[mark] = clock()
            return await original(*args, **kwargs)

        setattr(owner, name, probed)

    probe(connections.BoundedHttpToolsProtocol, "on_message_begin", "begin")
    probe(connections.BoundedHttpToolsProtocol, "on_message_complete", "parsed", after=True)
    serve_app = asgi.GatewayApp.__call__

    async def probed_app(self: Any, scope: Any, receive: Any, send: Any) -> None:  # uvicorn reads this signature
        marks["handler"] = clock()
        await serve_app(self, scope, receive, send)

    asgi.GatewayApp.__call__ = probed_app  # type: ignore[method-assign]
    probe(upstream._Connection, "send", "engine_sent", after=True)
    probe(upstream._Connection, "data_received", "engine_answered")  # the last piece's arrival
    async_probe(sqlite.RolloutStore, "record_event", "record")
    probe(file.StoreFile, "_flush", "commit")
    probe(file.StoreFile, "_commit_group", "committed", after=True)
    send = httptools_impl.RequestResponseCycle.send

    async def probed_send(self: Any, message: Any) -> None:
        await send(self, message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            calls.append(dict(marks, answered=clock()))

    httptools_impl.RequestResponseCycle.send = probed_send  # type: ignore[method-assign]

    def write_report(*_: Any) -> None:
        Path(report).write_text(json.dumps(calls))
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, write_report)
    settings = resolve(GatewaySettings.from_config().with_gateway(port=port, store=store, admin_key=KEY))
    build_server(settings).run()


# -- the load --------------------------------------------------------------------------------


async def load(gateway_url: str, upstream: str, calls: int) -> tuple[list[float], list[float]]:
    """Latencies of `calls` proxied calls, then of as many direct ones, one at a time."""
    admin = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{gateway_url}/api/models", json=[{"model": MODEL, "endpoint": upstream}], headers=admin
        ) as response:
            assert response.status == 201, await response.text()
        async with session.post(f"{gateway_url}/api/rollouts", json=[{"input": {}}], headers=admin) as response:
            [rollout] = await response.json()
        claim = {"status": {"state": "running", "last_attempt_id": ATTEMPT}}
        rid = rollout["rollout_id"]
        async with session.patch(f"{gateway_url}/api/rollouts/{rid}", json=claim, headers=admin) as response:
            assert response.status == 200, await response.text()
        body = json.dumps(CHAT).encode()
        agent = json_headers({"Authorization": f"Bearer {scoped_key(KEY, rid, ATTEMPT)}"})
        proxied = f"{gateway_url}/proxy/rollout/{rid}/attempt/{ATTEMPT}/mode/train/openai/v1/chat/completions"

        async def timed(url: str, headers: dict[str, str]) -> list[float]:
            latencies = []
            for _ in range(calls):
                started = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    assert response.status == 200, await response.text()
                latencies.append(time.perf_counter() - started)
            return latencies

        return await timed(proxied, agent), await timed(f"{upstream}/chat/completions", json_headers({}))


def measure(calls: int, warmup: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        upstream, _ = start_stub(stack)
        port, report = free_port(), f"{folder}/stages.json"
        gateway = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(port), f"{folder}/stages.db", report],
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        stack.callback(kill_group, gateway)
        from rollover.gateway.server import wait_healthy

        wait_healthy(f"http://127.0.0.1:{port}", timeout=60, process=gateway)
        proxied, direct = asyncio.run(load(f"http://127.0.0.1:{port}", upstream, calls))
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(30)
        recorded = json.loads(Path(report).read_text())
    # proxied calls only (the set-up's calls have no engine marks), in order
    complete = [c for c in recorded if all(m in c for _, a, b in STAGES for m in (a, b))][warmup:]
    stages = {name: statistics.median((c[b] - c[a]) * 1e6 for c in complete) for name, a, b in STAGES}
    in_gateway = statistics.median(
        ((c["answered"] - c["begin"]) - (c["engine_answered"] - c["engine_sent"])) * 1e6 for c in complete
    )
    return {
        "calls": len(complete),
        "stages_us": stages,
        "in_gateway_us": in_gateway,
        "proxied_p50_ms": statistics.median(proxied[warmup:]) * 1e3,
        "direct_p50_ms": statistics.median(direct[warmup:]) * 1e3,
        "load": os.getloadavg()[0],
    }


def format_report(figures: dict[str, Any]) -> str:
    lines = [f"{figures['calls']} calls at concurrency 1; 1-minute load average {figures['load']:.1f}"]
    lines += [f"  {name:<14}{us:>8.0f} us" for name, us in figures["stages_us"].items()]
    added = figures["proxied_p50_ms"] - figures["direct_p50_ms"]
    lines.append(f"  {'in gateway':<14}{figures['in_gateway_us']:>8.0f} us (all but 'engine', median of the sums)")
    lines.append(
        f"latency p50: proxied {figures['proxied_p50_ms']:.2f} ms, direct {figures['direct_p50_ms']:.2f} ms,"
        f" added {added:+.2f} ms (with the probes)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=500, help="first calls left out of the medians")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    parser.add_argument("--serve", nargs=3, metavar=("PORT", "STORE", "REPORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        port, store, report = args.serve
        serve_with_probes(int(port), store, report)
        return 0
    figures = measure(args.calls, args.warmup)
    print(format_report(figures))
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
