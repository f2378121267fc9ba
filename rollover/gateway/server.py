"""Running the gateway: in this process (`build_server`), in a thread, or as a child process."""

from __future__ import annotations

import asyncio
import logging
import secrets
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
from rollover.gateway.connections import bounded_protocol
from rollover.gateway.keys import new_admin_key
from rollover.processes import die_with_parent, free_port, port_taken
from rollover.store.sqlite import RolloutStore

__all__ = [
    "GatewayDied",
    "GatewayProcess",
    "GatewayThread",
    "build_server",
    "free_port",
    "resolve",
    "wait_healthy",
]

log = logging.getLogger("rollover.gateway")

PORT_ATTEMPTS = 5  # ports tried when the one picked is taken before the gateway binds it


class GatewayDied(RuntimeError):
    """The gateway exited and could not be brought back."""


class PortTaken(GatewayDied):
    """Another server holds the gateway's port."""


def resolve(settings: GatewaySettings) -> GatewaySettings:
    """Settings with nothing left to pick: port 0 becomes a free port, a null admin key a
    generated one, a null store `:memory:` (`rollover train` and `rollover gateway` pass a file),
    a null instance token a new one."""
    gateway = settings.gateway
    resolved = settings.with_gateway(
        port=gateway.port or free_port(gateway.host),
        admin_key=gateway.admin_key or new_admin_key(),
        store=gateway.store or ":memory:",
    )
    return resolved if resolved.instance else resolved.model_copy(update={"instance": new_instance()})


def new_instance() -> str:
    return secrets.token_hex(8)


def build_server(settings: GatewaySettings, log_level: str | None = None) -> uvicorn.Server:
    """A uvicorn server for resolved `settings` (see `resolve`); `log_level` is uvicorn's."""
    gateway = settings.gateway
    if not gateway.port or not gateway.store:
        raise ValueError("build_server needs resolved settings: a port and a store (see resolve())")
    app = create_app(RolloutStore(gateway.store, synchronous=gateway.sqlite_synchronous), settings, close_store=True)
    config = uvicorn.Config(
        app,
        host=gateway.host,
        port=gateway.port,
        log_level=log_level or "warning",
        access_log=False,
        proxy_headers=False,  # no proxy in front of it: X-Forwarded-* would be parsed for nothing
        timeout_keep_alive=gateway.keep_alive_seconds,
        http=bounded_protocol(gateway.max_connections, gateway.header_timeout_seconds),
        backlog=4096,
    )
    return uvicorn.Server(config)


