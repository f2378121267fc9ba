"""Drain detection lag, and the time an agent loses to a pause, on a real gateway.

A gateway runs as its own process (`GatewayProcess`) in front of a stand-in upstream that
answers every call after a known delay (`python -m rollover.testing.stub_upstream --delay D`).

1. Detection lag. A few calls are put in flight, the proxy is paused, and the trainer's side
   waits for `inflight == 0`, either the Agent Lightning way (GET /proxy/state every 0.25 s)
   or with one long poll (GET /proxy/state?wait_drained=S). The lag is the time from the last
   in-flight call's response reaching its caller to the trainer's side knowing the gateway
   is drained. Both replies leave the gateway together when the long poll is used, so their
   arrival order is noise: a negative difference counts as 0.
2. Agent-side loss. The gateway is paused for P seconds with `Retry-After: R`; agents using
   the OpenAI client (`AgentContext.openai()`: it honours Retry-After) call at spread-out
   moments during the pause. Each sees extra latency over an unpaused call; the part of it
   beyond the pause left when it called is time lost to Retry-After granularity.

Usage: python benchmarks/drain_latency.py [--repeats 20] [--delay 0.5] [--inflight 4]
       [--pauses 0.5,1.5] [--retry-after 1,5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rollover.agent import AgentContext  # noqa: E402
from rollover.gateway.client import GatewayClient  # noqa: E402
from rollover.gateway.server import GatewayProcess, free_port, wait_healthy  # noqa: E402
from rollover.processes import die_with_parent, kill_group  # noqa: E402

KEY = "bench-admin"
POLL_INTERVAL = 0.25  # Agent Lightning's drain loop
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 8}


@dataclass(frozen=True)
class Settings:
    repeats: int = 20  # drains per detection method
    delay: float = 0.5  # stand-in upstream seconds per call
    inflight: int = 4  # calls in flight when the proxy pauses
    pauses: tuple[float, ...] = (0.5, 1.5)  # pause lengths P for the agent-side part
    retry_afters: tuple[float, ...] = (1.0, 5.0)  # Retry-After R the gateway announces
    agents: int = 4  # agents calling during each pause, at spread-out moments
    agent_repeats: int = 2  # pauses per (R, P)
    seed: int = 0


@dataclass
class Stats:
    mean: float
    p50: float
    p90: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        ordered = sorted(values)

        def quantile(q: float) -> float:
            return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]

        return cls(statistics.fmean(ordered), quantile(0.5), quantile(0.9), ordered[-1])


@dataclass
class DetectionResult:
    method: str  # "poll 0.25s" or "wait_drained"
    lag: Stats  # last call done -> drain known, seconds
    drain: Stats  # pause -> drain known (what the trainer records as proxy_drain_seconds)
    requests: float  # GET /proxy/state calls per drain


@dataclass
class PauseResult:
    retry_after: float
    pause: float
    announced: bool  # the pause was announced with its length (expected_seconds)
    calls: int
    remaining_pause: float  # mean pause left when an agent called
    extra_latency: Stats  # over an unpaused call
    lost: Stats  # extra latency beyond the pause left: waiting on Retry-After after the resume


@dataclass
class Report:
    settings: dict[str, Any]
    baseline_call_s: float
    detection: list[DetectionResult]
    pauses: list[PauseResult]
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]

    @property
    def lag_ratio(self) -> float:
        """Mean lag of the polling loop over the long poll's (inf when the latter is 0)."""
        poll, wait = self.detection[0].lag.mean, self.detection[1].lag.mean
        return poll / wait if wait > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "baseline_call_s": self.baseline_call_s,
            "detection": [asdict(d) for d in self.detection],
            "lag_ratio_poll_over_wait": self.lag_ratio if self.lag_ratio != float("inf") else None,
            "pauses": [asdict(p) for p in self.pauses],
            "loadavg_before": list(self.load_before),
            "loadavg_after": list(self.load_after),
            "cpu_count": os.cpu_count(),
        }


