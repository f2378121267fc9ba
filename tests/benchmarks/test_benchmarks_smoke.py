"""Smoke runs of the benchmarks: each runs to completion and prints sane figures.

Nothing here asserts a timing threshold; the figures themselves are in benchmarks/README.md.
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
from contextlib import ExitStack

import pytest

from benchmarks import (
    async_vs_sync,
    drain_latency,
    gateway_overhead,
    gateway_stages,
    simulate_vs_measured,
    stream_translation,
)


@pytest.mark.vllm
def test_async_vs_sync_smoke(tmp_path, calc_model, vllm_engine, capsys):
    settings = async_vs_sync.Settings(
        median=0.01, sigma=0.5, batch=2, n=2, updates=2, out_dir=tmp_path, model=calc_model
    )
    report = async_vs_sync.run_benchmark(settings, (2.0,), engine=vllm_engine)
    with capsys.disabled():  # shown with -s; capsys is for the planner's output below
        print(async_vs_sync.format_report(report))
    assert report.sync.updates == 2 and report.sync.window == 2
    [result] = report.asyncs
    assert result.mode == "async" and result.window == 4 and result.updates == 2
    for mode in (report.sync, result):
        assert mode.train_s > 0 and mode.wall_s >= mode.train_s
        assert 0 <= mode.idle_fraction_mean <= 1
        assert mode.drain_s_mean >= 0 and mode.carry_over_age_max >= mode.carry_over_age_mean >= 0
        assert mode.model_calls_per_rollout >= 1 and mode.agent_start_s_mean >= 0
    assert report.sync.carry_over_age_max == 0  # sync keeps no carry-over
    assert result.speedup_over(report.sync) > 0
    assert report.ideal_speedup > 0 and report.durations["count"] >= 8
    assert json.loads(json.dumps(report.to_json()))["async"][0]["speedup"] > 0

    # The planner against the run folders just written.
    assert simulate_vs_measured.main(["--from", str(tmp_path), "--sim-seeds", "2", "--json"]) == 0
    [comparison] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["comparisons"]
    with capsys.disabled():
        print(comparison)
    assert comparison["window"] == 4 and comparison["measured"] > 0 and comparison["predicted"] > 0


@pytest.mark.slow
def test_drain_latency_smoke():
    # Calls of 1 s: on a busy machine both must still be in flight when the drain is measured.
    settings = drain_latency.Settings(
        repeats=2, delay=1.0, inflight=2, pauses=(0.3,), retry_afters=(1.0,), agents=2, agent_repeats=1
    )
    report = drain_latency.run_benchmark(settings)
    print(drain_latency.format_report(report))
    poll, wait = report.detection
    for detection in (poll, wait):
        assert detection.lag.mean >= 0 and detection.lag.max >= detection.lag.p50 >= 0
        assert detection.drain.mean >= 0 and detection.requests >= 1
    assert wait.requests == pytest.approx(1.0)  # one long poll per drain
    assert [p.announced for p in report.pauses] == [False, True]
    for pause in report.pauses:
        assert pause.calls == 2 and pause.extra_latency.mean >= 0 and pause.lost.mean >= 0
    assert report.baseline_call_s > 0


def test_simulate_vs_measured_smoke(tmp_path, capsys):
    rng = random.Random(0)
    durations = tmp_path / "durations.jsonl"
    durations.write_text("".join(json.dumps({"duration_s": rng.lognormvariate(0, 1)}) + "\n" for _ in range(24)))
    argv = [
        "--durations",
        str(durations),
        "--update-seconds",
        "0.5",
        "--measured-speedup",
        "1.3",
        "--batch",
        "2",
        "--n",
        "2",
        "--updates",
        "3",
        "--sim-seeds",
        "2",
    ]
    assert simulate_vs_measured.main(argv) == 0
    text = capsys.readouterr().out
    with capsys.disabled():
        print(text)
    assert "predicted" in text
    assert simulate_vs_measured.main([*argv, "--json"]) == 0
    [comparison] = json.loads(capsys.readouterr().out)["comparisons"]
    assert comparison["window"] == 4 and comparison["measured"] == 1.3
    assert comparison["predicted"] > 0 and comparison["predicted_running"] > 0
    assert comparison["relative_error"] == pytest.approx((comparison["predicted"] - 1.3) / 1.3)


@pytest.mark.slow
def test_gateway_overhead_smoke():
    settings = gateway_overhead.Settings(
        latency_requests=40,
        throughput_requests=64,
        throughput_concurrency=16,
        slow_delay=0.02,
        batches=8,
        batch_size=16,
        events=64,
        rounds=2,
        floor=True,
    )
    report = gateway_overhead.run_benchmark(settings)
    print(gateway_overhead.format_report(report))
    direct, rollover = report.paths["direct"], report.paths["rollover"]
    assert direct.latency_p99_ms >= direct.latency_p50_ms > 0
    assert rollover.latency_p99_ms >= rollover.latency_p50_ms > 0
    assert report.throughput_ratio("rollover") > 0 and report.added_latency_ms("rollover") is not None
    assert rollover.rollouts_per_s > 0 and rollover.events_per_s > 0
    assert json.loads(json.dumps(report.to_json()))["throughput_ratio"]["rollover"] > 0
    floor = report.paths["floor"]  # the bare relay answered every call; it has no rollout API
    assert floor.latency_p50_ms > 0 and report.throughput_ratio("floor") > 0 and floor.rollouts_per_s is None
    recording = report.paths["floor+record"]  # the relay that commits each call before answering
    assert recording.latency_p50_ms > 0 and report.throughput_ratio("floor+record") > 0
    lean = report.paths["floor+proxy"]  # the relay doing the chat route's per-call work
    assert lean.latency_p50_ms > 0 and report.throughput_ratio("floor+proxy") > 0
    under_uvicorn = report.paths["floor+asgi"]  # that work as a bare ASGI app under uvicorn
    assert under_uvicorn.latency_p50_ms > 0 and report.throughput_ratio("floor+asgi") > 0
    assert "above the floor" in gateway_overhead.format_report(report)
    # What each path costs the stand-in and the client (the gateway's neighbours) is measured.
    for path in report.paths.values():
        assert path.stand_in_cpu_ms_per_call is not None and path.stand_in_cpu_ms_per_call >= 0
        assert path.client_cpu_ms_per_call is not None and path.client_cpu_ms_per_call > 0
    assert "stand-in's CPU ms per call" in gateway_overhead.format_report(report)
    # The translated APIs, each against the stand-in serving it natively.
    assert set(report.apis) == set(gateway_overhead.APIS)
    assert all(direct > 0 and through > 0 for direct, through in report.apis.values())


@pytest.mark.vllm
def test_gateway_overhead_engine_figure(tmp_path, calc_model):
    """Figure 6: every API served by vLLM itself and through a gateway, on both paths."""
    settings = gateway_overhead.Settings(engine=str(calc_model), engine_requests=8, rounds=1)
    found = gateway_overhead.run_engine_figure(settings, str(tmp_path))
    assert set(found) == {"chat completions", *gateway_overhead.APIS}
    assert all(own > 0 and train > 0 and val > 0 for own, train, val in found.values())
    report = gateway_overhead.Report(settings=settings, engine_apis=found)
    assert set(report.to_json()["engine_apis_added_latency_ms"]["responses"]) == {"train", "val"}


def test_relay_floor_records_each_call_before_answering(tmp_path):
    """`relay_floor --record`: one committed row per call, holding the request and the answer."""
    from benchmarks.relay_floor import Recorder

    recorder = Recorder(str(tmp_path / "floor.db"))
    recorder.commit(b'{"q": 1}', b'{"a": 2}')
    rows = sqlite3.connect(tmp_path / "floor.db").execute("SELECT request, answer FROM calls").fetchall()
    assert rows == [(b'{"q": 1}', b'{"a": 2}')]


@pytest.mark.parametrize("asgi", [False, True], ids=["parser", "asgi"])
def test_relay_floor_does_the_proxy_work_and_records_as_the_gateway(tmp_path, asgi):
    """`relay_floor --record --proxy-work [--asgi]`: the attempt's key is checked, the engine is
    asked for token ids and logprobs under the call's id, and the call is recorded in the
    gateway's schema (its event and its calls row) before the answer goes back with that id,
    on the parser's callbacks and as an ASGI app under uvicorn alike."""
    import httpx

    from rollover.gateway.calls import CALL_ID_HEADER
    from rollover.gateway.keys import scoped_key
    from rollover.store.sqlite import RolloutStore

    key, store = gateway_overhead.KEY, tmp_path / "floor-proxy.db"
    with ExitStack() as stack:
        upstream, _ = gateway_overhead.start_stub(stack)
        relay = gateway_overhead.start_floor(stack, upstream, str(store), proxy_work=True, asgi=asgi)
        assert relay.name == ("floor+asgi" if asgi else "floor+proxy")
        url = f"{relay.url}/proxy/rollout/r1/attempt/a1/mode/train/openai/v1/chat/completions"
        good = {"Authorization": f"Bearer {scoped_key(key, 'r1', 'a1')}"}
        other = {"Authorization": f"Bearer {scoped_key(key, 'r1', 'a2')}"}  # another attempt's key
        assert httpx.post(url, json=gateway_overhead.CHAT, headers=other).status_code == 401
        answer = httpx.post(url, json=gateway_overhead.CHAT, headers=good)
    assert answer.status_code == 200
    call_id = answer.headers[CALL_ID_HEADER]
    conn = sqlite3.connect(store)
    [(event_id, event_type, data)] = conn.execute("SELECT event_id, event_type, data FROM events").fetchall()
    assert event_type == "model_request"
    assert conn.execute("SELECT call_id, rollout_id, attempt_id, event_id FROM calls").fetchall() == [
        (call_id, "r1", "a1", event_id)
    ]
    record = json.loads(data)
    assert record["call_id"] == call_id and record["response"] == answer.json()
    assert record["prompt_token_ids"] and record["response_token_ids"] and record["response_logprobs"]
    assert len(record["response_logprobs"]) == len(record["response_token_ids"])  # train mode asked for them
    conn.close()
    owner = RolloutStore(store)  # the gateway's own store finds the call where a reward names it
    try:
        assert asyncio.run(owner.call_owner(call_id)) == ("r1", "a1")
    finally:
        owner.close()


