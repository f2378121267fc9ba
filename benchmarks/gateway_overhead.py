"""What the gateway costs agents: Rollover's gateway (and optionally Agent Lightning's) against
the same stand-in upstream, called directly and through each gateway, in one run.

Figures (the issue's targets in brackets):
1. added latency p50 per proxied call at concurrency 1, fast upstream   [Rollover <= 0.5 ms]
2. throughput at concurrency 64 with a 100 ms upstream, x the direct rate [>= 0.85x]
3. rollout creation in batches of 64 (POST /api/rollouts), rollouts/s      [>= 30k/s]
4. event posting at concurrency 16 (POST .../events, a reward), events/s    [>= 3k/s]
5. the translated APIs (Rollover only): added latency p50 at concurrency 1 of Anthropic's
   Messages and OpenAI's Responses through the gateway (translated to the stand-in's chat
   completions) over the stand-in serving the same API itself, streamed and not  [<= 0.5 ms]
6. with `--engine MODEL_DIR`: figure 5 against a real vLLM engine (TCP, eager, one-token
   answers) serving that model: its own `/v1/chat/completions`, `/v1/messages` and
   `/v1/responses` against the same calls through a Rollover gateway of its own, on the
   attempt's train path (the engine also computes logprobs, as in training) and its val path

Every server is its own process (the stand-in `rollover.testing.stub_upstream`, Rollover's
`GatewayProcess` on a SQLite file, Agent Lightning's `python -m agentlightning.server` run as
shipped from the Python given with `--agl-python`); the load comes from this process through
one aiohttp session per figure. Targets are measured in interleaved rounds (direct, Rollover,
Agent Lightning, again...) so a change in machine load hits all of them alike.

With `--floor` it also measures `relay_floor.py`, a relay that only relays (figures 1 and 2):
what a process and two loopback hops on the path cost here before any gateway work; and the
same relay committing each call to a SQLite file before answering (`floor+record`): the least
a gateway that records every call durably can add; and the same relay doing the gateway chat
route's per-call work with Rollover's functions (`floor+proxy`: key, checks, engine request,
tokens, the record in the gateway's schema): what a proxy path written straight on the HTTP
parser could cost; and that work as a bare ASGI app under uvicorn with the gateway's protocol
and engine client (`floor+asgi`): what uvicorn and a task per request add to it.

Usage: python benchmarks/gateway_overhead.py [--agl-python /work/cache/agl-venv/bin/python] [--floor]
       [--engine runs/_cache/calc/tiny-warm600-prose60]
       [--latency-requests 2000] [--throughput-requests 1920] [--rounds 4] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rollover.config import GatewaySettings  # noqa: E402
from rollover.gateway.keys import scoped_key  # noqa: E402
from rollover.gateway.server import GatewayProcess, free_port, resolve, wait_healthy  # noqa: E402
from rollover.processes import die_with_parent, kill_group  # noqa: E402

KEY = "bench-admin"
MODEL = "policy"
ATTEMPT = "0"  # Agent Lightning's default attempt id; both gateways accept it
CHAT = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 8}
MESSAGES = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "What is 2 + 2?"}]}
RESPONSES = {"model": MODEL, "input": "What is 2 + 2?", "max_output_tokens": 8}
# figure 5: name -> (the stand-in's own path, the attempt's proxy path, body)
APIS = {
    "chat, streamed (for reference)": ("chat/completions", "openai/v1/chat/completions", CHAT | {"stream": True}),
    "anthropic messages": ("messages", "anthropic/v1/messages", MESSAGES),
    "anthropic messages, streamed": ("messages", "anthropic/v1/messages", MESSAGES | {"stream": True}),
    "responses": ("responses", "openai/v1/responses", RESPONSES),
    "responses, streamed": ("responses", "openai/v1/responses", RESPONSES | {"stream": True}),
}
TARGETS = {"latency_ms": 0.5, "throughput_ratio": 0.85, "rollouts_per_s": 30_000, "events_per_s": 3_000}


@dataclass(frozen=True)
class Settings:
    latency_requests: int = 2000  # figure 1, per path
    throughput_requests: int = 1920  # figure 2, per path
    throughput_concurrency: int = 64
    slow_delay: float = 0.1  # figure 2's upstream seconds per call
    batches: int = 200  # figure 3, batches of `batch_size` per gateway
    batch_size: int = 64
    batch_concurrency: int = 4
    events: int = 6000  # figure 4, per gateway
    event_concurrency: int = 16
    rounds: int = 4  # interleaved rounds each figure is split into
    agl_python: str | None = None  # a Python with agentlightning installed
    baseline_root: str | None = None  # another Rollover source tree (an older commit) to measure too
    floor: bool = False  # also measure `relay_floor.py`, a relay that does nothing else
    engine: str | None = None  # figure 6: a model folder, served by vLLM
    engine_requests: int = 800  # figure 6, per API and path


@dataclass
class PathFigures:
    """One path's figures (direct = the upstream without a gateway)."""

    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None
    cpu_ms_per_call: float | None = None  # of the server (direct: the upstream's), at c=1
    # at c=1, the stand-in's and the benchmark client's: the same work on every path (but for
    # the token ids and logprobs Rollover asks the stand-in for, ~0.03 ms of its CPU), so what
    # they spend more behind a gateway is what its process costs its neighbours on shared cores
    stand_in_cpu_ms_per_call: float | None = None
    client_cpu_ms_per_call: float | None = None
    throughput_rps: float | None = None
    rollouts_per_s: float | None = None
    events_per_s: float | None = None
    cpu_ms_per_event: float | None = None


