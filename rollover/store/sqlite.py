"""The durable rollout store: rollouts, attempts and events in one SQLite file (WAL).

Every write commits before the call returns, so whatever the gateway acknowledged survives
a SIGKILL of the process (WAL with synchronous=NORMAL is durable against process crashes;
use `synchronous="FULL"` to survive power loss too). All access goes through one worker
thread, which serialises writers without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from rollover.store.models import (
    LEGAL_TRANSITIONS,
    Attempt,
    Event,
    EventCreate,
    Rollout,
    RolloutConfig,
    RolloutCreate,
    RolloutState,
    RolloutStatus,
    StatusFields,
    Triplet,
    TripletBundle,
)

T = TypeVar("T")

_SCHEMA = """
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
    event_id INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id TEXT NOT NULL,
    attempt_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    data TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS events_rollout ON events(rollout_id, event_id);
"""


class StoreError(Exception):
    status_code = 400


class RolloutNotFound(StoreError):
    status_code = 404


class AttemptNotFound(StoreError):
    status_code = 404


class IllegalTransition(StoreError):
    status_code = 409


class RolloutStore:
    """SQLite-backed store; `path=":memory:"` keeps everything in memory (tests, demos).

    `read_only=True` opens an existing file with SQLite's `mode=ro` (the run viewer): no schema
    or journal-mode writes, and any write raises. A WAL reader never blocks the writer.
    """

    def __init__(self, path: str | Path = ":memory:", *, synchronous: str = "NORMAL", read_only: bool = False) -> None:
        self.path = str(path)
        self.read_only = read_only
        if read_only and (self.path == ":memory:" or not Path(self.path).is_file()):
            raise StoreError(f"read-only store {self.path} does not exist")
        if self.path != ":memory:" and not read_only:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollover-store")
        connect = self._connect_read_only if read_only else self._connect
        self._conn = self._executor.submit(connect, synchronous).result()

    def _connect_read_only(self, synchronous: str) -> sqlite3.Connection:
        uri = f"file:{urllib.parse.quote(str(Path(self.path).resolve()))}?mode=ro"
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA busy_timeout=5000")
        return conn

    def _connect(self, synchronous: str) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        conn.row_factory = sqlite3.Row
        if self.path != ":memory:":
            conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute("PRAGMA busy_timeout=5000")
        conn.executescript(_SCHEMA)
        return conn

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _transaction(self, fn: Callable[[sqlite3.Connection], T]) -> Callable[[], T]:
        def run() -> T:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            return result

        return run

    def close(self) -> None:
        try:
            self._executor.submit(self._conn.close).result()
        finally:
            self._executor.shutdown(wait=True)

    # -- rollouts -------------------------------------------------------------------------

    async def add_rollouts(self, items: Iterable[RolloutCreate]) -> list[Rollout]:
        items = list(items)

        def add(conn: sqlite3.Connection) -> list[Rollout]:
            now = time.time()
            ids = []
            for item in items:
                rollout_id = item.rollout_id or f"r-{uuid.uuid4().hex}"
                # A caller-chosen id makes the POST idempotent: an existing rollout is kept as is.
                conn.execute(
                    "INSERT OR IGNORE INTO rollouts (rollout_id, input, is_train, config, metadata,"
                    " state, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        rollout_id,
                        json.dumps(item.input),
                        int(item.is_train),
                        item.config.model_dump_json(),
                        json.dumps(item.metadata),
                        RolloutState.QUEUING.value,
                        now,
                        now,
                    ),
                )
                ids.append(rollout_id)
            return [self._load(conn, rollout_id) for rollout_id in ids]

        return await self._run(self._transaction(add))

    async def get_rollout(self, rollout_id: str) -> Rollout:
        return await self._run(lambda: self._load(self._conn, rollout_id))

    async def list_rollouts(
        self,
        state_in: Iterable[RolloutState] | None = None,
        rollout_ids: Iterable[str] | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        clauses: list[str] = []
        params: list[Any] = []
        if state_in:
            states = [RolloutState(s).value for s in state_in]
            clauses.append(f"state IN ({','.join('?' * len(states))})")
            params += states
        if rollout_ids is not None:
            ids = list(rollout_ids)
            if not ids:
                return []
            clauses.append(f"rollout_id IN ({','.join('?' * len(ids))})")
            params += ids
        sql = "SELECT * FROM rollouts"
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        sql += " ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)

        def query() -> list[Rollout]:
            rows = self._conn.execute(sql, params).fetchall()
            attempts = self._attempts_of(self._conn, [row["rollout_id"] for row in rows])
            return [self._from_row(row, attempts.get(row["rollout_id"], [])) for row in rows]

        return await self._run(query)

    async def update_status(self, rollout_id: str, fields: StatusFields) -> Rollout:
        def update(conn: sqlite3.Connection) -> Rollout:
            current = self._load(conn, rollout_id)
            now = time.time()
            changes: dict[str, Any] = {"updated_at": now}
            given = fields.model_fields_set
            for name in ("k8s_job_name", "error_message"):
                if name in given:
                    changes[name] = getattr(fields, name)
            if current.state.terminal and current.status.error_message is not None:
                # The first failure reason is the real one: a later FAILED -> FAILED (a
                # controller's timeout sweep, a cleanup) must not bury it.
                changes.pop("error_message", None)
            target = fields.state
            if target is not None and target != current.state:
                if target not in LEGAL_TRANSITIONS[current.state]:
                    raise IllegalTransition(
                        f"rollout {rollout_id} cannot go from {current.state.value} to {target.value}"
                    )
                changes["state"] = target.value
                attempt_id = current.status.last_attempt_id
                if target == RolloutState.RUNNING:
                    attempt_id = fields.last_attempt_id or f"a{len(current.attempts) + 1}"
                    if any(a.attempt_id == attempt_id for a in current.attempts):
                        raise IllegalTransition(f"attempt {attempt_id} of rollout {rollout_id} already exists")
                    conn.execute(
                        "INSERT INTO attempts (rollout_id, attempt_id, state, started_at) VALUES (?, ?, ?, ?)",
                        (rollout_id, attempt_id, RolloutState.RUNNING.value, now),
                    )
                    changes.update(last_attempt_id=attempt_id, started_at=now)
                    if "error_message" not in given:
                        changes["error_message"] = None
                elif current.state == RolloutState.RUNNING and attempt_id is not None:
                    # The running attempt ends with the rollout's move (to a result or a re-queue).
                    attempt_state = RolloutState.FAILED if target == RolloutState.QUEUING else target
                    conn.execute(
                        "UPDATE attempts SET state=?, finished_at=?, error_message=?"
                        " WHERE rollout_id=? AND attempt_id=?",
                        (attempt_state.value, now, fields.error_message, rollout_id, attempt_id),
                    )
                if target.terminal:
                    changes["finished_at"] = now
            elif "last_attempt_id" in given and fields.last_attempt_id != current.status.last_attempt_id:
                raise IllegalTransition("last_attempt_id changes only when the rollout starts running")
            assignments = ", ".join(f"{name}=?" for name in changes)
            conn.execute(
                f"UPDATE rollouts SET {assignments} WHERE rollout_id=?",
                (*changes.values(), rollout_id),
            )
            return self._load(conn, rollout_id)

        return await self._run(self._transaction(update))

    async def delete_rollout(self, rollout_id: str) -> None:
        def delete(conn: sqlite3.Connection) -> None:
            self._load(conn, rollout_id)
            for table in ("events", "attempts", "rollouts"):
                conn.execute(f"DELETE FROM {table} WHERE rollout_id=?", (rollout_id,))

        await self._run(self._transaction(delete))

    # -- events ---------------------------------------------------------------------------

    async def add_event(self, rollout_id: str, attempt_id: str, event: EventCreate) -> Event:
        def add(conn: sqlite3.Connection) -> Event:
            self._load(conn, rollout_id)
            known = conn.execute(
                "SELECT 1 FROM attempts WHERE rollout_id=? AND attempt_id=?", (rollout_id, attempt_id)
            ).fetchone()
            if known is None:
                raise AttemptNotFound(f"rollout {rollout_id} has no attempt {attempt_id}")
            now = time.time()
            cursor = conn.execute(
                "INSERT INTO events (rollout_id, attempt_id, event_type, data, created_at) VALUES (?, ?, ?, ?, ?)",
                (rollout_id, attempt_id, event.event_type, json.dumps(event.data), now),
            )
            assert cursor.lastrowid is not None  # set by every INSERT
            return Event(
                event_id=cursor.lastrowid,
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                event_type=event.event_type,
                data=event.data,
                created_at=now,
            )

        return await self._run(self._transaction(add))

    async def list_events(
        self, rollout_id: str, event_type: str | None = None, attempt_id: str | None = None
    ) -> list[Event]:
        def query() -> list[Event]:
            self._load(self._conn, rollout_id)
            sql, params = "SELECT * FROM events WHERE rollout_id=?", [rollout_id]
            if event_type:
                sql += " AND event_type=?"
                params.append(event_type)
            if attempt_id:
                sql += " AND attempt_id=?"
                params.append(attempt_id)
            rows = self._conn.execute(sql + " ORDER BY event_id", params).fetchall()
            return [
                Event(
                    event_id=row["event_id"],
                    rollout_id=row["rollout_id"],
                    attempt_id=row["attempt_id"],
                    event_type=row["event_type"],
                    data=json.loads(row["data"]),
                    created_at=row["created_at"],
                )
                for row in rows
            ]

        return await self._run(query)

    async def triplets(self, rollout_id: str, attempt_id: str | None = None) -> TripletBundle:
        """Per model call: token ids, logprobs and policy version, plus the attempt's reward."""
        rollout = await self.get_rollout(rollout_id)
        attempt_id = attempt_id or rollout.status.last_attempt_id
        if attempt_id is None:
            return TripletBundle(rollout_id=rollout_id, attempt_id=None, reward=None, triplets=[])
        events = await self.list_events(rollout_id, attempt_id=attempt_id)
        reward: float | None = None
        triplets = []
        for event in events:
            data = event.data if isinstance(event.data, dict) else {}
            if event.event_type == "reward":
                reward = _reward_value(data, reward)
            elif event.event_type == "model_request" and data.get("response_token_ids") is not None:
                triplets.append(
                    Triplet(
                        event_id=event.event_id,
                        prompt_token_ids=data.get("prompt_token_ids") or [],
                        response_token_ids=data["response_token_ids"],
                        response_logprobs=data.get("response_logprobs"),
                        policy_version=data.get("policy_version"),
                    )
                )
        return TripletBundle(rollout_id=rollout_id, attempt_id=attempt_id, reward=reward, triplets=triplets)

    async def rewards(self, rollout_ids: Iterable[str]) -> dict[str, float | None]:
        """The reward of each rollout's last attempt, as `triplets` reads it (last one wins),
        in one query per 500 rollouts rather than one per rollout."""
        ids = list(rollout_ids)

        def query() -> dict[str, float | None]:
            found: dict[str, float | None] = dict.fromkeys(ids)
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                rows = self._conn.execute(
                    "SELECT e.rollout_id, e.data FROM events e JOIN rollouts r ON r.rollout_id = e.rollout_id"
                    " AND r.last_attempt_id = e.attempt_id WHERE e.event_type = 'reward'"
                    f" AND e.rollout_id IN ({','.join('?' * len(chunk))}) ORDER BY e.event_id",
                    chunk,
                ).fetchall()
                for row in rows:
                    data = json.loads(row["data"])
                    found[row["rollout_id"]] = _reward_value(
                        data if isinstance(data, dict) else {}, found[row["rollout_id"]]
                    )
            return found

        return await self._run(query)

    # -- rows -----------------------------------------------------------------------------

    def _load(self, conn: sqlite3.Connection, rollout_id: str) -> Rollout:
        row = conn.execute("SELECT * FROM rollouts WHERE rollout_id=?", (rollout_id,)).fetchone()
        if row is None:
            raise RolloutNotFound(f"rollout {rollout_id} not found")
        return self._from_row(row, self._attempts_of(conn, [rollout_id]).get(rollout_id, []))

    @staticmethod
    def _attempts_of(conn: sqlite3.Connection, rollout_ids: list[str]) -> dict[str, list[Attempt]]:
        found: dict[str, list[Attempt]] = {}
        # Chunked because SQLite caps the number of bound parameters per statement.
        for start in range(0, len(rollout_ids), 500):
            chunk = rollout_ids[start : start + 500]
            rows = conn.execute(
                f"SELECT * FROM attempts WHERE rollout_id IN ({','.join('?' * len(chunk))}) ORDER BY started_at",
                chunk,
            ).fetchall()
            for row in rows:
                found.setdefault(row["rollout_id"], []).append(
                    Attempt(
                        attempt_id=row["attempt_id"],
                        state=row["state"],
                        started_at=row["started_at"],
                        finished_at=row["finished_at"],
                        error_message=row["error_message"],
                    )
                )
        return found

    @staticmethod
    def _from_row(row: sqlite3.Row, attempts: list[Attempt]) -> Rollout:
        return Rollout(
            rollout_id=row["rollout_id"],
            input=json.loads(row["input"]),
            is_train=bool(row["is_train"]),
            config=RolloutConfig.model_validate_json(row["config"]),
            metadata=json.loads(row["metadata"]),
            status=RolloutStatus(
                state=row["state"],
                k8s_job_name=row["k8s_job_name"],
                last_attempt_id=row["last_attempt_id"],
                error_message=row["error_message"],
                created_at=row["created_at"],
                updated_at=row["updated_at"],
            ),
            attempts=attempts,
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
        )


def _reward_value(data: dict[str, Any], previous: float | None) -> float | None:
    """A reward event's value; a malformed one leaves the previous reward in place."""
    value = data.get("value")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return previous