def wait_healthy(
    url: str, timeout: float = 30.0, process: subprocess.Popen | None = None, instance: str | None = None
) -> None:
    """Until `url/healthz` answers 200 and, given `instance`, echoes that token: a server that
    took the port first answers too, and is not ours."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"gateway exited with code {process.returncode} before it became healthy")
        try:
            response = httpx.get(f"{url}/healthz", timeout=1.0)
            if response.status_code == 200 and (instance is None or _instance_of(response) == instance):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"gateway at {url} not healthy after {timeout:.0f}s")


def _instance_of(response: httpx.Response) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get("instance") if isinstance(body, dict) else None


class _Resolved:
    """What a gateway thread and process share: resolved settings, and the URL they serve."""

    def __init__(self, settings: GatewaySettings | None, gateway: dict[str, Any]) -> None:
        base = (settings or GatewaySettings.from_config()).with_gateway(**gateway)
        self.port_picked = not base.gateway.port  # ours to change if another server takes it
        self.settings = resolve(base)

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
        wait_healthy(self.url, instance=self.settings.instance)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GatewayProcess(_Resolved):
    """The gateway as a child process (`rollover gateway --settings-stdin`), so trainer work
    never blocks it. `settings` and keyword arguments as for `GatewayThread`.

    The settings, admin key included, go to the child through a pipe on its stdin: nothing
    in its argv (which every local user can read in /proc/PID/cmdline) or its environment."""

    def __init__(
        self, settings: GatewaySettings | None = None, *, log_path: str | Path | None = None, **gateway: Any
    ) -> None:
        super().__init__(settings, gateway)
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> GatewayProcess:
        """Start the gateway and wait until it serves. A port it picked that another server
        takes first is given up for another (its readiness check knows its own server by the
        instance token); a port that was asked for, taken, raises `PortTaken`."""
        for attempt in range(PORT_ATTEMPTS):
            try:
                self._launch(timeout)
                return self
            except RuntimeError:
                if not port_taken(self.host, self.port):
                    raise
                if not self.port_picked or attempt == PORT_ATTEMPTS - 1:
                    raise PortTaken(
                        f"the gateway's port {self.port} on {self.host} is taken by another server"
                    ) from None
                self.settings = self.settings.with_gateway(port=free_port(self.host))
        raise AssertionError("unreachable")

    async def restart(self, timeout: float = 30.0) -> float:
        """Start it again after a crash: same port (agents hold its URL), same store and key;
        the new process takes the pause state and the models over from the store. Spawned on
        the caller's thread (the parent-death signal is tied to it), waited for on another.
        Returns the seconds it took."""
        started = time.monotonic()
        self.kill()
        self._spawn()
        await asyncio.to_thread(self._await_ready, timeout)
        return time.monotonic() - started

    def failure(self) -> str | None:
        """Why a started gateway is down (its exit code); None while it runs or before it started."""
        if self.process is None or self.process.poll() is None:
            return None
        code = self.process.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        where = f" (see {self.log_path})" if self.log_path else ""
        return f"gateway process {self.process.pid} {how}{where}"

    def _launch(self, timeout: float) -> None:
        self._spawn()
        self._await_ready(timeout)

    def _spawn(self) -> None:
        self.settings = self.settings.model_copy(update={"instance": new_instance()})
        args = [sys.executable, "-m", "rollover.cli.main", "gateway", "--settings-stdin"]
        log_file = open(self.log_path, "ab") if self.log_path else None
        try:
            self.process = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=log_file or subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
            assert self.process.stdin is not None  # a pipe, asked for above
            with self.process.stdin as pipe:
                pipe.write(self.settings.model_dump_json().encode())
        finally:
            if log_file is not None:
                log_file.close()

    def _await_ready(self, timeout: float) -> None:
        try:
            wait_healthy(self.url, timeout, self.process, self.settings.instance)
        except TimeoutError:
            self.kill()
            raise

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


class GatewayWatchdog:
    """Keeps a `GatewayProcess` serving through a crash: restarts it on the same port and
    store, at most `max_restarts` times. Meanwhile agents (their OpenAI clients, the SDK's
    events), the controller and the trainer (`GatewayClient`) retry the calls it refuses."""

    def __init__(
        self, gateway: GatewayProcess, *, max_restarts: int, interval: float = 1.0, start_timeout: float = 30.0
    ) -> None:
        self.gateway = gateway
        self.max_restarts = max_restarts
        self.interval = interval
        self.start_timeout = start_timeout
        self.restarts = 0

    async def check(self) -> bool:
        """Restart the gateway if it died; True if it did. Raises `GatewayDied` once
        `max_restarts` restarts are used up (the run then ends with that one line)."""
        failure = self.gateway.failure()
        if failure is None:
            return False
        while True:
            if self.restarts >= self.max_restarts:
                raise GatewayDied(
                    f"the gateway died and {self.restarts} restart(s) did not bring it back "
                    f"(gateway.max_restarts={self.max_restarts}): {failure}"
                )
            self.restarts += 1
            log.error(
                "the gateway died; restarting it on %s (%d of %d): %s",
                self.gateway.url,
                self.restarts,
                self.max_restarts,
                failure,
            )
            try:
                seconds = await self.gateway.restart(self.start_timeout)
            except (RuntimeError, TimeoutError) as exc:
                taken = port_taken(self.gateway.host, self.gateway.port)
                failure = f"port {self.gateway.port} is taken by another server" if taken else f"restart failed: {exc}"
                continue
            log.warning("the gateway is back after %.1f s", seconds)
            return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check()
