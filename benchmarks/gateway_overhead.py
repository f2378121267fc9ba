"""Proxy overhead: the same stand-in upstream called directly and through the gateway.

Prints latency p50/p99 and throughput for both, and the ratios, measured in one run.
Usage: python benchmarks/gateway_overhead.py [--requests 2000] [--concurrency 32] [--delay 0.0]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from rollover.gateway.auth import scoped_key
from rollover.gateway.server import GatewayProcess, free_port, wait_healthy
from rollover.processes import die_with_parent, kill_group

KEY = "bench-admin"


async def hammer(url: str, headers: dict[str, str], requests: int, concurrency: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    body = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 8}
    queue = iter(range(requests))
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def worker() -> None:
            for _ in queue:
                started = time.perf_counter()
                response = await client.post(url, json=body, headers=headers)
                response.raise_for_status()
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def main_async(args: argparse.Namespace) -> None:
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-m", "rollover.testing.stub_upstream", "--port", str(port), "--delay", str(args.delay)],
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    with tempfile.TemporaryDirectory() as tmp, GatewayProcess(store=f"{tmp}/bench.db", admin_key=KEY) as gateway:
        try:
            wait_healthy(f"http://127.0.0.1:{port}")
            admin = {"Authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(base_url=gateway.url, headers=admin) as client:
                await client.post("/api/models", json=[{"model": "policy", "endpoint": f"http://127.0.0.1:{port}/v1"}])
                [rollout] = (await client.post("/api/rollouts", json=[{"input": {}}])).json()
                rid = rollout["rollout_id"]
                await client.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}})
            direct_url = f"http://127.0.0.1:{port}/v1/chat/completions"
            proxy_url = f"{gateway.url}/proxy/rollout/{rid}/attempt/a1/mode/train/openai/v1/chat/completions"
            agent = {"Authorization": f"Bearer {scoped_key(KEY, rid)}"}
            await hammer(direct_url, {}, 100, args.concurrency)  # warm-up both paths
            await hammer(proxy_url, agent, 100, args.concurrency)
            direct, direct_wall = await hammer(direct_url, {}, args.requests, args.concurrency)
            proxied, proxied_wall = await hammer(proxy_url, agent, args.requests, args.concurrency)
        finally:
            kill_group(stub)

    rows = []
    for name, lat, wall in (("direct", direct, direct_wall), ("gateway", proxied, proxied_wall)):
        rows.append((name, percentile(lat, 50) * 1e3, percentile(lat, 99) * 1e3, len(lat) / wall))
    print(f"requests={args.requests} concurrency={args.concurrency} upstream_delay={args.delay}s")
    print(f"{'path':<8} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}")
    for name, p50, p99, rps in rows:
        print(f"{name:<8} {p50:8.2f} {p99:8.2f} {rps:8.0f}")
    (_, d50, d99, drps), (_, g50, g99, grps) = rows
    print(f"ratio gateway/direct: p50 x{g50 / d50:.2f}  p99 x{g99 / d99:.2f}  throughput x{grps / drps:.2f}")
    print(f"added latency per call: p50 +{g50 - d50:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--delay", type=float, default=0.0, help="stub upstream latency per call (s)")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
