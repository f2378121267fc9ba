"""The composition root of `rollover train`: store, gateway, vLLM engine, controller and
trainer built and wired on one machine. The parts know only their own neighbours' protocols;
this module is the one place that imports them all."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rollover.config import ConfigError, GatewaySettings, RolloverConfig, dump_config, redacted
from rollover.distributed.world import World

if TYPE_CHECKING:
    from rollover.engine.vllm_engine import VLLMEngine


class Followers(Protocol):
    """The other trainer ranks, as rank 0 drives them (`rollover.ranks.commands.Leader`): told
    where the run is, then of every collective step of the trainer's actor and weight sync."""

    def hello(self, model_path: str, run_dir: str, gateway_url: str, admin_key: str, policy_version: int) -> None: ...

    def lead(self, actor: Any, weight_sync: Any) -> tuple[Any, Any]:
        """The trainer's actor and weight sync, each call first announced to the other ranks."""
        ...

    def barrier(self) -> None: ...

    def stop(self, reason: str) -> None: ...


def import_object(spec: str, key: str) -> Any:
    """`pkg.module:name` → the object, with an error naming the config key."""
    if os.getcwd() not in sys.path:
        # Hooks named in a config (`examples.calc.prepare:setup`) are found from the working
        # directory, as `python -m` would find them; the `rollover` script's own folder is not it.
        sys.path.insert(0, os.getcwd())
    module_name, _, attribute = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"config key '{key}': cannot import {spec!r} ({exc})") from None


def apply_setup_hook(config: RolloverConfig) -> RolloverConfig:
    hook = config.trainer.setup_hook
    if not hook:
        return config
    function: Callable[[RolloverConfig], RolloverConfig | None] = import_object(hook, "trainer.setup_hook")
    return function(config) or config


def prepare_run_dir(config: RolloverConfig) -> Path:
    """A fresh run never mixes with an old one: the old folder is kept under a new name. The
    folder is the run's user's alone (0700): it holds the store, the weights and the logs."""
    run_dir = config.trainer.run_dir
    if run_dir.exists() and any(run_dir.iterdir()) and not config.resume:
        kept = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(kept)
        print(f"previous run moved to {kept} (pass resume=true to continue it instead)", file=sys.stderr)
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    run_dir.chmod(0o700)
    return run_dir


def write_private(path: Path, text: str) -> None:
    """`text` in a file only the run's user can read (0600, whatever the umask)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w") as handle:
        handle.write(text)
    path.chmod(0o600)


def run_training(
    config: RolloverConfig,
    engine: VLLMEngine | None = None,
    world: World | None = None,
    followers: Followers | None = None,
) -> int:
    """The whole system for one run, on rank 0 of `world`; on several ranks `followers` are the
    others (`rollover.ranks`). `engine`: an already running `VLLMEngine` serving the same
    tokenizer (tests share one across runs); its weights are reset to the run's model."""
    world = world or World()
    if world.distributed and followers is None:
        raise ValueError(f"rank 0 of {world.size} needs the other ranks' followers (rollover.ranks)")
    try:
        config = apply_setup_hook(config)
        return asyncio.run(_run(config, engine, world, followers))
    finally:
        if followers is not None:
            followers.stop("rank 0 is done")


def run_training_reporting_errors(config: RolloverConfig, world: World, followers: Followers | None = None) -> int:
    """`run_training`, with what ends a run told in one line on stderr (exit code 1); a bad
    config still raises `ConfigError`/`ValueError` (the caller's exit code 2)."""
    import httpx

    from rollover.engine.server import EngineError
    from rollover.gateway.server import GatewayDied
    from rollover.training.trainer import DrainTimeout, RolloutsFailing

    try:
        return run_training(config, world=world, followers=followers)
    except EngineError as exc:
        print(f"rollover train: the inference engine failed: {exc}", file=sys.stderr)
        return 1
    except (GatewayDied, RolloutsFailing, DrainTimeout) as exc:
        print(f"rollover train: {exc}", file=sys.stderr)
        return 1
    except httpx.TransportError as exc:
        print(f"rollover train: the gateway stopped answering: {exc!r}", file=sys.stderr)
        return 1