# -- the world ----------------------------------------------------------------------------


async def running_rollout(client: GatewayClient) -> str:
    """One rollout in the running state (attempt a1), whose proxy path every call uses."""
    [rollout] = await client.enqueue([{"input": {}}])
    await client.update_status(rollout.rollout_id, state="running", last_attempt_id="a1")
    return rollout.rollout_id


async def timed_call(http: httpx.AsyncClient, url: str, headers: dict[str, str]) -> float:
    """POST one chat call; the moment its response arrived (perf_counter)."""
    response = await http.post(url, json=CHAT, headers=headers)
    response.raise_for_status()
    return time.perf_counter()


async def wait_inflight(client: GatewayClient, count: int, timeout: float = 10.0) -> None:
    deadline = time.perf_counter() + timeout
    while (await client.proxy_state()).inflight < count:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{count} calls never were in flight at once")
        await asyncio.sleep(0.01)


# -- 1. detection lag ---------------------------------------------------------------------


async def detect_by_polling(client: GatewayClient) -> tuple[float, int]:
    requests = 0
    while True:
        requests += 1
        if (await client.proxy_state()).inflight == 0:
            return time.perf_counter(), requests
        await asyncio.sleep(POLL_INTERVAL)


async def detect_by_waiting(client: GatewayClient) -> tuple[float, int]:
    requests = 0
    while True:
        requests += 1
        if (await client.proxy_state(wait_drained=30.0)).inflight == 0:
            return time.perf_counter(), requests


async def one_drain(
    client: GatewayClient,
    http: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    settings: Settings,
    wait: bool,
    rng: random.Random,
) -> tuple[float, float, int]:
    """(lag, drain seconds, state requests) for one pause with calls in flight."""
    await client.resume()
    calls = []
    for _ in range(settings.inflight):
        calls.append(asyncio.create_task(timed_call(http, url, headers)))
        await asyncio.sleep(0.02)
    await wait_inflight(client, settings.inflight)
    # Pause at a random point of the calls' lives, so the polling loop's phase is random.
    await asyncio.sleep(rng.uniform(0.0, max(settings.delay - 0.1, 0.0)))
    await client.pause(reason="benchmark drain", retry_after_seconds=1)
    paused_at = time.perf_counter()
    detected_at, requests = await (detect_by_waiting(client) if wait else detect_by_polling(client))
    last_done = max(await asyncio.gather(*calls))
    return max(detected_at - last_done, 0.0), detected_at - paused_at, requests


async def measure_detection(
    client: GatewayClient, http: httpx.AsyncClient, url: str, headers: dict[str, str], settings: Settings
) -> list[DetectionResult]:
    rng = random.Random(settings.seed)
    samples: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
    for _ in range(settings.repeats):  # interleaved, so load drifts hit both methods alike
        for wait in (False, True):
            samples[wait].append(await one_drain(client, http, url, headers, settings, wait, rng))
    results = []
    for wait, label in ((False, f"poll {POLL_INTERVAL:g}s"), (True, "wait_drained")):
        rows = samples[wait]
        results.append(
            DetectionResult(
                method=label,
                lag=Stats.of([r[0] for r in rows]),
                drain=Stats.of([r[1] for r in rows]),
                requests=statistics.fmean(r[2] for r in rows),
            )
        )
    await client.resume()
    return results


# -- 2. agent-side loss -------------------------------------------------------------------


def agent_call(base_url: str, key: str) -> float:
    """One chat call with the SDK's OpenAI client, as an agent makes it; its latency."""
    ctx = AgentContext(openai_base_url=base_url, event_url="http://unused", key=key)
    client = ctx.openai()
    try:
        started = time.perf_counter()
        client.chat.completions.create(**CHAT)
        return time.perf_counter() - started
    finally:
        client.close()


