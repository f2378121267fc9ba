"""The ScienceWorld example's JVM pool: one episode per JVM at a time, fresh state per lease,
leases that end with their agent, a fallback when a pooled JVM is gone."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.sw.jvm_pool import POOL_ENV, JVMPool, leased_world, world_for_episode
from examples.sw.task import REUSED_JVM_OPTIONS, play
from tests.examples.test_sw import live_processes

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TASK = {"task_name": "find-non-living-thing", "variation": 0}
ACTIONS = ["teleport to kitchen", "look around", "focus on table"]


def scripted(actions: list[str]):
    remaining = iter(actions)
    return lambda _text: next(remaining, None)


def is_free(folder: Path, slot: int = 0) -> bool:
    fd = os.open(folder / f"slot-{slot}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.fixture
def pool(tmp_path: Path):
    pool = JVMPool(tmp_path / "jvms", size=1).start()
    try:
        yield pool
    finally:
        pool.close()


def test_a_pooled_jvm_plays_one_episode_at_a_time_each_from_a_fresh_start(pool: JVMPool) -> None:
    (jvm,) = pool.processes
    scores = []
    for _ in range(2):
        with leased_world(pool.folder, step_limit=10) as world:
            assert world.process is None  # not a JVM of its own
            assert not is_free(pool.folder)  # leased: no other agent gets this JVM now
            scores.append(play(world, TASK, scripted(ACTIONS), max_steps=10).score)
        assert is_free(pool.folder)
    assert scores[0] == scores[1] and 0 < scores[0] < 100  # the second episode started afresh
    assert jvm.poll() is None and jvm.pid in live_processes()  # the same JVM served both


def test_a_lease_ends_when_its_agent_is_killed(pool: JVMPool) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from examples.sw.jvm_pool import leased_world\n"
            "with leased_world(Path(sys.argv[1]), 10):\n    print('leased', flush=True); time.sleep(600)",
            str(pool.folder),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "leased"
        assert not is_free(pool.folder)
        holder.kill()
        holder.wait(timeout=30)
    finally:
        holder.kill()
    assert is_free(pool.folder)  # the kernel dropped the dead agent's lock
    with leased_world(pool.folder, step_limit=10) as world:  # and the JVM still serves
        assert play(world, TASK, scripted(ACTIONS), max_steps=10).score > 0


def test_an_agent_whose_pooled_jvm_died_plays_in_a_jvm_of_its_own(pool: JVMPool) -> None:
    pool.processes[0].kill()
    pool.processes[0].wait(timeout=30)
    with leased_world(pool.folder, step_limit=10) as world:
        assert world.process is not None
        own = world.pid
        assert play(world, TASK, scripted(ACTIONS), max_steps=10).score > 0
    assert own not in live_processes()  # its own JVM ends with the episode, as without a pool
    assert is_free(pool.folder)


def test_close_stops_the_jvms_and_removes_the_folder(tmp_path: Path) -> None:
    pool = JVMPool(tmp_path / "jvms", size=2).start()
    pids = [p.pid for p in pool.processes]
    assert len(list(pool.folder.glob("slot-*.port"))) == 2 and set(pids) <= live_processes()
    pool.close()
    deadline = time.monotonic() + 30
    while set(pids) & live_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(pids) & live_processes() and not pool.folder.exists()


def test_without_a_pool_an_episode_gets_a_jvm_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(POOL_ENV, raising=False)
    with world_for_episode(step_limit=10) as world:
        pid = world.pid
        assert pid in live_processes()
    assert pid not in live_processes()


def test_a_pool_needs_a_jvm(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one JVM"):
        JVMPool(tmp_path, size=0)


def java_tool_options(pid: int) -> str | None:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [v for v in environ if v.startswith(b"JAVA_TOOL_OPTIONS=")]
    return found[0].split(b"=", 1)[1].decode() if found else None


def test_the_pools_jvm_options_give_way_to_the_users_java_tool_options(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("JAVA_TOOL_OPTIONS", raising=False)
    pool = JVMPool(tmp_path / "default", size=1).start()
    try:
        assert java_tool_options(pool.processes[0].pid) == REUSED_JVM_OPTIONS
    finally:
        pool.close()
    assert "JAVA_TOOL_OPTIONS" not in os.environ  # set only while the JVM was launched
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-Xmx600m")
    pool = JVMPool(tmp_path / "users", size=1).start()
    try:
        assert java_tool_options(pool.processes[0].pid) == "-Xmx600m"
    finally:
        pool.close()


def test_a_pool_that_cannot_start_all_its_jvms_stops_those_it_started(tmp_path, monkeypatch) -> None:
    import py4j.java_gateway

    launched: list[subprocess.Popen] = []
    real_launch = py4j.java_gateway.launch_gateway

    def launch_once(**kwargs):
        if launched:
            raise OSError("no more JVMs")
        port, process = real_launch(**kwargs)
        launched.append(process)
        return port, process

    monkeypatch.setattr(py4j.java_gateway, "launch_gateway", launch_once)
    with pytest.raises(OSError, match="no more JVMs"):
        JVMPool(tmp_path / "jvms", size=2).start()
    [first] = launched
    assert first.poll() is not None  # stopped, not left running until this process exits
    assert not (tmp_path / "jvms").exists()


def test_a_pool_size_that_is_not_a_number_is_refused_naming_the_variable(monkeypatch) -> None:
    from examples.sw.prepare import _pool_size

    monkeypatch.setenv("ROLLOVER_SW_JVMS", "two")
    with pytest.raises(ValueError, match="ROLLOVER_SW_JVMS must be a number of JVMs.*'two'"):
        _pool_size(4)
    monkeypatch.setenv("ROLLOVER_SW_JVMS", "0")
    assert _pool_size(4) == 0
    monkeypatch.delenv("ROLLOVER_SW_JVMS")
    assert _pool_size(4) == 4
