"""Agents the controller tests run as real processes (`tests.controller.agents:Name`)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx


def post_event(event_type: str, data: Any) -> None:
    response = httpx.post(
        os.environ["AGL_EVENT_URL"],
        json={"event_type": event_type, "data": data},
        headers={"Authorization": f"Bearer {os.environ['AGL_KEY']}"},
        timeout=10,
    )
    response.raise_for_status()


def write_pids(path: str, pids: list[int]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        handle.write(" ".join(map(str, pids)))
    os.replace(tmp, path)


class RewardAgent:
    """Reports `input.reward` (default 1.0), after `input.sleep` seconds if given."""

    def run(self, input: dict[str, Any]) -> None:
        time.sleep(float(input.get("sleep", 0)))
        post_event("reward", {"value": float(input.get("reward", 1.0))})


class AsyncRewardAgent:
    async def run(self) -> None:
        await asyncio.sleep(0)
        await asyncio.to_thread(post_event, "reward", {"value": 0.5})


class FailingAgent:
    def run(self) -> None:
        for line in range(30):
            print(f"log line {line}")
        print("about to fail", file=sys.stderr)
        sys.exit(3)


class SelfKillAgent:
    def run(self) -> None:
        print("going down")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class SleepAgent:
    """Sleeps for `input.seconds`, with a grandchild in its process group; writes both pids."""

    def run(self, input: dict[str, Any]) -> None:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        write_pids(input["pid_file"], [os.getpid(), child.pid])
        time.sleep(float(input.get("seconds", 120)))
        child.kill()


class GatedAgent:
    """Writes `input.started`, waits until `input.go` exists, then reports a reward of 1."""

    def run(self, input: dict[str, Any]) -> None:
        write_pids(input["started"], [os.getpid()])
        deadline = time.monotonic() + 120
        while not os.path.exists(input["go"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        post_event("reward", {"value": 1.0})


class FlakyAgent:
    """Attempt a1 records an event and fails; later attempts report a reward."""

    def run(self) -> None:
        attempt = os.environ["AGL_ATTEMPT_ID"]
        post_event("note", {"attempt": attempt})
        if attempt == "a1":
            sys.exit(1)
        post_event("reward", {"value": 1.0})


class EnvAgent:
    """Records the variables it was given."""

    NAMES = ("AGL_OPENAI_BASE_URL", "AGL_EVENT_URL", "AGL_KEY", "AGL_ROLLOUT_ID", "AGL_ATTEMPT_ID", "AGL_ROLLOUT_INPUT")

    def run(self, input: dict[str, Any]) -> None:
        names = [*self.NAMES, *input.get("extra", [])]
        post_event("env", {name: os.environ.get(name) for name in names} | {"cwd": os.getcwd()})


class NoRun:
    pass


class ThreadedAgent:
    """Reports its reward from a non-daemon thread after run() has returned."""

    def run(self) -> None:
        import threading

        def late() -> None:
            time.sleep(0.3)
            post_event("reward", {"value": 0.25})

        threading.Thread(target=late).start()


class MarkedSleepAgent:
    """Starts a tool whose command line carries `input.marker`, then sleeps until stopped."""

    def run(self, input: dict[str, Any]) -> None:
        subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(300)", input["marker"]])
        time.sleep(300)
