"""Implementations of the `rollover` subcommands."""

from __future__ import annotations

import argparse
import sys

from rollover.config import ConfigError


class UsageError(Exception):
    """A bad config or argument: printed as one line, exit code 2."""


def gateway(args: argparse.Namespace) -> int:
    from rollover.gateway.auth import new_admin_key
    from rollover.gateway.proxy import ProxySettings
    from rollover.gateway.server import build_server

    key = args.key
    if not key:
        key = new_admin_key()
        print(f"admin key: {key}", file=sys.stderr, flush=True)
    settings = ProxySettings(
        train_temperature=args.train_temperature,
        val_temperature=args.val_temperature,
        upstream_timeout_seconds=args.upstream_timeout,
        upstream_retries=args.upstream_retries,
    )
    server = build_server(
        host=args.host,
        port=args.port,
        store_path=args.store,
        admin_key=key,
        settings=settings,
        max_body_bytes=args.max_body_bytes,
        retry_after_seconds=args.retry_after,
        log_level=args.log_level,
    )
    server.run()
    return 0


def train(args: argparse.Namespace) -> int:
    from rollover.config import load_config
    from rollover.engine.vllm_engine import EngineError
    from rollover.training.run import run_training

    try:
        config = load_config(args.config, args.overrides)
        return run_training(config)
    except (ConfigError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    except EngineError as exc:
        print(f"rollover train: the inference engine failed: {exc}", file=sys.stderr)
        return 1


def controller(args: argparse.Namespace) -> int:
    from rollover.config import load_config
    from rollover.controller.main import run_controller

    try:
        config = load_config(args.config, [*args.overrides, f"agentlightning.runner={args.runner}"])
        return run_controller(config, gateway_url=args.gateway, admin_key=args.key, log_dir=args.log_dir)
    except (ConfigError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def model_tiny(args: argparse.Namespace) -> int:
    from rollover.modelzoo.tiny import build_tiny_model

    corpus = None
    if args.corpus:
        with open(args.corpus) as handle:
            corpus = handle.read().splitlines()
    path = build_tiny_model(args.out, arch=args.arch, corpus=corpus, seed=args.seed)
    print(path)
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


def simulate(args: argparse.Namespace) -> int:
    from rollover.training.simulate import main as simulate_main

    return simulate_main(args.args)


def report(args: argparse.Namespace) -> int:
    from rollover.metrics.report import ReportError, write_report

    try:
        print(write_report(args.run_dir, args.out))
    except ReportError as exc:
        raise UsageError(str(exc)) from None
    return 0