@pytest.mark.slow
def test_gateway_stages_smoke():
    figures = gateway_stages.measure(calls=60, warmup=10)
    print(gateway_stages.format_report(figures))
    assert figures["calls"] == 50  # every proxied call passed every probe, in order
    assert list(figures["stages_us"]) == [name for name, _, _ in gateway_stages.STAGES]
    assert all(us > 0 for us in figures["stages_us"].values())
    assert 0 < figures["in_gateway_us"] < figures["proxied_p50_ms"] * 1e3
    assert figures["proxied_p50_ms"] > 0 and figures["direct_p50_ms"] > 0


@pytest.mark.slow
def test_train_step_smoke(capsys):
    from benchmarks import train_step

    argv = ["--ranks", "1,2", "--samples", "6", "--length", "24", "--hidden", "64", "--layers", "2"]
    assert train_step.main([*argv, "--repeats", "1", "--device", "cpu", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    results = json.loads(out[-1])
    assert [r["ranks"] for r in results] == [1, 2]
    for r in results:
        assert r["tokens"] > 0 and r["update_s_median"] > 0 and r["tokens_per_s"] > 0
    assert results[0]["tokens"] == results[1]["tokens"]  # the same batch on both
    assert out[0].split()[:2] == ["workload", "ranks"] and len(out) == 4  # header, one row per rank count, JSON


@pytest.mark.slow
def test_train_step_length_mix_smoke(capsys):
    """The harness mix on 1 rank: padded, packed and shared rows, each with an outcome and a
    turn estimator, the same tokens and their fractions."""
    from benchmarks import train_step

    argv = ["--workload", "harness", "--prefix", "64", "--samples", "4", "--ranks", "1", "--hidden", "64"]
    argv += ["--estimators", "grpo,gigpo"]
    assert train_step.main([*argv, "--layers", "1", "--repeats", "1", "--device", "cpu", "--json"]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["workload"] for r in results] == [
        f"harness {layout}{suffix}" for layout in ("padded", "packed", "shared") for suffix in ("", " gigpo")
    ]
    assert len({r["tokens"] for r in results}) == 1 and all(r["update_s_median"] > 0 for r in results)
    padded, packed, shared = results[0], results[2], results[4]
    assert padded["padding_fraction"] > 0 and packed["padding_fraction"] == 0.0
    assert packed["prefix_shared_tokens_fraction"] == 0.0 < shared["prefix_shared_tokens_fraction"]


@pytest.mark.slow
def test_update_cost_smoke(capsys):
    from benchmarks import update_cost

    assert (
        update_cost.main(
            ["--samples", "4", "--length", "32", "--repeats", "1", "--hidden", "64", "--layers", "1", "--json"]
        )
        == 0
    )
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [v["name"] for v in figures["variants"]] == list(update_cost.VARIANTS)
    assert all(v["update_s"] > 0 for v in figures["variants"])
    assert figures["variants"][2]["reference_s"] > 0 and figures["variants"][0]["reference_s"] == 0
    memory = figures["memory_bytes"]
    assert memory["reference_params"] == memory["actor_params"]  # a frozen copy: weights, no grads or moments
    assert memory["actor_optimizer"] == 2 * memory["actor_params"]  # AdamW's two moments


@pytest.mark.slow
@pytest.mark.vllm
def test_weight_sync_full_vs_lora_smoke(tmp_path):
    """The tiny model synced whole and as a LoRA adapter (its own two engines): the adapter
    moves fewer bytes, and the figures come out in one line."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "weight_sync.py"
    argv = ["--only", "tiny", "--lora-rank", "8", "--repeats", "1", "--workdir", str(tmp_path)]
    done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    print(done.stdout)
    line = next(x for x in done.stdout.splitlines() if "full vs LoRA r8" in x)
    full_mb, lora_mb = (float(v) for v in re.findall(r"bytes moved ([\d.]+) MB vs ([\d.]+) MB", line)[0])
    assert 0 < lora_mb < full_mb
    memory_full, memory_lora = (float(v) for v in re.findall(r"peak memory (\d+) MB vs (\d+) MB", line)[0])
    assert memory_full > 0 and memory_lora > 0


def test_image_store_smoke(capsys):
    """Ten turns re-sending one screenshot store it once: the store grows by about one image
    plus the records' text, far below keeping each call's copy."""
    from benchmarks import image_store

    assert image_store.main(["--turns", "10", "--size", "320x200", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["images_stored"] == 1
    assert result["store_growth_bytes"] < 2 * result["one_image_plus_text_bytes"]
    assert result["ratio_inline_to_stored"] > 3


def test_stream_translation_smoke():
    costs = stream_translation.measure(short=2, long=6, rounds=2, repeat=1)
    assert set(costs) == set(stream_translation.ROUTES)
    assert all(cost.per_token_us == cost.per_token_us for cost in costs.values())  # measured, not NaN
    assert "us a token" in stream_translation.format_costs(costs)
    # What is timed is the translation: each of the engine's tokens becomes one event of the API.
    stream = stream_translation.engine_stream(5)
    for route, delta in (
        ("anthropic messages", b"event: content_block_delta"),
        ("responses", b"event: response.output_text.delta"),
    ):
        out = stream_translation.relay(stream, stream_translation.ROUTES[route])
        assert out.count(delta) == 5, (route, out)
    assert stream_translation.relay(stream, None) == b"".join(stream)  # chat: the bytes as sent
