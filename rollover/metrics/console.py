"""The live console: what the running step is doing, and a summary when the run ends.

On a terminal one status line stays at the bottom (rich `Live`) and the per-step metric lines
scroll above it. Elsewhere (CI, a log file) the same status is printed as plain lines: one
when the phase changes, and within a phase when its count moves (at most every
`min_interval_s`) or, unchanged, every `heartbeat_s` — enough to see a run is alive without
flooding the log with every 0.2 s poll.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from rollover.metrics.progress import WindowStatus


@dataclass(frozen=True)
class _Status:
    phase: str
    detail: str
    key: tuple[Any, ...]  # what counts as "the count moved" for plain lines


class LiveConsole:
    """A `Progress` on a rich console. `live=None` picks live mode when the console is a terminal."""

    def __init__(
        self,
        console: Console,
        *,
        live: bool | None = None,
        min_interval_s: float = 5.0,
        heartbeat_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console
        self.live_mode = console.is_terminal if live is None else live
        self.min_interval_s = min_interval_s
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self._lock = threading.Lock()
        self._step = 0
        self._total = 0
        self._status: _Status | None = None
        self._phase_started = clock()
        self._printed: _Status | None = None
        self._printed_at = -float("inf")
        self._live: Live | None = None
        self._swapped: list[tuple[logging.StreamHandler[Any], Any]] = []

    # -- lifetime -------------------------------------------------------------------------

    def __enter__(self) -> LiveConsole:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        if not self.live_mode or self._live is not None:
            return
        self._live = Live(console=self.console, get_renderable=self._render, refresh_per_second=4, transient=True)
        self._live.start()
        # Log handlers hold the real stderr; while the status line is drawn their lines must
        # go through rich's redirect, or they would be written over the status line.
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.__stderr__, sys.__stdout__):
                self._swapped.append((handler, handler.setStream(sys.stderr)))

    def stop(self) -> None:
        for handler, stream in self._swapped:
            handler.setStream(stream)
        self._swapped = []
        if self._live is not None:
            self._live.stop()
            self._live = None

    # -- Progress -------------------------------------------------------------------------

    def step_started(self, step: int, total_steps: int) -> None:
        with self._lock:
            self._step, self._total = step, total_steps
            self._status = self._printed = None  # the step's first phase is always printed

    def rollout_wait(self, window: WindowStatus) -> None:
        detail = (
            f"groups {window.completed_groups}/{window.target_groups}, "
            f"running {window.running}, queued {window.queued}, carry-over {window.carry_over}"
        )
        if window.carry_over:
            detail += f" (oldest {window.oldest_carry_over_age} step{'s' if window.oldest_carry_over_age != 1 else ''})"
        self._set("rollout wait", detail, (window.completed_groups,))

    def drain(self, inflight: int) -> None:
        self._set("drain", f"{inflight} call{'s' if inflight != 1 else ''} in flight", (inflight,))

    def update(self, done: int, total: int) -> None:
        detail = f"optimizer step {done}/{total}" if total else "recomputing logprobs"
        self._set("update", detail, (done, total))

    def weight_sync(self) -> None:
        self._set("weight sync", "", ())

    def evaluation(self, done: int, total: int) -> None:
        self._set("evaluation", f"{done}/{total} held-out tasks", (done,))

    def step_finished(self, step: int, metrics: Mapping[str, float]) -> None:
        with self._lock:
            self._status = None  # the metrics line printed for the step says the rest

    # -- the end of a run -----------------------------------------------------------------

    def summary(self, summary: RunSummary) -> None:
        for line in summary.lines():
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    # -- drawing --------------------------------------------------------------------------

    def _set(self, phase: str, detail: str, key: tuple[Any, ...]) -> None:
        line = None
        with self._lock:
            now = self.clock()
            previous = self._status
            if previous is None or previous.phase != phase:
                self._phase_started = now
            status = self._status = _Status(phase, detail, key)
            if self.live_mode:
                return
            printed = self._printed
            new_phase = printed is None or printed.phase != phase
            moved = printed is not None and printed.key != key and now - self._printed_at >= self.min_interval_s
            if new_phase or moved or now - self._printed_at >= self.heartbeat_s:
                self._printed, self._printed_at = status, now
                line = self._line(status, now)
        if line is not None:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _line(self, status: _Status, now: float) -> str:
        where = f"step {self._step}/{self._total}" if self._total else "before training"
        elapsed = now - self._phase_started
        detail = f": {status.detail}" if status.detail else ""
        return f"[{where}] {status.phase}{detail} ({format_duration(elapsed)})"

    def _render(self) -> Text:
        with self._lock:
            status = self._status
            line = self._line(status, self.clock()) if status is not None else ""
        return Text(line, style="bold cyan", no_wrap=True, overflow="ellipsis")


@dataclass(frozen=True)
class RunSummary:
    steps: int
    wall_s: float
    run_dir: Path
    val_before: float | None = None
    val_after: float | None = None
    last_reward: float | None = None

    @classmethod
    def from_history(
        cls, history: Sequence[Mapping[str, float]], steps: int, wall_s: float, run_dir: Path
    ) -> RunSummary:
        val = [row["val/reward_mean"] for row in history if "val/reward_mean" in row]
        rewards = [row["critic/score/mean"] for row in history if "critic/score/mean" in row]
        return cls(
            steps=steps,
            wall_s=wall_s,
            run_dir=run_dir,
            val_before=val[0] if len(val) > 1 else None,
            val_after=val[-1] if val else None,
            last_reward=rewards[-1] if rewards else None,
        )

    def lines(self) -> list[str]:
        lines = [f"run finished: {self.steps} step{'s' if self.steps != 1 else ''} in {format_duration(self.wall_s)}"]
        if self.val_after is not None:
            before = f"{self.val_before:.3f} -> " if self.val_before is not None else ""
            lines.append(f"held-out reward: {before}{self.val_after:.3f}")
        if self.last_reward is not None:
            lines.append(f"last training reward: {self.last_reward:.3f}")
        lines.append(f"run folder: {self.run_dir}  (see it: rollover view {self.run_dir})")
        return lines


def format_duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