def _required(value: str | None, key: str) -> str:
    if not value:
        raise ConfigError(f"config key '{key}' must be set")
    return value


async def _run(
    config: RolloverConfig, shared_engine: VLLMEngine | None, world: World, followers: Followers | None
) -> int:
    from rollover.controller import Controller
    from rollover.engine.pool import node_engines, register_all, wait_all_ready
    from rollover.engine.settings import EngineSettings
    from rollover.engine.watchdog import EngineWatchdog
    from rollover.engine.weight_sync import engine_weight_sync
    from rollover.gateway.client import GatewayClient
    from rollover.gateway.server import GatewayDied, GatewayProcess, GatewayWatchdog
    from rollover.metrics import MetricsLogger
    from rollover.metrics.console import LiveConsole, RunSummary
    from rollover.training.actor import Actor
    from rollover.training.checkpoint import latest_checkpoint
    from rollover.training.data import read_tasks
    from rollover.training.images import SampleImages
    from rollover.training.settings import TrainerSettings
    from rollover.training.trainer import Trainer
    from rollover.training.update_settings import ActorSettings
    from rollover.vision.model import takes_images

    trainer_settings = TrainerSettings.from_config(config)  # its rules checked before anything starts
    engine_settings = EngineSettings.from_config(config)
    train_tasks = read_tasks(_required(config.data.train_files, "data.train_files"))
    val_tasks = read_tasks(config.data.val_files) if config.data.val_files else []
    model_path = _required(config.actor_rollout_ref.model.path, "actor_rollout_ref.model.path")
    if config.agentlightning.runner == "local":
        _required(config.agentlightning.local.agent_class, "agentlightning.local.agent_class")

    run_dir = prepare_run_dir(config)
    checkpoint = latest_checkpoint(run_dir) if config.resume else None
    if config.resume and checkpoint is None:
        print(f"resume=true but {run_dir} has no checkpoint: starting from the beginning", file=sys.stderr)
    if checkpoint is not None and not config.actor_rollout_ref.model.lora:
        # With LoRA the checkpoint's model is the adapter: the base stays the configured one.
        model_path = str(checkpoint / "model")
    write_private(run_dir / "config.yaml", dump_config(config))

    gateway = GatewayProcess(
        GatewaySettings.from_config(config, store=config.gateway.store_path(run_dir)), log_path=run_dir / "gateway.log"
    )
    admin_key = gateway.admin_key
    engines = (
        [shared_engine] if shared_engine is not None else node_engines(engine_settings, model_path, run_dir, world)
    )
    started = time.monotonic()
    metrics = MetricsLogger(
        run_dir,
        config.trainer.logger,
        project=config.trainer.project_name,
        experiment=config.trainer.experiment_name,
        config=redacted(config),
    )
    # One console for the step lines and the live status line, so the lines scroll above it.
    live = LiveConsole(metrics.console) if "console" in config.trainer.logger else None
    client: GatewayClient | None = None
    try:
        gateway.start()
        gateway_url = config.gateway.advertise_url or gateway.url
        print(f"gateway {gateway.url}  run folder {run_dir}", file=sys.stderr, flush=True)
        client = GatewayClient(gateway.url, admin_key)
        # The store may be a resumed run's: its gateway state (pause, engines) is a dead one's.
        # Cleared before other nodes hear of the gateway, so their engines' registrations stay.
        await client.clear_models()
        await client.resume()
        if followers is not None:
            followers.hello(model_path, str(run_dir), gateway_url, admin_key, _checkpoint_version(checkpoint))
        if shared_engine is None:
            for engine in engines:
                engine.start()
        actor = await asyncio.to_thread(Actor.load, model_path, ActorSettings.from_config(config), world)
        if shared_engine is None:
            await wait_all_ready(engines)
        else:
            shared_engine.attach_gateway(gateway.url, admin_key)  # not the previous run's gateway
            await shared_engine.load_weights(model_path, version=0)
        locks = [asyncio.Lock() for _ in engines]
        weight_sync: Any = engine_weight_sync(
            engine_settings, engines, run_dir / "weights" / f"node{world.node_rank}", locks
        )
        trainer_actor: Any = actor
        if followers is not None:
            trainer_actor, weight_sync = followers.lead(actor, weight_sync)
        # Sandboxed agents see neither the run folder nor the store (which may live elsewhere).
        hidden = (run_dir, Path(config.gateway.store_path(run_dir)))
        async with Controller(config, client, log_dir=run_dir / "agent_logs", hidden_paths=hidden) as controller:
            trainer = Trainer(
                settings=trainer_settings,
                client=client,
                actor=trainer_actor,
                weight_sync=weight_sync,
                train_tasks=train_tasks,
                val_tasks=val_tasks,
                metrics=metrics,
                run_dir=run_dir,
                world_size=world.size,
                images=SampleImages(model_path, client.image) if takes_images(model_path) else None,
            )
            if live is not None:
                trainer.progress = actor.progress = live
            if followers is not None:
                # Every node's engines serve, and the other ranks now take commands: before the
                # restore, whose LoadTrainingState they must be listening for.
                await asyncio.to_thread(followers.barrier)
            if checkpoint is not None:
                _restore(trainer, trainer_actor, checkpoint)
                stranded = await trainer.reconcile_after_restart()
                print(
                    f"resumed {checkpoint.name}: step {trainer.global_step}, aborted {stranded} stranded rollouts",
                    file=sys.stderr,
                )
            await register_all(engines, gateway_url, admin_key, trainer.policy_version)
            if config.actor_rollout_ref.model.lora:
                # The engines serve the policy's adapter from the first call: a fresh one (the
                # base's answers), lora_adapter_path's, or a resumed run's.
                await weight_sync.sync(trainer_actor, trainer.policy_version)
            max_restarts = engine_settings.max_restarts
            watchdogs = [
                EngineWatchdog(engine, lock, max_restarts=max_restarts).run() for engine, lock in zip(engines, locks)
            ]
            gateway_watchdog = GatewayWatchdog(gateway, max_restarts=config.gateway.max_restarts)
            with live if live is not None else contextlib.nullcontext():
                try:
                    await _until_first_done(trainer.fit(), *watchdogs, gateway_watchdog.run())
                except GatewayDied:
                    # Shutting down with nothing to bring it back: no more waiting for it.
                    client.retry_seconds = controller.stop_report_seconds = 0
                    raise
        summary = {k: v for k, v in trainer.history[-1].items()} if trainer.history else {}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if live is not None:
            wall = time.monotonic() - started
            live.summary(RunSummary.from_history(trainer.history, trainer.global_step, wall, run_dir))
        return 0
    finally:
        metrics.close()
        if client is not None:
            await client.aclose()
        if shared_engine is None:
            for engine in engines:
                engine.stop()
        else:
            shared_engine.gateway_url = None  # this run's gateway is going away
        gateway.stop()


