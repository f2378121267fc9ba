"""Long-lived ScienceWorld JVMs shared by a run's agents, one episode at a time each.

A JVM of its own costs an agent about 1.1 s to start and then runs its episode at the client
compiler's speed (about 1.5 s of JVM time here); a JVM that has played a few episodes with the
optimising compiler plays one in about 0.4 s. With hundreds of short episodes per run on two
cores, that difference is minutes. So the setup hook starts `size` JVMs for the run
(`JVMPool`), and each agent leases one for its episode (`leased_world`):

    <folder>/slot-<i>.port   the port of JVM i's py4j gateway (written once it listens)
    <folder>/slot-<i>.lock   leased while an agent holds an exclusive flock on it

The lease ends when the agent closes the file, also when it dies (the kernel drops the lock),
so a crashed agent never keeps a JVM. Each lease makes a fresh simulator object in its JVM, so
no state carries over from the last episode but compiled code. The JVMs end with the process
that started the pool (py4j's die-on-exit: each watches its stdin pipe), or on `close()`.
A slot whose JVM no longer answers is skipped: the agent starts a JVM of its own instead.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from examples.sw.task import REUSED_JVM_OPTIONS, ScienceWorld, jvm_options_unless_set

POOL_ENV = "ROLLOVER_SW_JVM_POOL"  # the pool's folder, in the environment of every agent
LEASE_POLL_SECONDS = 0.05


class JVMPool:
    """`size` ScienceWorld JVMs, each announced in `folder` (the pool's own) once it listens."""

    def __init__(self, folder: Path, size: int) -> None:
        if size < 1:
            raise ValueError(f"a JVM pool needs at least one JVM, got size={size}")
        self.folder = folder
        self.size = size
        self.processes: list[subprocess.Popen] = []

    def start(self) -> JVMPool:
        from py4j.java_gateway import launch_gateway
        from scienceworld.constants import BASEPATH, JAR_PATH

        self.folder.mkdir(parents=True, exist_ok=True)
        for path in self.folder.glob("slot-*"):
            path.unlink()
        try:
            for index in range(self.size):
                with jvm_options_unless_set(REUSED_JVM_OPTIONS):
                    port, process = launch_gateway(classpath=JAR_PATH, die_on_exit=True, cwd=BASEPATH, return_proc=True)
                self.processes.append(process)
                (self.folder / f"slot-{index}.lock").touch()
                staging = self.folder / f"slot-{index}.port.partial"
                staging.write_text(str(port))
                staging.rename(self.folder / f"slot-{index}.port")  # a reader never sees half a port
        except BaseException:
            self.close()  # the JVMs already started would otherwise live until this process ends
            raise
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stops the JVMs and removes the folder (the pool's own)."""
        for process in self.processes:
            if process.poll() is None and process.stdin is not None:
                process.stdin.close()  # die-on-exit: the JVM stops when its stdin ends
        for process in self.processes:
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout)
        self.processes.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


def _lease(folder: Path) -> tuple[int, int]:
    """(open lock file, port) of a free slot; waits until one is free."""
    slots = sorted(folder.glob("slot-*.port"))
    if not slots:
        raise RuntimeError(f"no JVM slots in {folder} (is the pool started?)")
    while True:
        random.shuffle(slots)  # agents starting together try different slots first
        for port_file in slots:
            fd = os.open(port_file.with_suffix(".lock"), os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return fd, int(port_file.read_text())
        time.sleep(LEASE_POLL_SECONDS)


@contextmanager
def leased_world(folder: Path, step_limit: int) -> Iterator[ScienceWorld]:
    """A simulator in one of the pool's JVMs, held for the `with` block; a JVM of the
    agent's own if the leased one does not answer."""
    fd, port = _lease(folder)
    try:
        try:
            world = ScienceWorld.attach(port, step_limit)
        except Exception as exc:  # the JVM died; this episode still gets played
            print(f"JVM pool slot on port {port} does not answer ({exc!r}); starting a JVM of its own", flush=True)
            world = ScienceWorld(step_limit)
        with world:
            yield world
    finally:
        os.close(fd)


@contextmanager
def world_for_episode(step_limit: int) -> Iterator[ScienceWorld]:
    """A leased simulator when the run has a pool (`ROLLOVER_SW_JVM_POOL`), else one in a JVM of its own."""
    folder = os.environ.get(POOL_ENV)
    if folder:
        with leased_world(Path(folder), step_limit) as world:
            yield world
    else:
        with ScienceWorld(step_limit) as world:
            yield world
