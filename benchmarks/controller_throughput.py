"""Controller throughput and per-rollout overhead with trivial local agents.

A gateway runs as its own process, a stand-in upstream answers every chat call at once, and
an in-process `Controller` runs `--rollouts` trivial agents, `--concurrency` at a time. Each
agent makes one LLM call through the gateway's proxy (carrying its rollout id, so the
upstream can time its arrival) and reports a reward. The `sdk` agent does it the way real
agents do, with `AgentContext` and the OpenAI client; the `stdlib` one with urllib only.

Every start method of the local runner runs the same workload in one run (`forkserver`:
agents forked from a process that imported the SDK once; `spawn`: a fresh interpreter per
agent), each in the agent sandbox and without it (`--sandbox both`, the default; the
sandbox's calls go through its bridge to the gateway). Prints, per method: rollouts started
and finished per second, and the overhead from the claim (the rollout's `started_at`) to the
agent's first LLM call reaching the upstream, in ms; then the ratios between the methods and
between sandboxed and not, and the bare cost of starting a Python interpreter on this machine.

Usage: python benchmarks/controller_throughput.py [--rollouts 64] [--concurrency 16] [--agent sdk|stdlib]
    [--sandbox both|on|off]
"""

from __future__ import annotations

import json
import os
import urllib.request


class SdkAgent:
    """What a real agent does: the SDK's context and OpenAI client."""

    def run(self) -> None:
        from rollover.agent import AgentContext

        ctx = AgentContext.from_env()
        ctx.openai().chat.completions.create(
            model="policy", messages=[{"role": "user", "content": ctx.rollout_id}], max_tokens=1
        )
        ctx.report_reward(1.0)


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
        urllib.request.urlopen(
            urllib.request.Request(os.environ["AGL_EVENT_URL"], json.dumps(reward).encode(), headers), timeout=60
        ).read()


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
    parser.add_argument("--agent", choices=["sdk", "stdlib"], default="sdk")
    parser.add_argument("--start-methods", default="forkserver,spawn")
    parser.add_argument("--sandbox", choices=["both", "on", "off"], default="both")
    args = parser.parse_args()
    agent_class = "benchmarks.controller_throughput:" + ("SdkAgent" if args.agent == "sdk" else "BenchAgent")

    arrivals: dict[str, float] = {}

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        arrivals.setdefault(body["messages"][0]["content"], time.time())
        return JSONResponse(
            {
                "id": "bench",
                "object": "chat.completion",
                "created": 0,
                "model": body.get("model"),
                "prompt_token_ids": [1, 2, 3],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                        "token_ids": [4],
                        "logprobs": {"content": [{"token": "ok", "logprob": -0.1}]},
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        )

    upstream = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

    upstream_port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(upstream, host="127.0.0.1", port=upstream_port, log_level="warning", access_log=False)
    )
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

    async def bench(gateway_url: str, key: str, log_dir: str, start_method: str, sandbox: bool) -> dict[str, float]:
        config = validate_config(
            {
                "agentlightning": {
                    "local": {
                        "agent_class": agent_class,
                        "max_concurrency": args.concurrency,
                        "start_method": start_method,
                        "sandbox": sandbox,
                    },
                    "rollout_timeout_seconds": 120,
                }
            }
        )
        arrivals.clear()
        async with GatewayClient(gateway_url, key) as client:
            await client.register_models([{"model": "policy", "endpoint": f"http://127.0.0.1:{upstream_port}/v1"}])
            async with Controller(config, client, log_dir=log_dir, poll_interval=args.poll_interval):
                ids = [f"bench-{start_method}-{sandbox}-{i:04d}" for i in range(args.rollouts)]
                started = time.perf_counter()
                await client.enqueue([RolloutCreate(rollout_id=rid, input={}) for rid in ids])
                while True:
                    rollouts = await client.list_rollouts(rollout_ids=ids)
                    if all(r.state.terminal for r in rollouts):
                        break
                    await asyncio.sleep(0.05)
                elapsed = time.perf_counter() - started
        failed = [r for r in rollouts if r.state.value != "succeeded"]
        overhead_ms = sorted(
            (arrivals[r.rollout_id] - (r.started_at or 0)) * 1000 for r in rollouts if r.rollout_id in arrivals
        )
        run_s = sorted((r.finished_at or 0) - (r.started_at or 0) for r in rollouts)
        if failed:
            print(f"{start_method}: {len(failed)} failed (first: {failed[0].status.error_message})")
        q = statistics.quantiles(overhead_ms, n=10, method="inclusive") if len(overhead_ms) > 1 else overhead_ms * 9
        return {
            "throughput": args.rollouts / elapsed,
            "elapsed": elapsed,
            "failed": len(failed),
            "start_p50": statistics.median(overhead_ms),
            "start_p90": q[8],
            "start_max": overhead_ms[-1],
            "run_p50": statistics.median(run_s) * 1000,
        }

    async def bench_all(gateway_url: str, key: str, log_dir: str) -> None:
        sandboxes = {"both": [False, True], "on": [True], "off": [False]}[args.sandbox]
        results = {}
        for method in args.start_methods.split(","):
            for sandbox in sandboxes:
                name = f"{method}{'+sandbox' if sandbox else ''}"
                results[name] = await bench(gateway_url, key, f"{log_dir}/{name}", method, sandbox)
        print(
            f"rollouts: {args.rollouts}, concurrency: {args.concurrency}, agent: {args.agent}, "
            f"poll interval: {args.poll_interval}s, cores: {os.cpu_count()}, load: {os.getloadavg()[0]:.1f}"
        )
        print(
            f"{'start method':<18} {'rollouts/s':>10} {'claim->LLM p50':>15} {'p90':>7} {'max':>7} {'rollout p50':>12} {'failed':>6}"
        )
        for method, r in results.items():
            print(
                f"{method:<18} {r['throughput']:>10.1f} {r['start_p50']:>12.0f} ms {r['start_p90']:>7.0f} {r['start_max']:>7.0f}"
                f" {r['run_p50']:>9.0f} ms {r['failed']:>6.0f}"
            )
        for suffix in ("", "+sandbox"):
            if f"forkserver{suffix}" in results and f"spawn{suffix}" in results:
                fork, spawn = results[f"forkserver{suffix}"], results[f"spawn{suffix}"]
                print(
                    f"forkserver{suffix} / spawn{suffix}: throughput x{fork['throughput'] / spawn['throughput']:.2f}, "
                    f"claim -> first LLM call p50 x{fork['start_p50'] / spawn['start_p50']:.2f}"
                )
        for method in args.start_methods.split(","):
            if method in results and f"{method}+sandbox" in results:
                plain, boxed = results[method], results[f"{method}+sandbox"]
                print(
                    f"{method}: sandbox / none: throughput x{boxed['throughput'] / plain['throughput']:.2f}, "
                    f"claim -> first LLM call p50 {boxed['start_p50']:.0f} ms vs {plain['start_p50']:.0f} ms"
                )
        print(f"for reference, a bare `python -c 'import urllib.request'`: {python_startup_ms():.0f} ms")

    key = "bench-admin"
    with tempfile.TemporaryDirectory() as tmp, GatewayProcess(store=f"{tmp}/bench.db", admin_key=key) as gateway:
        wait_healthy(gateway.url)
        asyncio.run(bench_all(gateway.url, key, f"{tmp}/agent_logs"))
    server.should_exit = True


if __name__ == "__main__":
    main()
