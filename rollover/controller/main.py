"""`rollover controller --gateway URL --key K --runner local|k8s`: the controller on its own."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

from rollover.config import RolloverConfig
from rollover.controller.controller import Controller
from rollover.gateway.client import GatewayClient, GatewayError

log = logging.getLogger("rollover.controller")


async def serve(
    config: RolloverConfig,
    *,
    gateway_url: str,
    admin_key: str,
    log_dir: str | Path | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run until `stop` is set (by default: on SIGINT or SIGTERM), then stop every agent."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with GatewayClient(gateway_url, admin_key) as client:
            controller = Controller(config, client, log_dir=log_dir)
            await _check_gateway(client)
            async with controller:
                await stop.wait()
                log.info("stopping: ending every agent this controller started")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _check_gateway(client: GatewayClient) -> None:
    """A wrong key is a usage error; a gateway that is not up yet is not (the loop retries)."""
    if not await client.health():
        log.warning("the gateway at %s does not answer yet; the controller keeps trying", client.base_url)
        return
    try:
        await client.proxy_state()
    except GatewayError as exc:
        if exc.status_code in (401, 403):
            raise ValueError(f"the gateway at {client.base_url} rejected the admin key given with --key") from None
        raise


def run_controller(
    config: RolloverConfig, *, gateway_url: str, admin_key: str, log_dir: str | Path | None = None
) -> int:
    asyncio.run(serve(config, gateway_url=gateway_url, admin_key=admin_key, log_dir=log_dir))
    return 0
