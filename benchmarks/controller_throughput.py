"""Controller throughput and per-rollout overhead with trivial local agents.

A gateway runs as its own process, a stand-in upstream answers every chat call at once, and
an in-process `Controller` runs `--rollouts` trivial agents, `--concurrency` at a time. Each
agent makes one LLM call through the gateway's proxy (carrying its rollout id, so the
upstream can time its arrival) and reports a reward.

Prints: rollouts started and finished per second, and the overhead from the claim (the
rollout's `started_at`) to the agent's first LLM call reaching the upstream, in ms, next
to the bare cost of starting a Python interpreter on this machine.

Usage: python benchmarks/controller_throughput.py [--rollouts 64] [--concurrency 16]
"""

from __future__ import annotations

import json
import os
import urllib.request


class BenchAgent:
    """Stdlib only, so that the agent's own imports stay out of the measurement."""

    def run(self) -> None:
        rollout_id = os.environ["AGL_ROLLOUT_ID"]
        headers = {"Authorization": f"Bearer {os.environ['AGL_KEY']}", "Content-Type": "application/json"}
        body = {"model": "policy", "messages": [{"role": "user", "content": rollout_id}], "max_tokens": 1}
        request = urllib.request.Request(
            os.environ["AGL_OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(), headers
        )
        urllib.request.urlopen(request, timeout=60).read()
        reward = {"event_type": "reward", "data": {"value": 1.0}}
        urllib.request.urlopen(urllib.request.Request(os.environ["AGL_EVENT_URL"], json.dumps(reward).encode(), headers), timeout=60).read()


def main() -> None:
    import argparse
    import asyncio
    import statistics
    import subprocess
    import sys
    import tempfile
    import threading
    import time

    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from rollover.config import validate_config
    from rollover.controller import Controller
    from rollover.gateway.client import GatewayClient
    from rollover.gateway.server import GatewayProcess, free_port, wait_healthy
    from rollover.store.models import RolloutCreate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--poll-interval", type=float, default=0.25)
    args = parser.parse_args()

    arrivals: dict[str, float] = {}

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        arrivals.setdefault(body["messages"][0]["content"], time.time())
        return JSONResponse({
            "id": "bench", "object": "chat.completion", "created": 0, "model": body.get("model"),
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                         "token_ids": [4], "logprobs": {"content": [{"token": "ok", "logprob": -0.1}]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        })

    upstream = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

    upstream_port = free_port()
    server = uvicorn.Server(uvicorn.Config(upstream, host="127.0.0.1", port=upstream_port, log_level="warning", access_log=False))
    threading.Thread(target=server.run, daemon=True).start()
    give_up = time.monotonic() + 10
    while not server.started and time.monotonic() < give_up:
        time.sleep(0.02)

    def python_startup_ms(runs: int = 5) -> float:
        samples = []
        for _ in range(runs):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import urllib.request"], check=True)
            samples.append((time.perf_counter() - started) * 1000)
        return statistics.median(samples)

    async def bench(gateway_url: str, key: str, log_dir: str) -> None:
        config = validate_config({
            "agentlightning": {
                "local": {"agent_class": "benchmarks.controller_throughput:BenchAgent", "max_concurrency": args.concurrency},
                "rollout_timeout_seconds": 120,
            }
        })
        async with GatewayClient(gateway_url, key) as client:
            await client.register_models([{"model": "policy", "endpoint": f"http://127.0.0.1:{upstream_port}/v1"}])
            async with Controller(config, client, log_dir=log_dir, poll_interval=args.poll_interval):
                ids = [f"bench-{i:04d}" for i in range(args.rollouts)]
                started = time.perf_counter()
                await client.enqueue([RolloutCreate(rollout_id=rid, input={}) for rid in ids])
                while True:
                    rollouts = await client.list_rollouts(rollout_ids=ids)
                    if all(r.state.terminal for r in rollouts):
                        break
                    await asyncio.sleep(0.05)
                elapsed = time.perf_counter() - started
        failed = [r for r in rollouts if r.state.value != "succeeded"]
        overhead_ms = sorted((arrivals[r.rollout_id] - (r.started_at or 0)) * 1000 for r in rollouts if r.rollout_id in arrivals)
        run_s = sorted((r.finished_at or 0) - (r.started_at or 0) for r in rollouts)
        print(f"rollouts: {args.rollouts}, concurrency: {args.concurrency}, poll interval: {args.poll_interval}s, "
              f"cores: {os.cpu_count()}")
        print(f"succeeded: {args.rollouts - len(failed)}, failed: {len(failed)}"
              + (f" (first: {failed[0].status.error_message})" if failed else ""))
        print(f"throughput: {args.rollouts / elapsed:.1f} rollouts started+finished per second ({elapsed:.2f}s in all)")
        if overhead_ms:
            q = statistics.quantiles(overhead_ms, n=10, method="inclusive") if len(overhead_ms) > 1 else overhead_ms * 9
            print(f"claim -> first LLM call at the upstream: p50 {statistics.median(overhead_ms):.0f} ms, "
                  f"p90 {q[8]:.0f} ms, max {overhead_ms[-1]:.0f} ms")
        print(f"claim -> finished (whole trivial rollout): p50 {statistics.median(run_s) * 1000:.0f} ms")
        print(f"for reference, a bare `python -c 'import urllib.request'`: {python_startup_ms():.0f} ms")

    key = "bench-admin"
    with tempfile.TemporaryDirectory() as tmp, GatewayProcess(f"{tmp}/bench.db", key) as gateway:
        wait_healthy(gateway.url)
        asyncio.run(bench(gateway.url, key, f"{tmp}/agent_logs"))
    server.should_exit = True


if __name__ == "__main__":
    main()