@dataclass
class Report:
    settings: Settings
    paths: dict[str, PathFigures] = field(default_factory=dict)
    load: tuple[float, float] = (0.0, 0.0)
    # figure 5, per API: the p50 ms served natively by the stand-in, and through Rollover
    apis: dict[str, tuple[float, float]] = field(default_factory=dict)
    # figure 6, per API: the p50 ms served by vLLM itself, through Rollover's train and val paths
    engine_apis: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    def added_latency_ms(self, path: str) -> float | None:
        mine, direct = self.paths[path].latency_p50_ms, self.paths["direct"].latency_p50_ms
        return None if mine is None or direct is None else mine - direct

    def throughput_ratio(self, path: str) -> float | None:
        mine, direct = self.paths[path].throughput_rps, self.paths["direct"].throughput_rps
        return None if not mine or not direct else mine / direct

    def to_json(self) -> dict[str, Any]:
        gateways = [p for p in self.paths if p != "direct"]
        return {
            "settings": asdict(self.settings),
            "load": self.load,
            "paths": {name: asdict(figures) for name, figures in self.paths.items()},
            "added_latency_ms": {p: self.added_latency_ms(p) for p in gateways},
            "throughput_ratio": {p: self.throughput_ratio(p) for p in gateways},
            "apis_added_latency_ms": {api: through - direct for api, (direct, through) in self.apis.items()},
            "engine_apis_added_latency_ms": {
                api: {"train": train - own, "val": val - own} for api, (own, train, val) in self.engine_apis.items()
            },
        }


# -- the servers ---------------------------------------------------------------------------


@dataclass
class Gateway:
    """How the load reaches one gateway: its URL and who may call what."""

    name: str
    url: str
    pid: int  # the server process, whose CPU time is counted
    admin_headers: dict[str, str]
    agent_headers: Callable[[str], dict[str, str]]
    model_body: list[dict[str, Any]]
    relay_only: bool = False  # the floor: it relays model calls and has no rollout API
    proxy_paths: bool = False  # a floor that answers the attempts' proxy paths (Rollover's rollouts)


def start_stub(stack: ExitStack) -> tuple[str, int]:
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-m", "rollover.testing.stub_upstream", "--port", str(port)],
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    stack.callback(kill_group, stub)
    wait_healthy(f"http://127.0.0.1:{port}")
    return f"http://127.0.0.1:{port}/v1", stub.pid


def start_rollover(stack: ExitStack, upstream: str, folder: str) -> Gateway:
    gateway = stack.enter_context(GatewayProcess(store=f"{folder}/bench.db", admin_key=KEY))
    assert gateway.process is not None
    return Gateway(
        name="rollover",
        url=gateway.url,
        pid=gateway.process.pid,
        admin_headers={"Authorization": f"Bearer {KEY}"},
        agent_headers=_agent_key,
        model_body=[{"model": MODEL, "endpoint": upstream}],
    )


