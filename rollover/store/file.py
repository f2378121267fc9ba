"""The SQLite file under the rollout store: its schema, how connections are opened, the
record of a write waiting for its group commit, and the thread that checkpoints the WAL.
`rollover.store.sqlite` builds the store on these."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id TEXT NOT NULL UNIQUE,
    input TEXT NOT NULL,
    is_train INTEGER NOT NULL,
    config TEXT NOT NULL,
    metadata TEXT NOT NULL,
    state TEXT NOT NULL,
    k8s_job_name TEXT,
    last_attempt_id TEXT,
    error_message TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS rollouts_state ON rollouts(state, seq);
CREATE TABLE IF NOT EXISTS attempts (
    rollout_id TEXT NOT NULL,
    attempt_id TEXT NOT NULL,
    state TEXT NOT NULL,
    started_at REAL NOT NULL,
    finished_at REAL,
    error_message TEXT,
    PRIMARY KEY (rollout_id, attempt_id)
);
CREATE TABLE IF NOT EXISTS events (
    event_id INTEGER PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    attempt_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    data TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS events_rollout ON events(rollout_id, event_id);
CREATE TABLE IF NOT EXISTS calls (
    call_id TEXT PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    attempt_id TEXT NOT NULL,
    event_id INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS calls_rollout ON calls(rollout_id, attempt_id, event_id);
CREATE TABLE IF NOT EXISTS gateway_state (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    updated_at REAL NOT NULL
);
"""

MAX_GROUP = 512  # writes committed together at most (bounds one transaction's time)
CHECKPOINT_EVERY_COMMITS = 200  # ...or every second, whichever comes first
CHECKPOINT_EVERY_SECONDS = 1.0


@dataclass
class PendingWrite(Generic[T]):
    """One write waiting for the next group commit, and where its result goes."""

    fn: Callable[[sqlite3.Connection], T]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[T]
    outcome: tuple[bool, Any] = (False, None)

    def settle(self, current: asyncio.AbstractEventLoop | None) -> None:
        if self.loop is current:
            self._deliver()
            return
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # that loop is closed: nobody is waiting any more
            pass

    def _deliver(self) -> None:
        if self.future.done():  # the caller was cancelled; the write still happened
            return
        ok, value = self.outcome
        if ok:
            self.future.set_result(value)
        else:
            self.future.set_exception(value)


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def connect(path: str, synchronous: str, *, uri: bool = False) -> sqlite3.Connection:
    conn = sqlite3.connect(path, uri=uri, check_same_thread=False, isolation_level=None)
    conn.row_factory = sqlite3.Row
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


class Checkpointer:
    """Copies the WAL into the database file on a thread of its own, so the fsyncs this takes
    never stall the event loop (the writer's automatic checkpoints are off)."""

    def __init__(self, path: str, synchronous: str) -> None:
        self._conn = connect(path, synchronous)
        self._wake = threading.Event()
        self._stopping = False
        self.commits = 0  # counted by the writer
        self._thread = threading.Thread(target=self._run, name="rollover-store-checkpoint", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        self.commits += 1
        if self.commits % CHECKPOINT_EVERY_COMMITS == 0:
            self._wake.set()

    def _run(self) -> None:
        done = 0
        while not self._stopping:
            self._wake.wait(CHECKPOINT_EVERY_SECONDS)
            self._wake.clear()
            if self.commits != done:
                done = self.commits
                try:
                    self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error:  # busy or failing: the next round tries again
                    pass

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self._conn.close()