async def _until_first_done(main: Any, *guards: Any) -> Any:
    """Run `main` with `guards` beside it; whichever ends first (a guard only by raising)
    ends the others. Returns `main`'s result."""
    main_task = asyncio.ensure_future(main)
    guard_tasks = [asyncio.ensure_future(guard) for guard in guards]
    tasks = [main_task, *guard_tasks]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for guard_task in guard_tasks:
        failure = guard_task.exception() if guard_task.done() and not guard_task.cancelled() else None
        if failure is not None:
            raise failure
    return main_task.result()


def _checkpoint_version(checkpoint: Path | None) -> int:
    if checkpoint is None:
        return 0
    return int(json.loads((checkpoint / "trainer_state.json").read_text())["policy_version"])


def _restore(trainer: Any, actor: Any, checkpoint: Path) -> None:
    """The trainer's state, then the model and optimizer: sharded (any number of ranks), or
    an older run's `optimizer.pt` (its model is the folder the actor was loaded from)."""
    from rollover.training.checkpoint import TRAINING_STATE

    trainer.load_state_dict(json.loads((checkpoint / "trainer_state.json").read_text()))
    if (checkpoint / TRAINING_STATE).is_dir():
        actor.load_training_state(checkpoint / TRAINING_STATE)
        return
    optimizer_state = checkpoint / "optimizer.pt"
    if optimizer_state.is_file():
        import torch

        # load_state_dict moves the state onto each parameter's device.
        actor.optimizer.load_state_dict(torch.load(optimizer_state, map_location="cpu"))
