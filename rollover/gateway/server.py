"""Running the gateway: in this process (`serve`), in a thread, or as a child process."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from rollover.gateway.app import create_app
from rollover.gateway.proxy import ProxySettings
from rollover.processes import die_with_parent, free_port
from rollover.store.sqlite import RolloutStore


def build_server(
    *,
    host: str,
    port: int,
    store_path: str,
    admin_key: str,
    settings: ProxySettings | None = None,
    max_body_bytes: int = 16 * 1024 * 1024,
    retry_after_seconds: float = 5,
    log_level: str = "warning",
) -> uvicorn.Server:
    store = RolloutStore(store_path)
    app = create_app(
        store,
        admin_key,
        settings=settings,
        max_body_bytes=max_body_bytes,
        retry_after_seconds=retry_after_seconds,
        close_store=True,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
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


class GatewayThread:
    """The gateway on a background thread of this process (tests, small demos)."""

    def __init__(
        self, store_path: str = ":memory:", admin_key: str = "admin", host: str = "127.0.0.1", port: int = 0, **kwargs
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.admin_key = admin_key
        self.server = build_server(host=host, port=self.port, store_path=store_path, admin_key=admin_key, **kwargs)
        self._thread = threading.Thread(target=self.server.run, name="rollover-gateway", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

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


class GatewayProcess:
    """The gateway as a child process (`rollover gateway ...`), so trainer work never blocks it."""

    def __init__(
        self,
        store_path: str,
        admin_key: str,
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | Path | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.store_path = store_path
        self.admin_key = admin_key
        self.host = host
        self.port = port or free_port(host)
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = extra_args or []
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> GatewayProcess:
        args = [
            sys.executable,
            "-m",
            "rollover.cli.main",
            "gateway",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--store",
            self.store_path,
            "--key",
            self.admin_key,
            *self.extra_args,
        ]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
        )
        if log is not subprocess.DEVNULL:
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