def start_baseline(stack: ExitStack, root: str, upstream: str, folder: str) -> Gateway:
    """Rollover's gateway from another source tree, with its own defaults. It is started with
    the flags every tree has (settings JSON would carry keys an older tree does not know)."""
    settings = resolve(GatewaySettings.from_config(store=f"{folder}/baseline.db", admin_key=KEY))
    gateway = settings.gateway
    flags = ["--host", gateway.host, "--port", str(gateway.port), "--store", f"{folder}/baseline.db", "--key", KEY]
    process = subprocess.Popen(
        [sys.executable, "-m", "rollover.cli.main", "gateway", *flags],
        env=os.environ | {"PYTHONPATH": root},
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    stack.callback(kill_group, process)
    url = f"http://{settings.gateway.host}:{settings.gateway.port}"
    wait_healthy(url, timeout=60, process=process)
    return Gateway(
        name="baseline",
        url=url,
        pid=process.pid,
        admin_headers={"Authorization": f"Bearer {KEY}"},
        # its scoped keys may follow another scheme (per rollout before per attempt): the admin key
        agent_headers=lambda rid: {"Authorization": f"Bearer {KEY}"},
        model_body=[{"model": MODEL, "endpoint": upstream}],
    )


def start_floor(
    stack: ExitStack, upstream: str, record: str | None = None, proxy_work: bool = False, asgi: bool = False
) -> Gateway:
    """`relay_floor.py`: the relay that does nothing but relay (what any gateway pays first);
    with `record` (a SQLite file), one that also commits each call before answering it; with
    `proxy_work` too, one that does the gateway's per-call work on the chat route (it answers
    the attempts' proxy paths, with their keys)."""
    port = free_port()
    flags = [] if record is None else ["--record", record]
    if proxy_work:
        assert record is not None, "the per-call work records the call"
        flags += ["--proxy-work", KEY, *(["--asgi"] if asgi else [])]
    process = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "relay_floor.py"),
            "--port",
            str(port),
            "--upstream",
            upstream,
            *flags,
        ],
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    stack.callback(kill_group, process)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process=process)
    if proxy_work:
        name = "floor+asgi" if asgi else "floor+proxy"
        return Gateway(name, url, process.pid, {}, _agent_key, [], relay_only=True, proxy_paths=True)
    return Gateway(
        "floor" if record is None else "floor+record", url, process.pid, {}, lambda rid: {}, [], relay_only=True
    )


