"""Implementations of the `rollover` subcommands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollover.config import ConfigError


class UsageError(Exception):
    """A bad config or argument: printed as one line, exit code 2."""


def gateway(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from rollover.config import GatewaySettings, load_config
    from rollover.gateway.server import build_server, resolve

    flags = {"host": args.host, "port": args.port, "store": args.store, "admin_key": args.key}
    try:
        if args.settings_stdin:
            if args.config or args.overrides:
                raise UsageError("--settings-stdin is the whole settings: no --config or key=value overrides with it")
            settings = GatewaySettings.model_validate_json(sys.stdin.buffer.read())
        else:
            settings = GatewaySettings.from_config(load_config(args.config, args.overrides))
            settings = settings.with_gateway(store=settings.gateway.store_path("."))
        settings = settings.with_gateway(**{key: value for key, value in flags.items() if value is not None})
    except (ConfigError, ValidationError) as exc:
        raise UsageError(str(exc)) from None
    generated_key = settings.gateway.admin_key is None
    settings = resolve(settings)
    if generated_key:
        print(f"admin key: {settings.gateway.admin_key}", file=sys.stderr, flush=True)
    server = build_server(settings, log_level=args.log_level)
    print(f"gateway http://{settings.gateway.host}:{settings.gateway.port}", file=sys.stderr, flush=True)
    server.run()
    return 0


def config_defaults(args: argparse.Namespace) -> int:
    from rollover.config_yaml import config_yaml

    sys.stdout.write(config_yaml())
    return 0


def config_show(args: argparse.Namespace) -> int:
    from rollover.config import load_config
    from rollover.config_yaml import config_yaml

    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not Path(path).is_file():
        path, overrides = None, [path, *overrides]  # `rollover config show key=value ...`
    try:
        config = load_config(path, overrides)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    layers = " <- ".join(["defaults", *([path] if path else []), *(["overrides"] if overrides else [])])
    sys.stdout.write(config_yaml(config, header=f"# {layers}, validated (rollover config show)\n"))
    return 0


def train(args: argparse.Namespace) -> int:
    from rollover.cli.logs import configure_logging
    from rollover.config import load_config

    try:
        config = load_config(args.config, args.overrides)
    except (ConfigError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    # Only now: a bad config is reported without first importing torch (seconds).
    from rollover.distributed.world import World

    if World.from_env().distributed:
        from rollover.ranks.rank import exit_rank
        from rollover.ranks.rank import main as rank_main

        configure_logging()
        exit_rank(rank_main([*([args.config] if args.config else []), *args.overrides]))
    if config.world_size > 1:
        if config.trainer.nnodes > 1:
            raise UsageError(
                f"trainer.nnodes={config.trainer.nnodes}: start every node with torchrun "
                f"--nnodes {config.trainer.nnodes} --nproc-per-node {config.trainer.n_gpus_per_node} "
                "--rdzv-backend c10d --rdzv-endpoint HOST:PORT -m rollover.ranks CONFIG [key=value ...]"
            )
        from rollover.ranks.launcher import launch_single_node

        return launch_single_node(config.trainer.n_gpus_per_node, args.config, args.overrides)
    from rollover.launch import run_training_reporting_errors

    configure_logging()
    try:
        return run_training_reporting_errors(config, World())
    except (ConfigError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def controller(args: argparse.Namespace) -> int:
    from rollover.cli.keys import CONTROLLER_KEY_ENV, read_key
    from rollover.cli.logs import CONTROLLER_FORMAT, configure_logging
    from rollover.config import load_config
    from rollover.controller.main import run_controller

    try:
        key = read_key(args.key, args.key_file, CONTROLLER_KEY_ENV)
        if key is None:
            raise UsageError(
                f"the gateway's admin key is needed: --key-file PATH (mode 600), ${CONTROLLER_KEY_ENV}, or --key - (stdin)"
            )
        config = load_config(args.config, [*args.overrides, f"agentlightning.runner={args.runner}"])
        configure_logging(CONTROLLER_FORMAT, quiet_httpx=False)
        return run_controller(config, gateway_url=args.gateway, admin_key=key, log_dir=args.log_dir)
    except (ConfigError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def engine_key(args: argparse.Namespace) -> int:
    """Print the key the gateway sends every engine it calls (`Authorization: Bearer`), from its
    admin key: what an engine you start yourself and register by URL takes as its `--api-key`."""
    from rollover.cli.keys import CONTROLLER_KEY_ENV, read_key
    from rollover.gateway.keys import upstream_key

    key = read_key(args.key, args.key_file, CONTROLLER_KEY_ENV)
    if key is None:
        raise UsageError(
            f"the gateway's admin key is needed: --key-file PATH (mode 600), ${CONTROLLER_KEY_ENV}, or --key - (stdin)"
        )
    print(upstream_key(key))
    return 0


def model_tiny(args: argparse.Namespace) -> int:
    from rollover.modelzoo.tiny import build_tiny_model

    corpus = None
    if args.corpus:
        with open(args.corpus) as handle:
            corpus = handle.read().splitlines()
    path = build_tiny_model(args.out, arch=args.arch, corpus=corpus, seed=args.seed)
    print(path)
    return 0


def model_tiny_vl(args: argparse.Namespace) -> int:
    from rollover.modelzoo.tiny_vl import build_tiny_vl_model

    print(build_tiny_vl_model(args.out, seed=args.seed, max_image_tokens=args.max_image_tokens))
    return 0


def model_smollm2(args: argparse.Namespace) -> int:
    from rollover.modelzoo.smollm2 import convert_smollm2

    print(convert_smollm2(args.out, dtype=args.dtype))
    return 0


def model_warmup(args: argparse.Namespace) -> int:
    from rollover.modelzoo.warmup import read_chat_jsonl, sft_warmup

    metrics = sft_warmup(
        args.model,
        read_chat_jsonl(args.data),
        args.out,
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    print(metrics)
    return 0


def model_merge(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rollover import adapter_folder
    from rollover.training import lora

    given = Path(args.checkpoint)
    adapter = next((d for d in (given, given / "model") if adapter_folder.is_adapter(d)), None)
    policies = {
        name: d for folder in (given, given / "model") for name, d in adapter_folder.policy_adapters(folder).items()
    }
    if adapter is None and policies:  # a run of several policies: one is merged at a time
        if args.policy is None:
            raise UsageError(
                f"{given} holds the adapters of several policies: pass --policy, one of {sorted(policies)}"
            )
        if args.policy not in policies:
            raise UsageError(f"{given} has no policy {args.policy!r}: its policies are {sorted(policies)}")
        adapter = policies[args.policy]
    elif args.policy is not None:
        raise UsageError(f"{given} holds the adapter of a run with one policy: leave --policy out")
    if adapter is None:
        raise UsageError(
            f"{given} holds no LoRA adapter (no {adapter_folder.ADAPTER_CONFIG} in it or in {given / 'model'})"
        )
    try:
        print(lora.merge(adapter, args.out))
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    return 0


def simulate(args: argparse.Namespace) -> int:
    from rollover.simulate.cli import main as simulate_main

    return simulate_main(args.args)


def report(args: argparse.Namespace) -> int:
    from rollover.metrics.report import ReportError, summary_text, write_report

    try:
        print(write_report(args.run_dir, args.out))
        print(summary_text(args.run_dir))
    except ReportError as exc:
        raise UsageError(str(exc)) from None
    return 0


def view(args: argparse.Namespace) -> int:
    from rollover.cli.keys import VIEWER_KEY_ENV, read_key
    from rollover.viewer.app import serve
    from rollover.viewer.data import RunFolderError

    try:
        key = read_key(args.key, args.key_file, VIEWER_KEY_ENV)
        serve(
            args.run_dir,
            host=args.host,
            port=args.port,
            key=key,
            tokenizer=args.tokenizer,
            allowed_hosts=tuple(args.allow_host),
        )
    except (RunFolderError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    return 0
