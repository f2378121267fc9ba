"""The controller loop: queued rollouts in, running agents out, their fate reported back.

It talks to the gateway's REST API only, so the same class runs inside the trainer and as
`rollover controller` on another machine. Each tick (every `poll_interval` seconds, sooner
when a slot frees up) it

1. reads the gateway's cumulative paused time, so timeouts stop ticking during updates,
2. kills attempts past their deadline,
3. checks the running set with one `list_rollouts(rollout_ids=...)` call, and kills agents
   whose rollout was aborted, deleted or taken over,
4. claims queued rollouts FIFO (`queuing -> running` with a new attempt id) up to the
   concurrency limit and launches them on the runner.

Each attempt lives in its own task that waits for the agent, and reports success, a retry
(`running -> queuing`) or a failure.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from rollover.config import AgentLightningConfig, LocalRunnerConfig, RolloverConfig
from rollover.controller.agent_env import agent_env, harness_env
from rollover.controller.runner import Execution, LaunchError, LaunchSpec, Outcome, Runner
from rollover.gateway.client import ConflictError, GatewayClient, NotFoundError, is_transient
from rollover.retry import RetryPolicy, call_with_retries
from rollover.store.models import Rollout, RolloutState

log = logging.getLogger("rollover.controller")

T = TypeVar("T")

TIMEOUT_PREFIX = "timeout"
INTERRUPTED_MESSAGE = "interrupted: the controller stopped while the agent ran"


# -- the controller -----------------------------------------------------------------------


@dataclass(eq=False)
class _Attempt:
    rollout: Rollout
    attempt_id: str
    number: int
    timeout_seconds: float
    started: float  # the controller's clock at claim
    paused_at_start: float  # the controller's paused-seconds counter at claim
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    stop_reason: str | None = None
    report_stop: bool = True  # False: the rollout is no longer ours, leave its status alone
    reporting: bool = False
    execution: Execution | None = None
    deadline_extended_to: float = 0.0
    task: asyncio.Task[None] | None = None

    @property
    def rollout_id(self) -> str:
        return self.rollout.rollout_id

    def request_stop(self, reason: str, *, report: bool) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self.report_stop = report
            self.stop_requested.set()


def runner_limits(config: AgentLightningConfig) -> tuple[int, dict[str, str]]:
    """The configured runner's concurrency limit and env_map. The k8s runner read `local.*`
    before it had keys of its own, so those still apply to it where its own are unset."""
    local, k8s = config.local, config.k8s
    if config.runner != "k8s":
        return local.max_concurrency, local.env_map
    defaults = LocalRunnerConfig()
    for key in ("max_concurrency", "env_map"):
        if getattr(k8s, key) is None and getattr(local, key) != getattr(defaults, key):
            log.warning(
                "agentlightning.local.%s applies to the k8s runner because agentlightning.k8s.%s is unset; "
                "set agentlightning.k8s.%s instead (the fallback is deprecated)",
                key,
                key,
                key,
            )
    return (
        k8s.max_concurrency if k8s.max_concurrency is not None else local.max_concurrency,
        k8s.env_map if k8s.env_map is not None else local.env_map,
    )


class Controller:
    """Runs queued rollouts as agents (local processes or Kubernetes Jobs).

    ``async with Controller(config, client) as controller: ...`` starts the loop in the
    background and, on exit, stops every agent it launched. Validation happens here, in the
    constructor: an agent class that does not import or a Job template that does not render
    raises `ControllerConfigError` before any rollout runs.
    """

    def __init__(
        self,
        config: RolloverConfig | AgentLightningConfig,
        client: GatewayClient,
        *,
        log_dir: str | Path | None = None,
        cwd: str | Path | None = None,
        poll_interval: float = 0.25,
        kill_grace_seconds: float = 2.0,
        k8s_api_client: Any = None,
        clock: Callable[[], float] = time.monotonic,
        hidden_paths: tuple[Path, ...] = (),
    ) -> None:
        self.config = config.agentlightning if isinstance(config, RolloverConfig) else config
        self.client = client
        self.poll_interval = poll_interval
        self.clock = clock  # what rollout timeouts are measured on (tests move it by hand)
        self.cwd = Path(cwd or os.getcwd()).resolve()
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="rollover-agent-logs-"))
        self._running: dict[str, _Attempt] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        # How long a stopping controller keeps trying to report its attempts' fate; 0 once
        # the gateway is known to be gone for good (`rollover train` after GatewayDied).
        self.stop_report_seconds = 10.0
        self._started = False
        self._paused_seen = 0.0
        self._last_paused_total: float | None = None
        self._gateway_paused = False
        # What sandboxed agents must not see besides their logs (the run folder, the store).
        self.hidden_paths = tuple(Path(p) for p in hidden_paths)
        self._runner: Runner = self._make_runner(kill_grace_seconds, k8s_api_client)
        self._max_concurrency, self._env_map = runner_limits(self.config)

    def _make_runner(self, kill_grace_seconds: float, k8s_api_client: Any) -> Runner:
        if self.config.runner == "local":
            from rollover.controller.local import LocalRunner

            return LocalRunner(
                self.config.local,
                log_dir=self.log_dir,
                cwd=self.cwd,
                gateway_url=self.client.base_url,
                hidden_paths=self.hidden_paths,
                kill_grace_seconds=kill_grace_seconds,
            )
        from rollover.controller.k8s import K8sRunner

        host = httpx.URL(self.client.base_url).host
        if not self.config.k8s.gateway_url and host in ("127.0.0.1", "localhost", "::1"):
            log.warning(
                "pods will be told to reach the gateway at %s, which is this machine's loopback; "
                "set agentlightning.k8s.gateway_url to an address they can reach",
                self.client.base_url,
            )
        return K8sRunner(self.config.k8s, api_client=k8s_api_client)

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Controller:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self.log_dir.mkdir(parents=True, exist_ok=True)
        await self._runner.start()
        self._loop_task = asyncio.create_task(self._poll_loop(), name="rollover-controller")
        log.info("controller started: runner=%s, agent logs in %s", self.config.runner, self.log_dir)

    async def stop(self) -> None:
        """Stop claiming, stop every running agent (their rollouts are re-queued), stop the runner."""
        if self._stopping or not self._started:
            return
        self._stopping = True
        self._wake.set()
        if self._loop_task is not None:
            # Let a tick in flight finish rather than cancel it: a claim cut off between the
            # gateway's answer and our bookkeeping would leave a rollout running with no agent.
            done, _ = await asyncio.wait({self._loop_task}, timeout=10)
            if not done:
                self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        attempts = list(self._running.values())
        for attempt in attempts:
            attempt.request_stop(INTERRUPTED_MESSAGE, report=True)
        tasks = [a.task for a in attempts if a.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=30)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._runner.stop()
        log.info("controller stopped")

    @property
    def running(self) -> dict[str, str]:
        """Rollout id -> attempt id of the attempts this controller runs now."""
        return {rid: a.attempt_id for rid, a in self._running.items()}

    # -- the loop -------------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        backoff = self.poll_interval
        while not self._stopping:
            # Cleared before the tick, so that a slot freed during it wakes the next one.
            self._wake.clear()
            try:
                await self._tick()
                backoff = self.poll_interval
                await self._sleep(self.poll_interval)
            except Exception as exc:
                # Whatever goes wrong in one tick (a gateway restart, a bad reply), the next
                # tick starts from the store's state again.
                level = logging.WARNING if is_transient(exc) else logging.ERROR
                log.log(
                    level,
                    "controller tick failed (retrying in %.1fs): %r",
                    backoff,
                    exc,
                    exc_info=level == logging.ERROR,
                )
                await self._sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def _sleep(self, seconds: float) -> None:
        """Until `seconds` pass or something wakes the loop (a freed slot, `stop()`)."""
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def _tick(self) -> None:
        # Read before the first claim too: a pause that begins before an attempt's first
        # check still counts from its start.
        if self._running or self._last_paused_total is None:
            try:
                await self._refresh_paused_time()
            except Exception as exc:
                if not is_transient(exc) or not self._running:
                    raise
                log.warning("cannot read the gateway's paused time: %r", exc)
            self._enforce_deadlines()
            await self._extend_runner_deadlines()
            await self._check_running()
        await self._claim()

    async def _refresh_paused_time(self) -> None:
        state = await self.client.proxy_state()
        total = state.paused_seconds_total
        if self._last_paused_total is not None:
            # A counter that went backwards means the gateway restarted and began again at 0.
            delta = total - self._last_paused_total if total >= self._last_paused_total else total
            self._paused_seen += delta
        self._last_paused_total = total
        self._gateway_paused = state.paused

    def _paused_since(self, attempt: _Attempt) -> float:
        return self._paused_seen - attempt.paused_at_start

    def _enforce_deadlines(self) -> None:
        now = self.clock()
        for attempt in self._running.values():
            if attempt.reporting or attempt.stop_reason is not None:
                continue
            paused = self._paused_since(attempt)
            active = now - attempt.started - paused
            if active > attempt.timeout_seconds:
                attempt.request_stop(
                    f"{TIMEOUT_PREFIX}: the agent ran longer than {attempt.timeout_seconds:g}s "
                    f"({active:.1f}s active, {paused:.1f}s paused not counted)",
                    report=True,
                )

    async def _extend_runner_deadlines(self) -> None:
        # Runner-side deadlines (a Job's activeDeadlineSeconds) know nothing of pauses. Push
        # them out once a pause is over, with headroom so one patch covers a few pauses.
        if self._gateway_paused:
            return
        due: list[tuple[_Attempt, Execution, int]] = []
        for attempt in self._running.values():
            if attempt.execution is None or attempt.stop_reason is not None or attempt.reporting:
                continue
            needed = attempt.timeout_seconds + self._paused_since(attempt)
            if needed > max(attempt.deadline_extended_to, attempt.timeout_seconds):
                due.append((attempt, attempt.execution, math.ceil(needed + 60)))
        if not due:
            return
        results = await asyncio.gather(
            *(self._runner.extend_deadline(execution, target) for _, execution, target in due), return_exceptions=True
        )
        for (attempt, _, target), result in zip(due, results):
            if isinstance(result, BaseException):
                log.warning("cannot extend the deadline of %s: %r", attempt.rollout_id, result)
            else:
                attempt.deadline_extended_to = target

    async def _check_running(self) -> None:
        ids = [rid for rid, a in self._running.items() if not a.reporting and a.stop_reason is None]
        if not ids:
            return
        current = {r.rollout_id: r for r in await self.client.list_rollouts(rollout_ids=ids)}
        for rid in ids:
            attempt = self._running.get(rid)
            if attempt is None or attempt.reporting or attempt.stop_reason is not None:
                continue
            rollout = current.get(rid)
            if rollout is None:
                attempt.request_stop("the rollout was deleted", report=False)
            elif rollout.state != RolloutState.RUNNING or rollout.status.last_attempt_id != attempt.attempt_id:
                reason = rollout.status.error_message or rollout.state.value
                attempt.request_stop(f"the rollout left attempt {attempt.attempt_id}: {reason}", report=False)

    async def _claim(self) -> None:
        if self._stopping:
            return
        free = self._max_concurrency - len(self._running)
        free = min(free, self._runner.claim_budget(self.poll_interval))
        if free <= 0:
            return
        for rollout in await self.client.list_rollouts(state_in=[RolloutState.QUEUING], limit=free):
            if self._stopping:
                return
            if rollout.rollout_id in self._running:
                continue
            number = len(rollout.attempts) + 1
            attempt_id = f"a{number}"
            try:
                claimed = await self.client.update_status(
                    rollout.rollout_id, state=RolloutState.RUNNING, last_attempt_id=attempt_id
                )
            except (ConflictError, NotFoundError):
                continue  # another controller claimed it, or it was aborted/deleted meanwhile
            attempt = _Attempt(
                rollout=claimed,
                attempt_id=attempt_id,
                number=number,
                timeout_seconds=claimed.config.timeout_seconds or self.config.rollout_timeout_seconds,
                started=self.clock(),
                paused_at_start=self._paused_seen,
            )
            self._running[rollout.rollout_id] = attempt
            attempt.task = asyncio.create_task(self._run_attempt(attempt), name=f"rollout-{rollout.rollout_id}")

    # -- one attempt ----------------------------------------------------------------------

    def _launch_spec(self, attempt: _Attempt) -> LaunchSpec:
        rollout = attempt.rollout
        env_map = {**self._env_map, **rollout.config.local.env_map}
        public_url = self._runner.agent_gateway_url
        env = agent_env(self.client, rollout, attempt.attempt_id, env_map, public_url)
        return LaunchSpec(
            rollout=rollout,
            attempt_id=attempt.attempt_id,
            env=env,
            timeout_seconds=attempt.timeout_seconds,
            defaults=harness_env(env),
        )

    async def _run_attempt(self, attempt: _Attempt) -> None:
        try:
            outcome = await self._execute(attempt)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("attempt %s of %s failed in the controller", attempt.attempt_id, attempt.rollout_id)
            outcome = Outcome(False, f"controller error: {exc!r}")
        try:
            if attempt.stop_reason is None or attempt.report_stop:
                await self._report(attempt, outcome)
        finally:
            self._running.pop(attempt.rollout_id, None)
            self._wake.set()

    async def _execute(self, attempt: _Attempt) -> Outcome:
        try:
            spec = self._launch_spec(attempt)
        except LaunchError as exc:
            return Outcome(False, exc.reason, permanent=exc.permanent)
        stop_wait = asyncio.create_task(attempt.stop_requested.wait())
        launch = asyncio.create_task(self._runner.launch(spec))
        waiting: asyncio.Task[Outcome] | None = None
        try:
            await asyncio.wait({launch, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if not launch.done():
                # Stopped while waiting to start (e.g. for the Job rate limit).
                launch.cancel()
                await asyncio.gather(launch, return_exceptions=True)
                return Outcome(False, attempt.stop_reason)
            try:
                attempt.execution = launch.result()
            except LaunchError as exc:
                return Outcome(False, exc.reason, permanent=exc.permanent)
            if attempt.execution.job_name:
                await self._note_job_name(attempt, attempt.execution.job_name)
            waiting = asyncio.create_task(attempt.execution.wait())
            await asyncio.wait({waiting, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if waiting.done():
                return waiting.result()
            await attempt.execution.kill()
            return Outcome(False, attempt.stop_reason)
        except asyncio.CancelledError:
            if attempt.execution is not None:
                await asyncio.shield(attempt.execution.kill())
            raise
        finally:
            stop_wait.cancel()
            launch.cancel()
            if waiting is not None:
                waiting.cancel()

    async def _note_job_name(self, attempt: _Attempt, job_name: str) -> None:
        try:
            await self._retry(
                lambda: self.client.update_status(attempt.rollout_id, k8s_job_name=job_name), give_up_after=10
            )
        except (ConflictError, NotFoundError):
            pass  # aborted or deleted meanwhile; the next tick notices
        except Exception as exc:
            log.warning("cannot record the job name of %s: %r", attempt.rollout_id, exc)

    async def _report(self, attempt: _Attempt, outcome: Outcome) -> None:
        attempt.reporting = True
        fields: dict[str, Any]
        if outcome.succeeded:
            fields = {"state": RolloutState.SUCCEEDED}
        else:
            reason = (outcome.reason or "failed")[:60000]
            retry = not outcome.permanent and attempt.number < self.config.max_attempts
            if attempt.stop_reason == INTERRUPTED_MESSAGE:
                retry = True  # not the agent's fault: let another controller run it
            fields = {"state": RolloutState.QUEUING if retry else RolloutState.FAILED, "error_message": reason}
        try:
            await self._retry(
                lambda: self.client.update_status(attempt.rollout_id, **fields),
                give_up_after=self.stop_report_seconds if self._stopping else None,
            )
        except (ConflictError, NotFoundError):
            # Aborted (or deleted) while we finished: the trainer's word stands.
            log.debug("rollout %s changed before its report; left as is", attempt.rollout_id)
        except Exception as exc:
            log.error("cannot report rollout %s (%s): %r", attempt.rollout_id, fields, exc)
        else:
            log.debug("rollout %s attempt %s -> %s", attempt.rollout_id, attempt.attempt_id, fields["state"].value)

    async def _retry(self, call: Callable[[], Awaitable[T]], give_up_after: float | None = None) -> T:
        """Retry gateway hiccups (transport errors, 5xx) with backoff; other errors propagate."""
        return await call_with_retries(
            "gateway call",
            call,
            RetryPolicy(is_transient, give_up_after=give_up_after, first_wait=0.1, max_wait=5.0),
            log,
        )