async def baseline_latency(base_url: str, key: str, calls: int = 3) -> float:
    return statistics.median([await asyncio.to_thread(agent_call, base_url, key) for _ in range(calls)])


async def one_pause(
    client: GatewayClient, base_url: str, key: str, retry_after: float, pause: float, agents: int, announce: bool
) -> list[tuple[float, float]]:
    """Pause for `pause` s (announced as lasting that long, or not); agent i calls at i/agents
    of the way in. (pause left, latency) each."""
    await client.pause(
        reason="benchmark pause", retry_after_seconds=retry_after, expected_seconds=pause if announce else None
    )
    paused_at = time.perf_counter()

    async def agent(offset: float) -> tuple[float, float]:
        await asyncio.sleep(offset)
        remaining = pause - (time.perf_counter() - paused_at)
        return remaining, await asyncio.to_thread(agent_call, base_url, key)

    tasks = [asyncio.create_task(agent(pause * i / agents)) for i in range(agents)]
    await asyncio.sleep(max(pause - (time.perf_counter() - paused_at), 0.0))
    await client.resume()
    return list(await asyncio.gather(*tasks))


async def measure_pauses(
    client: GatewayClient, base_url: str, key: str, baseline: float, settings: Settings
) -> list[PauseResult]:
    results = []
    for retry_after, pause, announce in itertools.product(settings.retry_afters, settings.pauses, (False, True)):
        rows: list[tuple[float, float]] = []
        for _ in range(settings.agent_repeats):
            rows += await one_pause(client, base_url, key, retry_after, pause, settings.agents, announce)
        extra = [max(latency - baseline, 0.0) for _, latency in rows]
        lost = [max(e - max(remaining, 0.0), 0.0) for e, (remaining, _) in zip(extra, rows)]
        results.append(
            PauseResult(
                retry_after=retry_after,
                pause=pause,
                announced=announce,
                calls=len(rows),
                remaining_pause=statistics.fmean(max(r, 0.0) for r, _ in rows),
                extra_latency=Stats.of(extra),
                lost=Stats.of(lost),
            )
        )
    return results


# -- the run ------------------------------------------------------------------------------


async def run_async(settings: Settings) -> Report:
    load_before = os.getloadavg()
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-m", "rollover.testing.stub_upstream", "--port", str(port), "--delay", str(settings.delay)],
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    try:
        with tempfile.TemporaryDirectory() as tmp, GatewayProcess(store=f"{tmp}/bench.db", admin_key=KEY) as gateway:
            wait_healthy(f"http://127.0.0.1:{port}")
            async with GatewayClient(gateway.url, KEY) as client, httpx.AsyncClient(timeout=60) as http:
                await client.register_models([{"model": "policy", "endpoint": f"http://127.0.0.1:{port}/v1"}])
                rollout_id = await running_rollout(client)
                base_url = client.proxy_base_url(rollout_id, "a1")
                key = client.scoped_key(rollout_id, "a1")
                headers = {"Authorization": f"Bearer {key}"}
                baseline = await baseline_latency(base_url, key)
                detection = await measure_detection(client, http, f"{base_url}/chat/completions", headers, settings)
                pauses = await measure_pauses(client, base_url, key, baseline, settings)
    finally:
        kill_group(stub)
    return Report(
        settings=asdict(settings),
        baseline_call_s=baseline,
        detection=detection,
        pauses=pauses,
        load_before=load_before,
        load_after=os.getloadavg(),
    )


def run_benchmark(settings: Settings) -> Report:
    return asyncio.run(run_async(settings))


