"""`rollover train`: store, gateway, vLLM engine, controller and trainer on one machine."""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollover.config import ConfigError, GatewaySettings, RolloverConfig, check_async_rollout, dump_config

log = logging.getLogger("rollover.run")


def import_object(spec: str, key: str) -> Any:
    """`pkg.module:name` → the object, with an error naming the config key."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # examples are imported from the working directory
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
    """A fresh run never mixes with an old one: the old folder is kept under a new name."""
    run_dir = config.trainer.run_dir
    if run_dir.exists() and any(run_dir.iterdir()) and not config.resume:
        kept = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(kept)
        print(f"previous run moved to {kept} (pass resume=true to continue it instead)", file=sys.stderr)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    checkpoint = run_dir / "checkpoints" / pointer.read_text().strip()
    return checkpoint if (checkpoint / "trainer_state.json").is_file() else None


class EngineWeightSync:
    """Collocated weight sync: save safetensors, reload them in the running vLLM server.
    `lock` is shared with the engine watchdog, so a restart never races a reload."""

    def __init__(self, engine: Any, weights_root: Path, lock: asyncio.Lock | None = None) -> None:
        self.engine = engine
        self.weights_root = weights_root
        self.lock = lock or asyncio.Lock()

    async def before_update(self) -> None:
        if getattr(self.engine, "device", "cpu") == "cuda":
            await self.engine.sleep(1)  # give the KV cache's memory to the update

    async def sync(self, policy: Any, version: int) -> None:
        from rollover.engine.weights import save_weights

        target = self.weights_root / f"v{version}"
        await asyncio.to_thread(save_weights, policy.model, target)
        async with self.lock:
            await self.engine.load_weights(target, version=version)
        for old in self.weights_root.glob("v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)


def run_training(config: RolloverConfig, engine: Any = None) -> int:
    """The whole system for one run. `engine`: an already running `VLLMEngine` serving the
    same tokenizer (tests share one across runs); its weights are reset to the run's model."""
    check_async_rollout(config)
    config = apply_setup_hook(config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return asyncio.run(_run(config, engine))


def _required(value: str | None, key: str) -> str:
    if not value:
        raise ConfigError(f"config key '{key}' must be set")
    return value


async def _run(config: RolloverConfig, shared_engine: Any = None) -> int:
    from rollover.controller import Controller
    from rollover.engine.vllm_engine import VLLMEngine
    from rollover.engine.watchdog import EngineWatchdog
    from rollover.gateway.client import GatewayClient
    from rollover.gateway.server import GatewayProcess
    from rollover.metrics import MetricsLogger
    from rollover.training.data import read_tasks
    from rollover.training.policy import Policy, pick_device
    from rollover.training.trainer import Trainer

    train_tasks = read_tasks(_required(config.data.train_files, "data.train_files"))
    val_tasks = read_tasks(config.data.val_files) if config.data.val_files else []
    model_path = _required(config.actor_rollout_ref.model.path, "actor_rollout_ref.model.path")
    if config.agentlightning.runner == "local":
        _required(config.agentlightning.local.agent_class, "agentlightning.local.agent_class")

    run_dir = prepare_run_dir(config)
    checkpoint = latest_checkpoint(run_dir) if config.resume else None
    if config.resume and checkpoint is None:
        print(f"resume=true but {run_dir} has no checkpoint: starting from the beginning", file=sys.stderr)
    if checkpoint is not None:
        model_path = str(checkpoint / "model")
    (run_dir / "config.yaml").write_text(dump_config(config))

    gateway = GatewayProcess(
        GatewaySettings.from_config(config, store=config.gateway.store_path(run_dir)), log_path=run_dir / "gateway.log"
    )
    admin_key = gateway.admin_key
    rollout = config.actor_rollout_ref.rollout
    device = pick_device(config.trainer.device).type
    engine = shared_engine or VLLMEngine(
        model_path,
        served_model_name=config.actor_rollout_ref.model.served_model_name,
        max_model_len=rollout.max_model_len,
        dtype=rollout.dtype,
        kv_cache_space_gb=rollout.kv_cache_space_gb,
        extra_args=rollout.engine_args,
        enforce_eager=rollout.enforce_eager,
        log_path=run_dir / "engine.log",
        start_timeout_s=rollout.start_timeout_seconds,
        device="cuda" if device == "cuda" else "cpu",
    )
    metrics = MetricsLogger(
        run_dir,
        config.trainer.logger,
        project=config.trainer.project_name,
        experiment=config.trainer.experiment_name,
        config=config.model_dump(mode="json"),
    )
    client: GatewayClient | None = None
    try:
        gateway.start()
        print(f"gateway {gateway.url}  run folder {run_dir}", file=sys.stderr, flush=True)
        if shared_engine is None:
            engine.start()
        policy = await asyncio.to_thread(Policy, model_path, config)
        if shared_engine is None:
            await asyncio.to_thread(engine.wait_ready)
        else:
            engine.attach_gateway(gateway.url, admin_key)  # not the previous run's gateway
            await engine.load_weights(model_path, version=0)
        client = GatewayClient(gateway.url, admin_key)
        async with Controller(config, client, log_dir=run_dir / "agent_logs"):
            engine_lock = asyncio.Lock()
            trainer = Trainer(
                config=config,
                client=client,
                policy=policy,
                weight_sync=EngineWeightSync(engine, run_dir / "weights", engine_lock),
                train_tasks=train_tasks,
                val_tasks=val_tasks,
                metrics=metrics,
                run_dir=run_dir,
            )
            if checkpoint is not None:
                _restore(trainer, policy, checkpoint)
                stranded = await trainer.reconcile_after_restart()
                print(
                    f"resumed {checkpoint.name}: step {trainer.global_step}, aborted {stranded} stranded rollouts",
                    file=sys.stderr,
                )
            engine.policy_version = trainer.policy_version
            engine.attach_gateway(gateway.url, admin_key)
            await engine.register_with_gateway(gateway.url, admin_key)
            watchdog = EngineWatchdog(engine, engine_lock, max_restarts=rollout.max_engine_restarts)
            await _until_first_done(trainer.fit(policy.optimizer), watchdog.run())
        summary = {k: v for k, v in trainer.history[-1].items()} if trainer.history else {}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return 0
    finally:
        metrics.close()
        if client is not None:
            await client.aclose()
        if shared_engine is None:
            engine.stop()
        else:
            engine.gateway_url = None  # this run's gateway is going away
        gateway.stop()


async def _until_first_done(main: Any, guard: Any) -> Any:
    """Run `main` with `guard` beside it; whichever ends first (the guard only by raising)
    ends the other. Returns `main`'s result."""
    main_task, guard_task = asyncio.ensure_future(main), asyncio.ensure_future(guard)
    try:
        await asyncio.wait({main_task, guard_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (main_task, guard_task):
            if not task.done():
                task.cancel()
        await asyncio.gather(main_task, guard_task, return_exceptions=True)
    if guard_task.done() and not guard_task.cancelled() and guard_task.exception() is not None:
        raise guard_task.exception()  # type: ignore[misc]
    return main_task.result()


def _restore(trainer: Any, policy: Any, checkpoint: Path) -> None:
    import torch

    trainer.load_state_dict(json.loads((checkpoint / "trainer_state.json").read_text()))
    optimizer_state = checkpoint / "optimizer.pt"
    if optimizer_state.is_file():
        policy.optimizer.load_state_dict(torch.load(optimizer_state, map_location=policy.device))


def example_main(config_path: str | Path, description: str | None = None, argv: list[str] | None = None) -> int:
    """The command line shared by the examples' `train_*_agent.py` scripts:
    `[--async] [--config C] [key=value ...]`, where `--async` sets the seed's recommended
    window, async_train_batch_size = 2 * train_batch_size."""
    import argparse

    from rollover.config import load_config

    root = Path(config_path).resolve().parents[2]
    # Agent processes import `examples.*` too, from wherever the script is run.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--async", dest="use_async", action="store_true", help="async rollout, window = 2 x batch")
    parser.add_argument("--config", default=str(config_path))
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        if args.use_async:
            config.agentlightning.async_rollout.enabled = True
            config.agentlightning.async_rollout.async_train_batch_size = 2 * config.data.train_batch_size
        return run_training(config)
    except (ConfigError, ValueError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
