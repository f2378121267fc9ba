"""What the run viewer shows, read from a run folder without writing to it.

The store is opened through `RolloutStore(read_only=True)` (SQLite `mode=ro`: a WAL reader
never blocks the trainer's writer), the metrics from `metrics.jsonl` (a half-written last line
during a run is skipped), and the trained sequence is rebuilt by the trainer's own
`build_samples`, so the page shows exactly the tokens, mask and logprobs an update used.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollover.config import ConfigError, RolloverConfig, load_config
from rollover.store import Event, Rollout, RolloutState, RolloutStore, TripletBundle
from rollover.store.rewards import call_rewards

STORE_FILE = "store.db"
METRICS_FILE = "metrics.jsonl"


class RunFolderError(ValueError):
    """Not a run folder, or a part of it cannot be read."""


@dataclass(frozen=True)
class RolloutFilter:
    step: int | None = None  # the step that enqueued its group (held-out: the step it ran after)
    state: str | None = None  # queuing | running | succeeded | failed | aborted
    mode: str | None = None  # train | val
    group: str | None = None  # data_id, exact
    reward_min: float | None = None
    reward_max: float | None = None

    def keeps(self, row: dict[str, Any]) -> bool:
        if self.step is not None and row["step"] != self.step:
            return False
        if self.state is not None and self.state not in (row["state"], "aborted" if row["aborted"] else None):
            return False
        if self.mode is not None and row["mode"] != self.mode:
            return False
        if self.group is not None and row["group"] != self.group:
            return False
        reward = row["reward"]
        if self.reward_min is not None and (reward is None or reward < self.reward_min):
            return False
        return not (self.reward_max is not None and (reward is None or reward > self.reward_max))


class RunFolder:
    def __init__(self, run_dir: str | Path, tokenizer: str | Path | None = None) -> None:
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise RunFolderError(f"{self.run_dir} is not a folder")
        self.config, self.config_error = _read_config(self.run_dir / "config.yaml")
        store = self.config.gateway.store
        self.store_path = Path(store) if store and store != ":memory:" else self.run_dir / STORE_FILE
        self.metrics_path = self.run_dir / METRICS_FILE
        if not self.store_path.is_file() and not self.metrics_path.is_file():
            raise RunFolderError(f"{self.run_dir} has neither {STORE_FILE} nor {METRICS_FILE}: is it a run folder?")
        self._tokenizer_path = Path(tokenizer) if tokenizer else None
        self._tokenizer: Any = None
        self._tokenizer_error: str | None = None
        self._store: RolloutStore | None = None
        self._metrics_cache: tuple[tuple[int, float], list[dict[str, Any]]] | None = None

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    # -- the parts ------------------------------------------------------------------------

    @property
    def store(self) -> RolloutStore | None:
        """Opened once the trainer has created it (the viewer may start first)."""
        if self._store is None and self.store_path.is_file():
            self._store = RolloutStore(self.store_path, read_only=True)
        return self._store

    def metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.is_file():
            return []
        stat = self.metrics_path.stat()
        signature = (stat.st_size, stat.st_mtime)
        if self._metrics_cache is None or self._metrics_cache[0] != signature:
            rows = []
            with open(self.metrics_path) as handle:
                for line in handle:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue  # the line the trainer is writing right now
                    if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
                        rows.append(row)
            self._metrics_cache = (signature, rows)
        return self._metrics_cache[1]

    def summary(self) -> dict[str, Any]:
        config = self.config
        async_cfg = config.agentlightning.async_rollout
        return {
            "name": self.run_dir.resolve().name,
            "run_dir": str(self.run_dir.resolve()),
            "has_store": self.store_path.is_file(),
            "has_metrics": self.metrics_path.is_file(),
            "config_error": self.config_error,
            "train_batch_size": config.data.train_batch_size,
            "n": config.actor_rollout_ref.rollout.n,
            "async": async_cfg.enabled,
            "async_train_batch_size": async_cfg.async_train_batch_size,
            "total_training_steps": config.trainer.total_training_steps,
            "adv_estimator": config.algorithm.adv_estimator,
            "model": config.actor_rollout_ref.model.path,
        }

    # -- the step timeline ----------------------------------------------------------------

    async def timeline(self) -> dict[str, Any]:
        """Per step, on one wall-clock axis: rollout wait, drain, update, weight sync (from the
        metrics), the evaluations (from the held-out rollouts' times) and the pause agents saw
        (from the drain to the next resume: the next step's `timing/gateway_pause_s`)."""
        evals: dict[int, dict[str, float]] = {}
        for row in await self.rollouts(RolloutFilter(mode="val")):
            if row["step"] is None:
                continue
            span = evals.setdefault(row["step"], {"start": row["created_at"], "end": row["created_at"]})
            span["start"] = min(span["start"], row["created_at"])
            span["end"] = max(span["end"], row["finished_at"] or row["created_at"])
        train = sorted((r for r in self.metrics() if "timing/step_s" in r), key=lambda r: r["step"])
        steps = []
        for index, row in enumerate(train):
            step = int(row["step"])
            end = float(row["time"])
            if step in evals and evals[step]["start"] < end:
                end = evals[step]["start"]  # logged after this step's evaluation
            start = end - row["timing/step_s"]
            wait, drain = row.get("timing/rollout_wait_s", 0.0), row.get("training/async/proxy_drain_seconds", 0.0)
            update, sync = row.get("timing/update_s", 0.0), row.get("timing/weight_sync_s", 0.0)
            drain_start = start + wait
            pause_end: float | None = None
            if index + 1 < len(train) and "timing/gateway_pause_s" in train[index + 1]:
                pause_end = drain_start + train[index + 1]["timing/gateway_pause_s"]
            elif step in evals:
                pause_end = evals[step]["start"]  # the evaluation's resume ends it
            steps.append(
                {
                    "step": step,
                    "start": start,
                    "end": end,
                    "segments": [
                        {"phase": "rollout wait", "start": start, "end": drain_start},
                        {"phase": "drain", "start": drain_start, "end": drain_start + drain},
                        {"phase": "update", "start": end - sync - update, "end": end - sync},
                        {"phase": "weight sync", "start": end - sync, "end": end},
                    ],
                    "pause": None if pause_end is None else {"start": drain_start, "end": pause_end},
                }
            )
        spans = [s["start"] for s in steps] + [e["start"] for e in evals.values()]
        return {
            "origin": min(spans) if spans else None,
            "steps": steps,
            "evaluations": [{"step": k, **v} for k, v in sorted(evals.items())],
        }

    # -- rollouts -------------------------------------------------------------------------

    async def rollouts(self, keep: RolloutFilter = RolloutFilter()) -> list[dict[str, Any]]:
        store = self.store
        if store is None:
            return []
        rollouts = await store.list_rollouts()
        rewards = await store.rewards(r.rollout_id for r in rollouts)
        rows = [self._row(r, rewards[r.rollout_id]) for r in rollouts]
        _attach_advantages(rows, self.config)
        return [row for row in rows if keep.keeps(row)]

    async def group(self, group: str) -> list[dict[str, Any]]:
        """The siblings, each with its last reply, to compare them side by side."""
        rows = sorted(await self.rollouts(RolloutFilter(group=group)), key=lambda row: row["rollout_id"])
        assert self.store is not None  # rows came from it
        for row in rows:
            calls = await self.store.list_events(row["rollout_id"], event_type="model_request")
            row["final_response"] = _reply_text(_call(calls[-1])) if calls else None
        return rows

    async def image(self, sha256: str) -> tuple[str, bytes] | None:
        """A recorded image (media type and bytes) by its content hash."""
        store = self.store
        if store is None:
            return None
        return (await store.images([sha256])).get(sha256)

    async def rollout(self, rollout_id: str) -> dict[str, Any]:
        store = self.store
        if store is None:
            raise RunFolderError(f"{self.store_path} does not exist yet")
        rollout = await store.get_rollout(rollout_id)
        siblings = await self.group(_group_of(rollout))
        row = next(s for s in siblings if s["rollout_id"] == rollout_id)
        events = await store.list_events(rollout_id)
        rewards = call_rewards(events)  # rewards per turn: each call's
        bundle = await store.triplets(rollout_id)
        return {
            **row,
            "input": rollout.input,
            "metadata": rollout.metadata,
            "status": rollout.status.model_dump(mode="json"),
            "attempts": [
                {**a.model_dump(mode="json"), "duration_s": _minus(a.finished_at, a.started_at)}
                for a in rollout.attempts
            ],
            "siblings": siblings,
            "calls": [_call(e, rewards.get(e.event_id)) for e in events if e.event_type == "model_request"],
            "events": [_event(e) for e in events if e.event_type != "model_request"],
            "samples": self._samples(rollout, row, bundle),
            "trained_attempt": bundle.attempt_id,
            "tokenizer": self._tokenizer_error or "loaded",
        }

    def _row(self, rollout: Rollout, reward: float | None) -> dict[str, Any]:
        # Numbered as metrics.jsonl and the console number steps: a training group enqueued by
        # step k (the trainer's 0-based enqueued_step k-1); a held-out rollout run after step k.
        enqueued = rollout.metadata.get("enqueued_step")
        step = None if not isinstance(enqueued, int) else enqueued + 1 if rollout.is_train else enqueued
        return {
            "rollout_id": rollout.rollout_id,
            "group": _group_of(rollout),
            "mode": "train" if rollout.is_train else "val",
            "step": step,
            "state": rollout.state.value,
            "aborted": rollout.aborted,
            "terminal": rollout.state.terminal,
            "error": rollout.status.error_message,
            "reward": reward,
            "advantage": None,
            "n_attempts": len(rollout.attempts),
            "created_at": rollout.created_at,
            "started_at": rollout.started_at,
            "finished_at": rollout.finished_at,
            "queue_s": _minus(rollout.started_at, rollout.created_at),
            "run_s": _minus(rollout.finished_at, rollout.started_at),
        }

    # -- the trained sequence -------------------------------------------------------------

    def _samples(self, rollout: Rollout, row: dict[str, Any], bundle: TripletBundle) -> list[dict[str, Any]]:
        from rollover.training.samples import build_samples

        if not bundle.triplets:
            return []
        data = self.config.data
        samples = build_samples(
            rollout.rollout_id,
            row["group"],
            [t.model_dump() for t in bundle.triplets],
            _trained_reward(rollout, row["reward"], self.config),
            data.max_prompt_length + data.max_response_length,
        )
        decode = self._decoder()
        out = []
        for sample in samples:
            tokens = [
                {
                    "id": token,
                    "text": decode(token),
                    "mask": mask,
                    "logprob": None if mask == 0 or math.isnan(logprob) else logprob,
                    "version": None if version < 0 else version,
                }
                for token, mask, logprob, version in zip(
                    sample.input_ids, sample.loss_mask, sample.behaviour_logprobs, sample.token_versions
                )
            ]
            out.append(
                {
                    "reward": sample.reward,
                    "advantage": row["advantage"],
                    "n_tokens": len(sample),
                    "n_loss_tokens": sample.num_loss_tokens,
                    "policy": sample.policy,
                    "tokens": tokens,
                    # The trainer's π_old is not recorded (yet); the page says so.
                    "trainer_logprobs": None,
                }
            )
        return out

    def _decoder(self) -> Any:
        if self._tokenizer is None and self._tokenizer_error is None:
            self._tokenizer, self._tokenizer_error = _load_tokenizer(self._tokenizer_candidates())
        tokenizer = self._tokenizer
        if tokenizer is None:
            return lambda token: None
        return lambda token: tokenizer.decode([token], skip_special_tokens=False)

    def _tokenizer_candidates(self) -> list[Path]:
        """An explicit `--tokenizer`, else the newest checkpoint's, else the config's model."""
        if self._tokenizer_path is not None:
            return [self._tokenizer_path]
        candidates = []
        pointer = self.run_dir / "checkpoints" / "latest"
        if pointer.is_file():
            candidates.append(self.run_dir / "checkpoints" / pointer.read_text().strip() / "model")
        if self.config.actor_rollout_ref.model.path:
            candidates.append(Path(self.config.actor_rollout_ref.model.path))
        return candidates


def _read_config(path: Path) -> tuple[RolloverConfig, str | None]:
    """The run's config; defaults (and the reason) when it is missing or does not validate."""
    if not path.is_file():
        return load_config(None), f"{path.name} not found: showing with default config values"
    try:
        return load_config(path), None
    except ConfigError as exc:
        return load_config(None), f"{path.name} does not validate ({exc}): showing with default config values"


def _load_tokenizer(candidates: Sequence[Path]) -> tuple[Any, str | None]:
    from tokenizers import Tokenizer

    for folder in candidates:
        file = folder / "tokenizer.json" if folder.is_dir() else folder
        if file.is_file():
            try:
                return Tokenizer.from_file(str(file)), None
            except Exception as exc:  # a corrupt or foreign file: show token ids instead
                return None, f"cannot read {file}: {exc}"
    return None, "no tokenizer.json found (pass --tokenizer): showing token ids"


def _group_of(rollout: Rollout) -> str:
    data_id = rollout.metadata.get("data_id")
    return str(data_id) if data_id is not None else rollout.rollout_id


def _minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def _trained_reward(rollout: Rollout, reward: float | None, config: RolloverConfig) -> float:
    # As the trainer's _collect_samples: a failed rollout, or one without a reward, gets the fill value.
    if rollout.state == RolloutState.FAILED or reward is None:
        return config.algorithm.reward_fillna_value
    return reward


def _attach_advantages(rows: list[dict[str, Any]], config: RolloverConfig) -> None:
    """The advantage the trainer computes for each complete training group (the trainer's own
    `outcome_advantages`, before any KL in the reward, one rollout a unit); none for groups
    still running or cut short by an abort, nor under the estimators whose advantages are per
    token (REINFORCE++, the optimal token baseline). With `algorithm.filter_groups` on, a group
    whose members all scored alike is marked `filtered` (the trainer's own rule, `has_signal`):
    it was not trained on."""
    from rollover.training.advantages import OUTCOME_ESTIMATORS, GroupKey, Unit, UnitScore, outcome_advantages
    from rollover.training.manager import has_signal

    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["mode"] == "train":
            groups.setdefault(row["group"], []).append(row)
    complete = [g for g in groups.values() if all(r["terminal"] and not r["aborted"] for r in g)]
    members = [r for g in complete for r in g]
    if not members:
        return
    fill = config.algorithm.reward_fillna_value
    rewards = [fill if r["state"] == RolloutState.FAILED.value or r["reward"] is None else r["reward"] for r in members]
    estimator = config.algorithm.adv_estimator
    units = [UnitScore(Unit(r["rollout_id"]), GroupKey(r["group"]), reward) for r, reward in zip(members, rewards)]
    advantages: list[float | None] = (
        list(outcome_advantages(units, estimator, norm_by_std=config.algorithm.norm_adv_by_std_in_grpo))
        if estimator in OUTCOME_ESTIMATORS
        else [None] * len(members)
    )
    by_group: dict[str, list[float]] = {}
    for row, reward in zip(members, rewards):
        by_group.setdefault(row["group"], []).append(reward)
    filters = config.algorithm.filter_groups
    for row, advantage in zip(members, advantages):
        scores = by_group[row["group"]]
        if filters.enable and not has_signal([float(x > 0) for x in scores] if filters.metric == "acc" else scores):
            row["filtered"] = True
        else:
            row["advantage"] = advantage


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _call(event: Event, reward: float | None = None) -> dict[str, Any]:
    """A recorded call as the page shows it, with the rewards posted for it (`reward`); a
    malformed record shows as empty fields."""
    data = _dict(event.data)
    request, response = _dict(data.get("request")), _dict(data.get("response"))
    choices = response.get("choices")
    choice = _dict(choices[0]) if isinstance(choices, list) and choices else {}
    return {
        "event_id": event.event_id,
        "attempt_id": event.attempt_id,
        "created_at": event.created_at,
        "mode": data.get("mode"),
        "endpoint": data.get("endpoint"),
        "model": data.get("model"),  # the name the engine served it under
        "policy": data.get("policy"),  # several policies: the one the agent asked for
        "policy_version": data.get("policy_version"),
        "reward": reward,
        "api": _dict(data.get("api")).get("name"),  # made through the Anthropic or Responses API
        "version_spans": data.get("response_version_spans"),  # partial rollout: [[first token, version], ...]
        "latency_s": data.get("latency_s"),
        "status_code": data.get("status_code"),
        "messages": request.get("messages"),
        "prompt": request.get("prompt"),
        "tools": request.get("tools"),
        "params": {k: v for k, v in request.items() if k not in ("messages", "prompt", "tools")},
        "response_message": choice.get("message"),
        "response_text": choice.get("text"),
        "finish_reason": choice.get("finish_reason"),
        "usage": response.get("usage"),
        "error": response.get("error") if data.get("status_code") != 200 else None,
        # Its images (hash, format, size), in prompt order; the page shows them beside the turn.
        "images": [image for image in data.get("images") or [] if isinstance(image, dict)],
        "n_prompt_tokens": len(data.get("prompt_token_ids") or []),
        "n_response_tokens": len(data.get("response_token_ids") or []),
    }


def _reply_text(call: dict[str, Any]) -> str | None:
    message = call["response_message"]
    if isinstance(message, dict):
        return str(message.get("content") or "") or None
    return call["response_text"]


def _event(event: Event) -> dict[str, Any]:
    return {
        "event_id": event.event_id,
        "attempt_id": event.attempt_id,
        "event_type": event.event_type,
        "created_at": event.created_at,
        "data": event.data,
    }
