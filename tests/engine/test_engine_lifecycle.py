"""Start failures, crash detection and clean shutdown (one extra real server)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from rollover.engine.server import EngineError, EngineStartError
from rollover.engine.vllm_engine import VLLMEngine
from rollover.processes import descendant_pids, group_members
from rollover.testing.engine import TEST_MAX_MODEL_LEN, alive, engine_family
from tests.conftest import ADMIN_KEY

pytestmark = pytest.mark.vllm


def wait_for(predicate, timeout_s: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def small_engine(model_dir: Path, tmp_path: Path, **kwargs) -> VLLMEngine:
    return VLLMEngine(
        model_dir,
        log_path=tmp_path / "vllm.log",
        max_model_len=TEST_MAX_MODEL_LEN,
        enforce_eager=True,
        start_timeout_s=240,
        **kwargs,
    )


def test_missing_model_dir_fails_at_once(tmp_path: Path) -> None:
    engine = small_engine(tmp_path / "nope", tmp_path)
    with pytest.raises(EngineStartError, match="no config.json"):
        engine.start()
    assert not engine.is_alive()


def test_broken_model_dir_reports_exit_code_and_log_tail(tmp_path: Path) -> None:
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "no_such_arch", "architectures": ["Nope"]}))
    engine = small_engine(model, tmp_path)
    start = time.monotonic()
    engine.start()
    family: set[int] = set()
    with pytest.raises(EngineStartError) as info:
        family |= engine_family(engine)
        engine.wait_ready()
    elapsed = time.monotonic() - start
    print(f"\nbroken model dir failed in {elapsed:.1f} s, exit code {info.value.exit_code}")
    assert elapsed < 120
    assert info.value.exit_code not in (None, 0)
    assert "no_such_arch" in info.value.log_tail
    assert 0 < len(info.value.log_tail.splitlines()) <= 40
    assert not engine.is_alive() and not alive(family)


async def test_kill_mid_request_is_a_json_error_swept_and_the_watchdog_restores_service(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rollover.engine.watchdog import EngineWatchdog
    from rollover.gateway.keys import scoped_key
    from rollover.gateway.server import GatewayThread

    with GatewayThread(admin_key=ADMIN_KEY) as gateway, small_engine(tiny_model_dir, tmp_path) as engine:
        engine.attach_gateway(gateway.url, ADMIN_KEY)
        await engine.register_with_gateway(gateway.url, ADMIN_KEY)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as http:
            admin = {"x-api-key": ADMIN_KEY}
            [rollout] = (await http.post("/api/rollouts", json=[{"input": {}}], headers=admin)).json()
            rid = rollout["rollout_id"]
            running = {"status": {"state": "running", "last_attempt_id": "a1"}}
            await http.patch(f"/api/rollouts/{rid}", json=running, headers=admin)
            url = f"/proxy/rollout/{rid}/attempt/a1/mode/train/openai/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 8}
            agent = {"Authorization": f"Bearer {scoped_key(ADMIN_KEY, rid, 'a1')}"}

            # Freeze the API server so the call is surely in flight when it dies.
            family = engine_family(engine)
            assert len(family) >= 3  # supervisor, API server, engine core (+ worker)
            server = engine.server_pid
            assert server is not None and server in family
            os.kill(server, signal.SIGSTOP)
            in_flight = asyncio.ensure_future(http.post(url, json=body, headers=agent))
            deadline = time.monotonic() + 30
            while (await http.get("/proxy/state", headers=admin)).json()["inflight"] < 1:
                assert time.monotonic() < deadline, "the call never reached the gateway"
                await asyncio.sleep(0.05)
            os.kill(server, signal.SIGKILL)
            reply = await in_flight
            assert reply.status_code in (502, 503), reply.text
            error = reply.json()
            assert error["error"] and error["reason"], error
            assert (await http.get("/proxy/state", headers=admin)).json()["inflight"] == 0

            # The manager reports the crash with its reason; the watchdog brings it back.
            assert wait_for(lambda: engine.failure() is not None, 15), "the crash went unnoticed"
            assert "vLLM exited with code" in (engine.failure() or "")
            assert wait_for(lambda: not alive(family), 10), f"left behind: {alive(family)}"
            watchdog = EngineWatchdog(engine, asyncio.Lock(), max_restarts=1)
            assert await watchdog.check() is True
            assert engine.is_alive() and engine.failure() is None
            reply = await http.post(url, json=body, headers=agent)
            assert reply.status_code == 200, reply.text
            events = (await http.get(f"/api/rollouts/{rid}/events", headers=admin)).json()
            assert [e["data"]["policy_version"] for e in events if e["event_type"] == "model_request"] == [0]
            assert await watchdog.check() is False  # healthy: nothing to do

            # Out of restarts: the next crash is an error that says why.
            os.kill(engine.server_pid, signal.SIGKILL)  # type: ignore[arg-type]
            assert wait_for(lambda: engine.failure() is not None, 15)
            with pytest.raises(EngineError, match="max_engine_restarts=1"):
                await watchdog.check()


def test_stop_during_startup_leaves_no_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = small_engine(tiny_model_dir, tmp_path)
    engine.start()
    # Wait until vLLM's engine core exists (three processes or more), mid-startup.
    assert wait_for(lambda: len(engine_family(engine)) >= 3, 60, step=0.2)
    family = engine_family(engine)
    pgid = engine.pid
    start = time.monotonic()
    engine.stop()
    print(f"\nstop() mid-startup took {time.monotonic() - start:.1f} s for {len(family)} processes")
    assert not engine.is_alive()
    assert not alive(family)
    assert not group_members(pgid)  # type: ignore[arg-type]  (zombies awaiting init do not count)
    engine.stop()


def test_parent_death_takes_vllm_down(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A trainer killed with SIGKILL must not leave vLLM running (and holding memory)."""
    script = textwrap.dedent(f"""
        import sys, time
        from rollover.engine.vllm_engine import VLLMEngine
        from rollover.processes import descendant_pids
        e = VLLMEngine({str(tiny_model_dir)!r}, log_path={str(tmp_path / "child.log")!r},
                       max_model_len=256, enforce_eager=True)
        e.start()
        while len(descendant_pids(e.pid)) < 2:
            time.sleep(0.2)
        print(e.pid, flush=True)
        time.sleep(600)
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), HF_HUB_OFFLINE="1")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        supervisor = int(parent.stdout.readline())  # type: ignore[union-attr]
        family = descendant_pids(supervisor) | {supervisor}
        assert len(family) >= 3
    finally:
        parent.kill()
        parent.wait()
    assert wait_for(lambda: not alive(family), 30), f"orphans left: {alive(family)}"


def test_command_line_and_environment(tmp_path: Path) -> None:
    cpu = VLLMEngine(tmp_path, port=1234, log_path=tmp_path / "a.log", kv_cache_space_gb=2, unix_socket=False)
    argv = cpu.command()
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "1234" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--served-model-name") + 1] == "policy"
    assert "--enable-sleep-mode" not in argv and "--worker-extension-cls" in argv
    # μ on the trainer's basis: logprobs after temperature, the distribution sampled from
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    env = cpu._env()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"  # the worker in the engine core
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"  # CPU threads sleep at barriers, shared cores
    with pytest.MonkeyPatch.context() as patch:  # the user's own setting wins
        patch.setenv("OMP_WAIT_POLICY", "ACTIVE")
        assert cpu._env()["OMP_WAIT_POLICY"] == "ACTIVE"
    gpu = VLLMEngine(
        tmp_path,
        device="cuda",
        gpu_memory_utilization=0.4,
        log_path=tmp_path / "b.log",
        extra_args=["--seed", "3"],
        logprobs_mode="processed_logprobs",
    )
    argv = gpu.command()
    assert "--enable-sleep-mode" in argv and argv[-2:] == ["--seed", "3"]
    assert "--distributed-executor-backend" not in argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in gpu._env()
    assert gpu._env().get("OMP_WAIT_POLICY") == os.environ.get("OMP_WAIT_POLICY")  # a GPU engine's as given
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.4"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    # On TCP (another node's engine) port=0 picks a free one; on a socket it is not used.
    assert VLLMEngine(tmp_path, log_path=tmp_path / "c.log", unix_socket=False).port > 0
    on_socket = VLLMEngine(tmp_path, log_path=tmp_path / "d.log")
    assert on_socket.socket_path is not None and "--port" not in on_socket.command()
    assert on_socket.command()[on_socket.command().index("--uds") + 1] == str(on_socket.socket_path)


async def test_sleep_needs_sleep_mode(tmp_path: Path) -> None:
    from rollover.engine.server import EngineError

    engine = VLLMEngine(tmp_path, log_path=tmp_path / "a.log")
    with pytest.raises(EngineError, match="sleep mode"):
        await engine.sleep(1)
    with pytest.raises(EngineError, match="not running"):
        await engine.reset_prefix_cache()