def _agent_key(rollout_id: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {scoped_key(KEY, rollout_id, ATTEMPT)}"}


def start_agent_lightning(stack: ExitStack, python: str, upstream: str, folder: str) -> Gateway:
    """Agent Lightning's gateway/store server, started as its own documentation says."""
    port = free_port()
    overrides = [f"port={port}", "host=127.0.0.1", f"key={KEY}", f"default_proxy.model_name={MODEL}"]
    hydra = [f"hydra.run.dir={folder}/agl", "hydra.output_subdir=null"]
    process = subprocess.Popen(
        # absolute (it runs in `folder`), but not resolved: a venv's python is a link to its base
        [os.path.abspath(python), "-m", "agentlightning.server", *overrides, *hydra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_parent,
        cwd=folder,
    )
    stack.callback(kill_group, process)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=120)
    headers = {"Authorization": f"Bearer {KEY}"}
    return Gateway(
        name="agent-lightning",
        url=url,
        pid=process.pid,
        admin_headers=headers,
        agent_headers=lambda rid: headers,
        model_body=[{"model": MODEL, "endpoint": upstream}],
    )


async def running_rollouts(session: aiohttp.ClientSession, gateway: Gateway, count: int) -> list[str]:
    body = [{"input": {"i": i}} for i in range(count)]
    async with session.post(f"{gateway.url}/api/rollouts", json=body, headers=gateway.admin_headers) as response:
        assert response.status == 201, await response.text()
        ids = [r["rollout_id"] for r in await response.json()]
    claim = {"status": {"state": "running", "last_attempt_id": ATTEMPT}}
    for rid in ids:
        async with session.patch(f"{gateway.url}/api/rollouts/{rid}", json=claim, headers=gateway.admin_headers) as r:
            assert r.status == 200, await r.text()
    return ids


async def serving_agents(session: aiohttp.ClientSession, gateway: Gateway, count: int) -> list[str]:
    """The gateway's model registered, then `count` running rollouts (their ids) to call through."""
    async with session.post(f"{gateway.url}/api/models", json=gateway.model_body, headers=gateway.admin_headers) as r:
        assert r.status == 201, await r.text()
    return await running_rollouts(session, gateway, count)


# -- the load ------------------------------------------------------------------------------

Request = tuple[str, bytes, dict[str, str]]  # url, body, headers
Call = Callable[[int], Request]  # request number -> what to send


def cycling(requests: list[Request]) -> Call:
    return lambda n: requests[n % len(requests)]


def attempt_calls(gateway: Gateway, ids: list[str], mode: str, proxied: str, body: bytes) -> Call:
    """`body` POSTed to `proxied` under each running rollout's proxy path in turn, with its key."""
    return cycling(
        [
            (
                f"{gateway.url}/proxy/rollout/{rid}/attempt/{ATTEMPT}/mode/{mode}/{proxied}",
                body,
                json_headers(gateway.agent_headers(rid)),
            )
            for rid in ids
        ]
    )


async def hammer(
    session: aiohttp.ClientSession, call: Call, requests: int, concurrency: int
) -> tuple[list[float], float]:
    """`requests` POSTs from `concurrency` workers; each call's latency and the wall time."""
    latencies: list[float] = []
    numbers = iter(range(requests))

    async def worker() -> None:
        for n in numbers:
            url, body, headers = call(n)
            started = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                if response.status >= 300:
                    raise RuntimeError(f"{url} answered {response.status}: {await response.text()}")
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - started


def json_headers(headers: dict[str, str]) -> dict[str, str]:
    return headers | {"Content-Type": "application/json"}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Measured:
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    cpu: float = 0.0  # seconds of the server process
    stand_in_cpu: float = 0.0  # seconds of the stand-in upstream, when asked for
    client_cpu: float = 0.0  # seconds of this process, the client

    def cpu_ms_per_call(self, seconds: float | None = None) -> float:
        return (self.cpu if seconds is None else seconds) / len(self.latencies) * 1e3


Run = Callable[[int], Awaitable[tuple[list[float], float]]]  # requests -> latencies, wall time


async def interleaved(
    runs: dict[str, tuple[Run, int]], total: int, rounds: int, stand_in: int | None = None
) -> dict[str, Measured]:
    """Each run (with the pid of the server it loads) `rounds` times in turn, `total / rounds`
    requests each; latencies, wall and CPU time summed (the client's too, and with `stand_in`
    the stand-in upstream's)."""
    results = {name: Measured() for name in runs}
    per_round = max(1, total // rounds)
    for _ in range(rounds):
        for name, (run, pid) in runs.items():
            cpu_before, client_before = cpu_seconds(pid), time.process_time()
            stand_in_before = 0.0 if stand_in is None else cpu_seconds(stand_in)
            latencies, wall = await run(per_round)
            measured = results[name]
            measured.latencies += latencies
            measured.wall += wall
            measured.cpu += cpu_seconds(pid) - cpu_before
            measured.client_cpu += time.process_time() - client_before
            if stand_in is not None:
                measured.stand_in_cpu += cpu_seconds(stand_in) - stand_in_before
    return results


def percentile(values: Sequence[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def p50s_at_c1(
    session: aiohttp.ClientSession,
    calls: dict[str, tuple[Call, int]],
    requests: int,
    rounds: int,
    warmup: tuple[int, int],
) -> dict[str, float]:
    """Each call (with the pid of the server it loads) warmed up (`warmup`: requests,
    concurrency), then `requests` of each one at a time in interleaved rounds: p50 ms by name."""
    paired: dict[str, tuple[Run, int]] = {}
    for name, (call, pid) in calls.items():
        await hammer(session, call, *warmup)
        paired[name] = ((lambda c: lambda n: hammer(session, c, n, 1))(call), pid)
    results = await interleaved(paired, requests, rounds)
    return {name: percentile(measured.latencies, 50) * 1e3 for name, measured in results.items()}


async def measure(
    settings: Settings, upstream: str, stub_pid: int, gateways: list[Gateway], apis: dict[str, tuple[float, float]]
) -> dict[str, PathFigures]:
    figures = {"direct": PathFigures()} | {g.name: PathFigures() for g in gateways}
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        agents: dict[str, list[str]] = {}
        api_gateways = [g for g in gateways if not g.relay_only]
        for gateway in api_gateways:
            agents[gateway.name] = await serving_agents(session, gateway, settings.throughput_concurrency)

        def chat_calls(delay: float) -> dict[str, Call]:
            body = json.dumps(CHAT | {"metadata": {"stub_delay": delay}}).encode()
            direct = (f"{upstream}/chat/completions", body, json_headers({}))
            calls: dict[str, Call] = {"direct": cycling([direct])}
            for gateway in gateways:
                if gateway.relay_only and not gateway.proxy_paths:
                    calls[gateway.name] = cycling([(f"{gateway.url}/relay", body, json_headers({}))])
                    continue
                ids = agents["rollover" if gateway.proxy_paths else gateway.name]
                calls[gateway.name] = attempt_calls(gateway, ids, "train", "openai/v1/chat/completions", body)
            return calls

        pids = {"direct": stub_pid} | {g.name: g.pid for g in gateways}

        def runs(calls: dict[str, Call], concurrency: int) -> dict[str, tuple[Run, int]]:
            def run(call: Call) -> Run:
                return lambda requests: hammer(session, call, requests, concurrency)

            return {name: (run(call), pids[name]) for name, call in calls.items()}

        # 1. latency at concurrency 1, fast upstream (after a warm-up of every path)
        fast = chat_calls(0.0)
        for call in fast.values():
            await hammer(session, call, 200, 4)
        results = await interleaved(runs(fast, 1), settings.latency_requests, settings.rounds, stand_in=stub_pid)
        for name, measured in results.items():
            figures[name].latency_p50_ms = percentile(measured.latencies, 50) * 1e3
            figures[name].latency_p99_ms = percentile(measured.latencies, 99) * 1e3
            figures[name].cpu_ms_per_call = measured.cpu_ms_per_call()
            figures[name].stand_in_cpu_ms_per_call = measured.cpu_ms_per_call(measured.stand_in_cpu)
            figures[name].client_cpu_ms_per_call = measured.cpu_ms_per_call(measured.client_cpu)

        # 5. the translated APIs, Rollover only (at c=1, fast upstream, like figure 1)
        rollover = next(g for g in gateways if g.name == "rollover")
        for api, (native, proxied, api_body) in APIS.items():
            encoded = json.dumps(api_body).encode()
            direct = cycling([(f"{upstream}/{native}", encoded, json_headers({}))])
            through = attempt_calls(rollover, agents["rollover"], "train", proxied, encoded)
            p50 = await p50s_at_c1(
                session,
                {"direct": (direct, stub_pid), "rollover": (through, rollover.pid)},
                settings.latency_requests // 2,
                settings.rounds,
                warmup=(100, 4),
            )
            apis[api] = (p50["direct"], p50["rollover"])

        # 2. throughput at concurrency 64, slow upstream
        slow = chat_calls(settings.slow_delay)
        results = await interleaved(
            runs(slow, settings.throughput_concurrency), settings.throughput_requests, settings.rounds
        )
        for name, measured in results.items():
            figures[name].throughput_rps = len(measured.latencies) / measured.wall

        # 3. rollout creation in batches
        batch = json.dumps([{"input": {"question": f"q{i}"}, "metadata": {"i": i}} for i in range(settings.batch_size)])
        creations: dict[str, Call] = {}
        for gateway in api_gateways:
            entry = (f"{gateway.url}/api/rollouts", batch.encode(), json_headers(gateway.admin_headers))
            creations[gateway.name] = cycling([entry])
        results = await interleaved(runs(creations, settings.batch_concurrency), settings.batches, settings.rounds)
        for name, measured in results.items():
            figures[name].rollouts_per_s = len(measured.latencies) * settings.batch_size / measured.wall

        # 4. event posting, one rollout per worker (an agent reporting as it goes)
        postings: dict[str, Call] = {}
        for gateway in api_gateways:
            ids = agents[gateway.name][: settings.event_concurrency]
            event = json.dumps({"event_type": "reward", "data": {"value": 1.0}}).encode()
            prepared = [
                (
                    f"{gateway.url}/api/rollouts/{rid}/attempt/{ATTEMPT}/events",
                    event,
                    json_headers(gateway.agent_headers(rid)),
                )
                for rid in ids
            ]
            postings[gateway.name] = cycling(prepared)
        results = await interleaved(runs(postings, settings.event_concurrency), settings.events, settings.rounds)
        for name, measured in results.items():
            figures[name].events_per_s = len(measured.latencies) / measured.wall
            figures[name].cpu_ms_per_event = measured.cpu_ms_per_call()
    return figures


async def measure_engine(
    settings: Settings, engine_url: str, engine_pid: int, engine_headers: dict[str, str], gateway: Gateway
) -> dict[str, tuple[float, float, float]]:
    """Figure 6: each API at c=1, one-token answers, vLLM itself against through the gateway on
    the attempt's train and val paths, in interleaved rounds."""
    found: dict[str, tuple[float, float, float]] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        ids = await serving_agents(session, gateway, 8)
        apis = {"chat completions": ("chat/completions", "openai/v1/chat/completions", CHAT | {"model": MODEL})}
        for api, (native, proxied, body) in (apis | APIS).items():
            one_token = body | ({"max_output_tokens": 1} if "max_output_tokens" in body else {"max_tokens": 1})
            encoded = json.dumps(one_token).encode()
            calls = {"own": (cycling([(f"{engine_url}/{native}", encoded, json_headers(engine_headers))]), engine_pid)}
            for mode in ("train", "val"):
                calls[mode] = (attempt_calls(gateway, ids, mode, proxied, encoded), gateway.pid)
            p50 = await p50s_at_c1(session, calls, settings.engine_requests, settings.rounds, warmup=(50, 1))
            found[api] = (p50["own"], p50["train"], p50["val"])
    return found


def run_engine_figure(settings: Settings, folder: str) -> dict[str, tuple[float, float, float]]:
    """vLLM on `settings.engine` over TCP, a Rollover gateway of its own in front of it."""
    assert settings.engine is not None
    from rollover.engine.vllm_engine import VLLMEngine
    from rollover.gateway.keys import upstream_key

    with ExitStack() as stack:
        engine = VLLMEngine(
            settings.engine,
            log_path=f"{folder}/engine.log",
            max_model_len=1024,
            enforce_eager=True,
            unix_socket=False,
            kv_cache_space_gb=1,
            start_timeout_s=600,
        )
        engine.start()
        stack.callback(engine.stop)
        engine.wait_ready()
        asyncio.run(engine.open_to_gateway(upstream_key(KEY)))
        assert engine.pid is not None
        os.makedirs(f"{folder}/engine-gateway", exist_ok=True)
        gateway = start_rollover(stack, engine.base_url, f"{folder}/engine-gateway")
        with engine.client() as http:  # the owner's key, which opens the engine's routes
            owner = {"Authorization": http.headers["authorization"]}
        return asyncio.run(measure_engine(settings, engine.base_url, engine.pid, owner, gateway))


def run_benchmark(settings: Settings) -> Report:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        upstream, stub_pid = start_stub(stack)
        gateways = [start_rollover(stack, upstream, folder)]
        if settings.floor:
            gateways.append(start_floor(stack, upstream))
            gateways.append(start_floor(stack, upstream, f"{folder}/floor.db"))
            gateways.append(start_floor(stack, upstream, f"{folder}/floor-proxy.db", proxy_work=True))
            gateways.append(start_floor(stack, upstream, f"{folder}/floor-asgi.db", proxy_work=True, asgi=True))
        if settings.baseline_root:
            gateways.append(start_baseline(stack, settings.baseline_root, upstream, folder))
        if settings.agl_python:
            gateways.append(start_agent_lightning(stack, settings.agl_python, upstream, folder))
        apis: dict[str, tuple[float, float]] = {}
        paths = asyncio.run(measure(settings, upstream, stub_pid, gateways, apis))
        engine_apis = run_engine_figure(settings, folder) if settings.engine else {}
    return Report(
        settings=settings, paths=paths, load=(load_before, os.getloadavg()[0]), apis=apis, engine_apis=engine_apis
    )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(report: Report) -> str:
    s = report.settings
    names = list(report.paths)
    gateways = [n for n in names if n != "direct"]
    width = 17
    lines = [
        f"1-minute load average {report.load[0]:.1f} before, {report.load[1]:.1f} after; {s.rounds} interleaved rounds",
        f"{'figure':<44}" + "".join(f"{n:>{width}}" for n in names) + f"{'target':>{width}}",
    ]

    def row(label: str, values: list[str], target: str) -> None:
        lines.append(f"{label:<44}" + "".join(f"{v:>{width}}" for v in values) + f"{target:>{width}}")

    p = report.paths
    row("latency p50 ms, c=1, fast upstream", [_fmt(p[n].latency_p50_ms, ".2f") for n in names], "")
    row("latency p99 ms, c=1, fast upstream", [_fmt(p[n].latency_p99_ms, ".2f") for n in names], "")
    row("server CPU ms per call, c=1", [_fmt(p[n].cpu_ms_per_call, ".2f") for n in names], "")
    row("  stand-in's CPU ms per call", [_fmt(p[n].stand_in_cpu_ms_per_call, ".2f") for n in names], "")
    row("  client's CPU ms per call", [_fmt(p[n].client_cpu_ms_per_call, ".2f") for n in names], "")
    row(
        "added latency p50 ms, c=1",
        [""] + [_fmt(report.added_latency_ms(n), "+.2f") for n in gateways],
        f"<= {TARGETS['latency_ms']}",
    )
    row(
        f"req/s, c={s.throughput_concurrency}, {s.slow_delay * 1e3:.0f} ms upstream",
        [_fmt(p[n].throughput_rps, ".0f") for n in names],
        "",
    )
    row(
        "  x the direct rate",
        [""] + [_fmt(report.throughput_ratio(n), ".2f") for n in gateways],
        f">= {TARGETS['throughput_ratio']}",
    )
    row(
        f"rollouts/s, batches of {s.batch_size}, c={s.batch_concurrency}",
        [""] + [_fmt(p[n].rollouts_per_s, ".0f") for n in gateways],
        f">= {TARGETS['rollouts_per_s']}",
    )
    row(
        f"events/s, c={s.event_concurrency}",
        [""] + [_fmt(p[n].events_per_s, ".0f") for n in gateways],
        f">= {TARGETS['events_per_s']}",
    )
    row("  server CPU ms per event", [""] + [_fmt(p[n].cpu_ms_per_event, ".3f") for n in gateways], "")
    for api, (direct, through) in report.apis.items():
        lines.append(
            f"{api + ': p50 ms native, through rollover':<44}{direct:>{width}.2f}{through:>{width}.2f}"
            f"{through - direct:>+{width}.2f} added (target <= {TARGETS['latency_ms']})"
        )
    for api, (own, train, val) in report.engine_apis.items():
        lines.append(
            f"{api + ': p50 ms vLLM, through train, val':<44}{own:>{width}.2f}{train:>{width}.2f}{val:>{width}.2f}"
            f"   added {train - own:+.2f} (train), {val - own:+.2f} (val)"
        )
    floor, ours_added = report.paths.get("floor"), report.added_latency_ms("rollover")
    if floor is not None and ours_added is not None:
        floor_added = report.added_latency_ms("floor") or 0.0
        lines.append(f"rollover's added latency above the floor's: {ours_added - floor_added:+.2f} ms a call at c=1")
    if "agent-lightning" in p:
        ours, theirs = p["rollover"], p["agent-lightning"]
        ratios = [
            f"added latency x{(report.added_latency_ms('rollover') or 0) / (report.added_latency_ms('agent-lightning') or 1):.2f}",
            f"throughput x{(report.throughput_ratio('rollover') or 0) / (report.throughput_ratio('agent-lightning') or 1):.2f}",
            f"rollouts/s x{(ours.rollouts_per_s or 0) / (theirs.rollouts_per_s or 1):.2f}",
            f"events/s x{(ours.events_per_s or 0) / (theirs.events_per_s or 1):.2f}",
        ]
        lines.append("rollover / agent-lightning: " + ", ".join(ratios))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Settings()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if name == "agl_python":
            parser.add_argument(flag, default=None, help="a Python with agentlightning installed, to compare")
        elif name == "baseline_root":
            parser.add_argument(flag, default=None, help="a Rollover source tree (another commit) to compare")
        elif name == "engine":
            parser.add_argument(flag, default=None, help="a model folder: figure 6, against vLLM serving it")
        elif name == "floor":
            parser.add_argument(flag, action="store_true", help="also measure benchmarks/relay_floor.py")
        else:
            parser.add_argument(flag, type=type(value), default=value)
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = vars(parser.parse_args(argv))
    as_json = args.pop("json")
    report = run_benchmark(Settings(**args))
    print(format_report(report))
    if as_json:
        print(json.dumps(report.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
