"""The durable rollout store: rollouts, attempts and events in one SQLite file (WAL).

One idea, the rollout state machine and its events over one file: how the file is reached
(group commit, reads on a thread, checkpoints) is `file.py`; rows as wire models `rows.py`.

Every write is committed before its call returns, so whatever the gateway acknowledged
survives a SIGKILL of the process (WAL with synchronous=NORMAL is durable against process
crashes; use `synchronous="FULL"` to survive power loss too). Writes are committed on the
event loop, in groups: all those made while the loop was busy go into one transaction (group
commit), and each caller is answered once that transaction is committed, never before. Reads
go to a thread with a connection of their own; checkpoints to another thread.

The gateway is the file's only writer, so the store keeps each rollout's state and attempt
ids in memory (`snapshot`): the proxy checks a call against them without reading the file.
Every other read goes to the file, which stays a plain WAL database that other processes may
read while the gateway runs.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson

from rollover import codec
from rollover.store.errors import AttemptNotFound, IllegalTransition, InvalidValue, RolloutNotFound
from rollover.store.file import StoredImage, StoreFile, insert_images, select_images
from rollover.store.models import (
    LEGAL_TRANSITIONS,
    Event,
    EventCreate,
    Rollout,
    RolloutConfig,
    RolloutCreate,
    RolloutState,
    StatusFields,
    TerminalRolloutsPage,
    Triplet,
    TripletBundle,
    image_hashes,
    new_rollout_id,
)
from rollover.store.rewards import attribute_rewards
from rollover.store.rows import (
    attempts_of,
    new_rollout,
    new_rollout_json,
    reward_value,
    rollout_from_row,
    terminal_rollout_from_row,
)

T = TypeVar("T")

_INSERT_ROLLOUT = (
    "INSERT INTO rollouts (rollout_id, input, is_train, config, metadata, state, created_at, updated_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
# How a recorded call is written (also by `benchmarks/relay_floor.py`, which records as the gateway).
INSERT_EVENT = (
    "INSERT INTO events (event_id, rollout_id, attempt_id, event_type, data, created_at) VALUES (?, ?, ?, ?, ?, ?)"
)
# The reward events of the rollouts' last attempts that can be their outcome: none of them lies
# between the attempt's first and last recorded call (those are per-turn), read with the
# attempt's calls' span from the small `calls` table (its covering index), not the events.
_OUTCOME_REWARDS = (
    "SELECT e.rollout_id, e.data FROM events e"
    " JOIN rollouts r ON r.rollout_id = e.rollout_id AND r.last_attempt_id = e.attempt_id"
    " LEFT JOIN (SELECT rollout_id, attempt_id, MIN(event_id) AS first_call, MAX(event_id) AS last_call"
    " FROM calls WHERE rollout_id IN ({ids}) GROUP BY rollout_id, attempt_id) c"
    " ON c.rollout_id = e.rollout_id AND c.attempt_id = e.attempt_id"
    " WHERE e.event_type = 'reward' AND e.rollout_id IN ({ids})"
    " AND (c.last_call IS NULL OR e.event_id > c.last_call OR e.event_id < c.first_call)"
    " ORDER BY e.event_id"
)
# A store written before the `calls` table (opened read-only, so never migrated) has no call
# ids: every reward of the last attempt may be its outcome.
_OUTCOME_REWARDS_BEFORE_CALLS = (
    "SELECT e.rollout_id, e.data FROM events e"
    " JOIN rollouts r ON r.rollout_id = e.rollout_id AND r.last_attempt_id = e.attempt_id"
    " WHERE e.event_type = 'reward' AND e.rollout_id IN ({ids})"
    " ORDER BY e.event_id"
)
INSERT_CALL = "INSERT OR REPLACE INTO calls (call_id, rollout_id, attempt_id, event_id) VALUES (?, ?, ?, ?)"
_UPSERT_STATE = (
    "INSERT INTO gateway_state (key, value, updated_at) VALUES (?, ?, ?)"
    " ON CONFLICT(key) DO UPDATE SET value=excluded.value, updated_at=excluded.updated_at"
)
# Event ids are handed out by the store, never reused (a reader may remember the last it saw).
# It keeps the next one in memory instead of SQLite's AUTOINCREMENT, which updates a
# sqlite_sequence row in every commit (measured, SQLite alone: 88 vs 47 us an insert).
# Deleting a rollout saves the next id here, so a restart on a file whose newest events were
# deleted goes on from the same point.
NEXT_EVENT_ID_KEY = "store.next_event_id"
_DEFAULT_CONFIG_JSON = RolloutConfig.model_validate({}).model_dump_json()


@dataclass(frozen=True)
class RolloutSnapshot:
    """What the store keeps in memory of a rollout: enough to check a call or a transition."""

    state: RolloutState
    attempts: tuple[str, ...] = ()  # attempt ids, oldest first
    last_attempt_id: str | None = None


_QUEUED = RolloutSnapshot(RolloutState.QUEUING)  # every new rollout's (immutable: shared)


def _encode(value: Any, what: str) -> str:
    try:
        return codec.dumps_str(value)
    except codec.JSONCodecError as exc:
        raise InvalidValue(f"{what} cannot be stored as JSON: {exc}") from None


class RolloutStore:
    """SQLite-backed store; `path=":memory:"` keeps everything in memory (tests, demos).

    `read_only=True` opens an existing file with SQLite's `mode=ro` (the run viewer): no schema
    or journal-mode writes, and any write raises. A WAL reader never blocks the writer.
    """

    def __init__(self, path: str | Path = ":memory:", *, synchronous: str = "NORMAL", read_only: bool = False) -> None:
        self._file = StoreFile(path, synchronous=synchronous, read_only=read_only, on_rollback=self._reload)
        self.path, self.read_only = self._file.path, read_only
        self._conn = self._file.conn
        self._snapshots = self._load_snapshots(self._conn)
        self._next_event_id = 0 if read_only else self._load_next_event_id(self._conn)

    @staticmethod
    def _load_snapshots(conn: sqlite3.Connection) -> dict[str, RolloutSnapshot]:
        attempts: dict[str, list[str]] = {}
        for rollout_id, attempt_id in conn.execute("SELECT rollout_id, attempt_id FROM attempts ORDER BY started_at"):
            attempts.setdefault(rollout_id, []).append(attempt_id)
        return {
            rollout_id: RolloutSnapshot(RolloutState(state), tuple(attempts.get(rollout_id, ())), last_attempt_id)
            for rollout_id, state, last_attempt_id in conn.execute(
                "SELECT rollout_id, state, last_attempt_id FROM rollouts"
            )
        }

    def _reload(self, conn: sqlite3.Connection) -> None:
        """After a group commit that failed part way: the snapshots as the file has them."""
        self._snapshots = self._load_snapshots(conn)

    @staticmethod
    def _load_next_event_id(conn: sqlite3.Connection) -> int:
        candidates = [conn.execute("SELECT coalesce(max(event_id), 0) + 1 FROM events").fetchone()[0]]
        saved = conn.execute("SELECT value FROM gateway_state WHERE key=?", (NEXT_EVENT_ID_KEY,)).fetchone()
        if saved is not None:
            candidates.append(int(saved[0]))
        # A file made when the table still had AUTOINCREMENT remembers its highest id there.
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name='sqlite_sequence'").fetchone() is not None:
            sequence = conn.execute("SELECT seq FROM sqlite_sequence WHERE name='events'").fetchone()
            if sequence is not None:
                candidates.append(int(sequence[0]) + 1)
        return max(candidates)

    def close(self) -> None:
        """Commits what is pending, then closes the file."""
        self._file.close()

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Runs `fn` in the next group commit and returns once that commit is done."""
        return await self._file.write(fn)

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await self._file.read(fn)

    # -- in memory ------------------------------------------------------------------------

    def snapshot(self, rollout_id: str) -> RolloutSnapshot:
        """The rollout's state and attempt ids as last committed, without touching the file."""
        found = self._snapshots.get(rollout_id)
        if found is None:
            raise RolloutNotFound(f"rollout {rollout_id} not found")
        return found

    # -- the gateway's own state ----------------------------------------------------------

    def gateway_state(self, key: str) -> Any:
        """A value the gateway saved with `save_gateway_state` (None if never saved): read once,
        when a gateway starts on this store, so a restarted gateway resumes where it was."""
        row = self._conn.execute("SELECT value FROM gateway_state WHERE key=?", (key,)).fetchone()
        return None if row is None else codec.loads_lenient(row[0])

    async def save_gateway_state(self, key: str, value: Any) -> None:
        """Commits `value` under `key` (the pause state, the registered models). Writes are
        committed in call order, so the last call's value is what a restart reads."""
        encoded, now = _encode(value, key), time.time()
        await self._write(lambda conn: conn.execute(_UPSERT_STATE, (key, encoded, now)))

    # -- rollouts -------------------------------------------------------------------------

    async def add_rollouts(self, items: Iterable[RolloutCreate]) -> list[Rollout]:
        def built(
            conn: sqlite3.Connection, rollout_id: str, item: RolloutCreate | None, config: str, now: float
        ) -> Rollout:
            return self._load(conn, rollout_id) if item is None else new_rollout(rollout_id, item, now)

        return await self._add_rollouts(items, built)

    async def add_rollouts_json(self, items: Iterable[RolloutCreate]) -> bytes:
        """`add_rollouts`, answered as the JSON list of the rollouts (the POST's body), written
        without a model per new rollout."""

        def built(
            conn: sqlite3.Connection, rollout_id: str, item: RolloutCreate | None, config: str, now: float
        ) -> Any:
            if item is None:
                return orjson.Fragment(self._load(conn, rollout_id).model_dump_json())
            return new_rollout_json(rollout_id, item, config, now)

        return codec.dumps(await self._add_rollouts(items, built))

    async def _add_rollouts(
        self,
        items: Iterable[RolloutCreate],
        built: Callable[[sqlite3.Connection, str, RolloutCreate | None, str, float], T],
    ) -> list[T]:
        """Inserts the new rollouts; each item's rollout as `built` makes it (with None for a
        rollout that was there already), in the order of `items`."""
        now, queuing = time.time(), RolloutState.QUEUING.value
        prepared = []
        for item in items:
            config = item.config.model_dump_json() if item.config.model_fields_set else _DEFAULT_CONFIG_JSON
            row = (
                item.rollout_id or new_rollout_id(),
                _encode(item.input, "input"),
                int(item.is_train),
                config,
                _encode(item.metadata, "metadata"),
                queuing,
                now,
                now,
            )
            prepared.append((item, row))

        def add(conn: sqlite3.Connection) -> list[T]:
            created: dict[str, T] = {}
            rows = []
            for item, row in prepared:
                rollout_id = row[0]
                # A caller-chosen id makes the POST idempotent: an existing rollout is kept as is.
                if rollout_id not in created:
                    if rollout_id in self._snapshots:
                        created[rollout_id] = built(conn, rollout_id, None, row[3], now)
                    else:
                        rows.append(row)
                        created[rollout_id] = built(conn, rollout_id, item, row[3], now)
            conn.executemany(_INSERT_ROLLOUT, rows)
            for row in rows:
                self._snapshots[row[0]] = _QUEUED
            return [created[row[0]] for _, row in prepared]

        return await self._write(add)

    async def get_rollout(self, rollout_id: str) -> Rollout:
        return await self._read(lambda conn: self._load(conn, rollout_id))

    async def terminal_page(self, after: int, limit: int) -> TerminalRolloutsPage:
        """Finished rollouts in the order they finished (then the order they were made),
        `limit` of them from position `after` of that order."""

        def query(conn: sqlite3.Connection) -> TerminalRolloutsPage:
            terminal = "state IN ('succeeded', 'failed')"
            total = conn.execute(f"SELECT COUNT(*) FROM rollouts WHERE {terminal}").fetchone()[0]
            rows = conn.execute(
                f"SELECT rollout_id, state, input, is_train FROM rollouts WHERE {terminal}"
                " ORDER BY finished_at, seq LIMIT ? OFFSET ?",
                (limit, after),
            ).fetchall()
            items = [terminal_rollout_from_row(row) for row in rows]
            return TerminalRolloutsPage(items=items, next_after=after + len(items), total_terminal=total)

        return await self._read(query)

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

        def query(conn: sqlite3.Connection) -> list[Rollout]:
            rows = conn.execute(sql, params).fetchall()
            attempts = attempts_of(conn, [row["rollout_id"] for row in rows])
            return [rollout_from_row(row, attempts.get(row["rollout_id"], [])) for row in rows]

        return await self._read(query)

    async def update_status(self, rollout_id: str, fields: StatusFields) -> Rollout:
        def update(conn: sqlite3.Connection) -> Rollout:
            current = self.snapshot(rollout_id)
            now = time.time()
            changes: dict[str, Any] = {"updated_at": now}
            given = fields.model_fields_set
            for name in ("k8s_job_name", "error_message"):
                if name in given:
                    changes[name] = getattr(fields, name)
            if current.state.terminal and "error_message" in changes and _error_message(conn, rollout_id) is not None:
                # The first failure reason is the real one: a later FAILED -> FAILED (a
                # controller's timeout sweep, a cleanup) must not bury it.
                changes.pop("error_message")
            target = fields.state
            after = current
            if target is not None and target != current.state:
                if target not in LEGAL_TRANSITIONS[current.state]:
                    raise IllegalTransition(
                        f"rollout {rollout_id} cannot go from {current.state.value} to {target.value}"
                    )
                changes["state"] = target.value
                attempt_id = current.last_attempt_id
                if target == RolloutState.RUNNING:
                    attempt_id = fields.last_attempt_id or _default_attempt_id(current.attempts)
                    if attempt_id in current.attempts:
                        raise IllegalTransition(f"attempt {attempt_id} of rollout {rollout_id} already exists")
                    conn.execute(
                        "INSERT INTO attempts (rollout_id, attempt_id, state, started_at) VALUES (?, ?, ?, ?)",
                        (rollout_id, attempt_id, RolloutState.RUNNING.value, now),
                    )
                    changes.update(last_attempt_id=attempt_id, started_at=now)
                    if "error_message" not in given:
                        changes["error_message"] = None
                    after = RolloutSnapshot(target, (*current.attempts, attempt_id), attempt_id)
                else:
                    if current.state == RolloutState.RUNNING and attempt_id is not None:
                        # The running attempt ends with the rollout's move (to a result or a re-queue).
                        attempt_state = RolloutState.FAILED if target == RolloutState.QUEUING else target
                        conn.execute(
                            "UPDATE attempts SET state=?, finished_at=?, error_message=?"
                            " WHERE rollout_id=? AND attempt_id=?",
                            (attempt_state.value, now, fields.error_message, rollout_id, attempt_id),
                        )
                    after = RolloutSnapshot(target, current.attempts, current.last_attempt_id)
                if target.terminal:
                    changes["finished_at"] = now
            elif "last_attempt_id" in given and fields.last_attempt_id != current.last_attempt_id:
                raise IllegalTransition("last_attempt_id changes only when the rollout starts running")
            assignments = ", ".join(f"{name}=?" for name in changes)
            conn.execute(
                f"UPDATE rollouts SET {assignments} WHERE rollout_id=?",
                (*changes.values(), rollout_id),
            )
            rollout = self._load(conn, rollout_id)
            self._snapshots[rollout_id] = after
            return rollout

        return await self._write(update)

    async def delete_rollout(self, rollout_id: str) -> None:
        def delete(conn: sqlite3.Connection) -> None:
            self.snapshot(rollout_id)
            for table in ("calls", "events", "attempts", "rollouts"):
                conn.execute(f"DELETE FROM {table} WHERE rollout_id=?", (rollout_id,))
            conn.execute(_UPSERT_STATE, (NEXT_EVENT_ID_KEY, str(self._next_event_id), time.time()))
            del self._snapshots[rollout_id]

        await self._write(delete)

    # -- events ---------------------------------------------------------------------------

    async def add_event(self, rollout_id: str, attempt_id: str, event: EventCreate) -> Event:
        event_id, created_at = await self.record_event(rollout_id, attempt_id, event.event_type, event.data)
        return Event.model_validate(
            {
                "event_id": event_id,
                "rollout_id": rollout_id,
                "attempt_id": attempt_id,
                "event_type": event.event_type,
                "data": event.data,
                "created_at": created_at,
            }
        )

    async def record_event(
        self, rollout_id: str, attempt_id: str, event_type: str, data: Any, images: list[StoredImage] | None = None
    ) -> tuple[int, float]:
        """`add_event` without the wire models (the proxy's path): the event id and time.
        `images` (a recorded call's) are stored in the same commit, once per content hash."""
        encoded = _encode(data, "data")
        now = time.time()
        call_id = data.get("call_id") if event_type == "model_request" and isinstance(data, dict) else None
        if not isinstance(call_id, str):
            call_id = None

        def add(conn: sqlite3.Connection) -> int:
            rollout = self.snapshot(rollout_id)
            if rollout.state.terminal:
                raise IllegalTransition(
                    f"rollout {rollout_id} is already {rollout.state.value}: it takes no more events"
                )
            if attempt_id not in rollout.attempts:
                raise AttemptNotFound(f"rollout {rollout_id} has no attempt {attempt_id}")
            event_id = self._next_event_id
            if images:
                insert_images(conn, images, now)
            conn.execute(INSERT_EVENT, (event_id, rollout_id, attempt_id, event_type, encoded, now))
            if call_id is not None:  # a recorded call a reward may name
                conn.execute(INSERT_CALL, (call_id, rollout_id, attempt_id, event_id))
            self._next_event_id += 1  # after the INSERTs: a refused one takes no id
            return event_id

        return await self._write(add), now

    async def call_owner(self, call_id: str) -> tuple[str, str] | None:
        """The rollout and attempt whose recorded call `call_id` is (None: no such call)."""

        def query(conn: sqlite3.Connection) -> tuple[str, str] | None:
            row = conn.execute("SELECT rollout_id, attempt_id FROM calls WHERE call_id=?", (call_id,)).fetchone()
            return None if row is None else (row["rollout_id"], row["attempt_id"])

        return await self._read(query)

    async def images(self, hashes: list[str]) -> dict[str, tuple[str, bytes]]:
        """Stored images by content hash: media type and bytes (unknown hashes are left out)."""
        return await self._read(lambda conn: select_images(conn, hashes))

    async def list_events(
        self, rollout_id: str, event_type: str | None = None, attempt_id: str | None = None
    ) -> list[Event]:
        return await self._read(lambda conn: self._events(conn, rollout_id, event_type, attempt_id))

    def _events(
        self, conn: sqlite3.Connection, rollout_id: str, event_type: str | None, attempt_id: str | None
    ) -> list[Event]:
        if conn.execute("SELECT 1 FROM rollouts WHERE rollout_id=?", (rollout_id,)).fetchone() is None:
            raise RolloutNotFound(f"rollout {rollout_id} not found")
        sql, params = "SELECT * FROM events WHERE rollout_id=?", [rollout_id]
        if event_type:
            sql += " AND event_type=?"
            params.append(event_type)
        if attempt_id:
            sql += " AND attempt_id=?"
            params.append(attempt_id)
        return [
            Event.model_validate(
                {
                    "event_id": row["event_id"],
                    "rollout_id": row["rollout_id"],
                    "attempt_id": row["attempt_id"],
                    "event_type": row["event_type"],
                    "data": codec.loads_lenient(row["data"]),
                    "created_at": row["created_at"],
                }
            )
            for row in conn.execute(sql + " ORDER BY event_id", params)
        ]

    async def triplets(self, rollout_id: str, attempt_id: str | None = None) -> TripletBundle:
        """Per model call: token ids, logprobs, policy version (and policy, when the run has
        several), plus the attempt's reward."""

        def query(conn: sqlite3.Connection) -> tuple[str | None, list[Event]]:
            row = conn.execute("SELECT last_attempt_id FROM rollouts WHERE rollout_id=?", (rollout_id,)).fetchone()
            if row is None:
                raise RolloutNotFound(f"rollout {rollout_id} not found")
            chosen = attempt_id or row["last_attempt_id"]
            return chosen, [] if chosen is None else self._events(conn, rollout_id, None, chosen)

        chosen, events = await self._read(query)
        if chosen is None:
            return TripletBundle(rollout_id=rollout_id, attempt_id=None, reward=None, triplets=[])
        rewards = attribute_rewards((e.event_id, e.event_type, e.data) for e in events)
        triplets: list[Triplet] = []
        for event in events:
            data = event.data if isinstance(event.data, dict) else {}
            if event.event_type == "model_request" and data.get("response_token_ids") is not None:
                recorded = data.get("choices")  # n > 1: one triplet per choice
                policy, call_id = data.get("policy"), data.get("call_id")
                choices: list[dict[str, Any]] = recorded if isinstance(recorded, list) else [data]
                triplets.extend(
                    Triplet(
                        event_id=event.event_id,
                        prompt_token_ids=data.get("prompt_token_ids") or [],
                        response_token_ids=choice["response_token_ids"],
                        response_logprobs=choice.get("response_logprobs"),
                        policy_version=data.get("policy_version"),
                        choice_index=position,
                        response_version_spans=choice.get("response_version_spans"),
                        policy=policy if isinstance(policy, str) else None,
                        call_id=call_id if isinstance(call_id, str) else None,
                        reward=rewards.per_call.get(event.event_id),
                        anchor=rewards.anchors.get(event.event_id),
                        images=list(image_hashes(data)) or None,
                    )
                    for position, choice in enumerate(choices)
                    if isinstance(choice, dict) and choice.get("response_token_ids") is not None
                )
        return TripletBundle(rollout_id=rollout_id, attempt_id=chosen, reward=rewards.outcome, triplets=triplets)

    async def rewards(self, rollout_ids: Iterable[str]) -> dict[str, float | None]:
        """The outcome reward of each rollout's last attempt, as `triplets` reads it
        (`store.rewards`: a reward that names a call, or that another call follows, is that
        turn's), in one query per 500 rollouts rather than one per rollout."""
        ids = list(rollout_ids)

        def query(conn: sqlite3.Connection) -> dict[str, float | None]:
            found: dict[str, float | None] = dict.fromkeys(ids)
            has_calls = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='calls'").fetchone()
            sql, lists = (_OUTCOME_REWARDS, 2) if has_calls else (_OUTCOME_REWARDS_BEFORE_CALLS, 1)
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                rows = conn.execute(sql.format(ids=",".join("?" * len(chunk))), chunk * lists).fetchall()
                for row in rows:
                    data = codec.loads_lenient(row["data"])
                    if isinstance(data, dict) and not isinstance(data.get("call_id"), str):  # named: a turn's
                        found[row["rollout_id"]] = reward_value(data, found[row["rollout_id"]])
            return found

        return await self._read(query)

    # -- rows -----------------------------------------------------------------------------

    def _load(self, conn: sqlite3.Connection, rollout_id: str) -> Rollout:
        row = conn.execute("SELECT * FROM rollouts WHERE rollout_id=?", (rollout_id,)).fetchone()
        if row is None:
            raise RolloutNotFound(f"rollout {rollout_id} not found")
        return rollout_from_row(row, attempts_of(conn, [rollout_id]).get(rollout_id, []))


def _default_attempt_id(attempts: tuple[str, ...]) -> str:
    """The attempt a move to running starts when it names none: Agent Lightning's default
    attempt id, "0", which its controllers and agents use without saying so; a rollout run
    again (after a re-queue, which Agent Lightning has not) the next number not yet taken.
    Rollover's controller names its attempts (`a1`, `a2`...)."""
    number = len(attempts)
    while str(number) in attempts:
        number += 1
    return str(number)


def _error_message(conn: sqlite3.Connection, rollout_id: str) -> str | None:
    row = conn.execute("SELECT error_message FROM rollouts WHERE rollout_id=?", (rollout_id,)).fetchone()
    return None if row is None else row[0]
