"""Running the gateway: in this process (`build_server`), in a thread, or as a child process."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from rollover.config import GatewaySettings
from rollover.gateway.app import create_app
from rollover.gateway.auth import new_admin_key
from rollover.processes import die_with_parent, free_port
from rollover.store.sqlite import RolloutStore

__all__ = ["GatewayProcess", "GatewayThread", "build_server", "free_port", "resolve", "wait_healthy"]


def resolve(settings: GatewaySettings) -> GatewaySettings:
    """Settings with nothing left to pick: port 0 becomes a free port, a null admin key a
    generated one, a null store `:memory:` (`rollover train` and `rollover gateway` pass a file)."""
    gateway = settings.gateway
    return settings.with_gateway(
        port=gateway.port or free_port(gateway.host),
        admin_key=gateway.admin_key or new_admin_key(),
        store=gateway.store or ":memory:",
    )


def build_server(settings: GatewaySettings, log_level: str | None = None) -> uvicorn.Server:
    """A uvicorn server for resolved `settings` (see `resolve`); `log_level` is uvicorn's."""
    gateway = settings.gateway
    if not gateway.port or not gateway.store:
        raise ValueError("build_server needs resolved settings: a port and a store (see resolve())")
    app = create_app(RolloutStore(gateway.store), settings, close_store=True)
    config = uvicorn.Config(
        app,
        host=gateway.host,
        port=gateway.port,
        log_level=log_level or "warning",
        access_log=False,
        timeout_keep_alive=30,
        backlog=4096,
    )
    return uvicorn.Server(config)


def wait_healthy(url: str, timeout: float = 30.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"gateway exited with code {process.returncode} before it became healthy")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"gateway at {url} not healthy after {timeout:.0f}s")


class _Resolved:
    """What a gateway thread and process share: resolved settings, and the URL they serve."""

    def __init__(self, settings: GatewaySettings | None, gateway: dict[str, Any]) -> None:
        base = settings or GatewaySettings.from_config()
        self.settings = resolve(base.with_gateway(**gateway))

    @property
    def host(self) -> str:
        return self.settings.gateway.host

    @property
    def port(self) -> int:
        return self.settings.gateway.port

    @property
    def admin_key(self) -> str:
        key = self.settings.gateway.admin_key
        assert key is not None  # resolved
        return key

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class GatewayThread(_Resolved):
    """The gateway on a background thread of this process (tests, small demos).

    `settings` default to the config's defaults; keyword arguments replace keys of their
    `gateway` section (`GatewayThread(admin_key="k", max_body_bytes=1000)`); see `resolve`."""

    def __init__(self, settings: GatewaySettings | None = None, **gateway: Any) -> None:
        super().__init__(settings, gateway)
        self.server = build_server(self.settings)
        self._thread = threading.Thread(target=self.server.run, name="rollover-gateway", daemon=True)

    def start(self) -> GatewayThread:
        self._thread.start()
        wait_healthy(self.url)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GatewayProcess(_Resolved):
    """The gateway as a child process (`rollover gateway --settings JSON`), so trainer work
    never blocks it. `settings` and keyword arguments as for `GatewayThread`."""

    def __init__(
        self, settings: GatewaySettings | None = None, *, log_path: str | Path | None = None, **gateway: Any
    ) -> None:
        super().__init__(settings, gateway)
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> GatewayProcess:
        args = [sys.executable, "-m", "rollover.cli.main", "gateway", "--settings", self.settings.model_dump_json()]
        log = open(self.log_path, "ab") if self.log_path else None
        try:
            self.process = subprocess.Popen(
                args,
                stdout=log or subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        finally:
            if log is not None:
                log.close()
        wait_healthy(self.url, timeout, self.process)
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, grace: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