def format_report(report: Report) -> str:
    s = report.settings
    lines = [
        f"gateway process + stand-in upstream ({s['delay']:g}s per call); {s['inflight']} calls in flight at each pause; "
        f"{s['repeats']} drains per method",
        f"load average before {_load(report.load_before)}, after {_load(report.load_after)} on {os.cpu_count()} CPUs",
        "",
        "drain detection: last in-flight call done -> trainer knows (lag), and pause -> trainer knows (drain), ms",
        f"{'method':<14}{'lag mean':>9}{'p50':>8}{'p90':>8}{'max':>8}{'drain mean':>12}{'p90':>8}{'GETs':>6}",
    ]
    for d in report.detection:
        lines.append(
            f"{d.method:<14}{d.lag.mean * 1e3:>9.1f}{d.lag.p50 * 1e3:>8.1f}{d.lag.p90 * 1e3:>8.1f}{d.lag.max * 1e3:>8.1f}"
            f"{d.drain.mean * 1e3:>12.1f}{d.drain.p90 * 1e3:>8.1f}{d.requests:>6.1f}"
        )
    poll, wait = report.detection
    ratio = f"x{report.lag_ratio:.1f}" if report.lag_ratio != float("inf") else "inf (long poll lag 0)"
    lines.append(
        f"lag ratio poll/wait_drained: {ratio}; saved per update: {(poll.lag.mean - wait.lag.mean) * 1e3:.0f} ms "
        f"(drain ratio x{poll.drain.mean / wait.drain.mean:.2f})"
    )
    lines += [
        "",
        f"agent-side: OpenAI client calling during a pause of P s with Retry-After R s (unpaused call {report.baseline_call_s * 1e3:.0f} ms)",
        f"{'R s':>5}{'P s':>6}{'announced':>10}{'calls':>6}{'pause left':>11}{'extra mean':>11}{'p90':>7}{'max':>7}{'lost mean':>10}{'max':>7}",
    ]
    for p in report.pauses:
        lines.append(
            f"{p.retry_after:>5g}{p.pause:>6g}{'yes' if p.announced else 'no':>10}{p.calls:>6}{p.remaining_pause:>11.2f}{p.extra_latency.mean:>11.2f}"
            f"{p.extra_latency.p90:>7.2f}{p.extra_latency.max:>7.2f}{p.lost.mean:>10.2f}{p.lost.max:>7.2f}"
        )
    lines.append(
        "(seconds; lost = extra latency beyond the pause left when the agent called: it resumes on its next retry, not at the resume;"
    )
    lines.append(
        " announced: the pause was posted with expected_seconds = P, so refused calls also got retry-after-ms with the time left)"
    )
    by_key = {(p.retry_after, p.pause, p.announced): p for p in report.pauses}
    for (retry_after, pause, announced), p in by_key.items():
        plain = by_key.get((retry_after, pause, False))
        if announced and plain is not None and p.lost.mean > 0:
            lines.append(
                f"R {retry_after:g} s, P {pause:g} s: announcing the length cuts the time lost per call x{plain.lost.mean / p.lost.mean:.1f}"
                f" ({plain.lost.mean:.2f} -> {p.lost.mean:.2f} s)"
            )
    return "\n".join(lines)


def _load(load: Sequence[float]) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated seconds, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="drains per detection method (default 20)")
    parser.add_argument("--delay", type=float, default=0.5, help="upstream seconds per call (default 0.5)")
    parser.add_argument("--inflight", type=int, default=4, help="calls in flight at each pause (default 4)")
    parser.add_argument("--pauses", type=_floats, default=(0.5, 1.5), help="pause lengths P, s (default 0.5,1.5)")
    parser.add_argument("--retry-after", type=_floats, default=(1.0, 5.0), help="Retry-After values R, s (default 1,5)")
    parser.add_argument("--agents", type=int, default=4, help="agents calling during each pause (default 4)")
    parser.add_argument("--agent-repeats", type=int, default=2, help="pauses per (R, P) (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    settings = Settings(
        repeats=args.repeats,
        delay=args.delay,
        inflight=args.inflight,
        pauses=args.pauses,
        retry_afters=args.retry_after,
        agents=args.agents,
        agent_repeats=args.agent_repeats,
        seed=args.seed,
    )
    report = run_benchmark(settings)
    print(json.dumps(report.to_json()) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
