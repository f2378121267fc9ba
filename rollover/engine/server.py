"""vLLM's OpenAI-compatible server as a child process that Rollover owns: its command line and
environment, start (its socket or a free port, readiness), stop (the whole process tree), its
health, and how its owner and the gateway reach it.

The process tree: a small supervisor (process-group leader, `rollover.engine.supervisor`) ->
vLLM API server -> engine core -> worker. The server runs with `VLLM_SERVER_DEV_MODE=1`, which
exposes the management endpoints the engine's weight loads use (`rollover.engine.vllm_engine`).

Only its owner and the gateway reach it. It listens on a Unix socket in a private (0700)
folder of its own, or, for an engine the gateway reaches over the network (another node's), on
TCP; either way every route asks for a key (`rollover.engine.guard`): the owner's opens all of
them, the gateway's only generation. `client()` and `async_client()` are the owner's way in.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import httpx

from rollover.endpoints import MAX_SOCKET_PATH_BYTES, client_tls, unix_endpoint
from rollover.engine.guard import GRANT_PATH
from rollover.engine.images import image_limit
from rollover.engine.tool_calls import resolve_tool_call_parser
from rollover.processes import child_pids, free_port, port_taken, stop_supervised_group, tail_lines

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rollover.engine.weights.RolloverWorkerExtension"
GUARD = "rollover.engine.guard.EngineGuard"
PORT_ATTEMPTS = 5  # ports tried when the one picked is taken before vLLM binds it


_LAUNCHER_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT"}
)


class EngineError(RuntimeError):
    """The engine refused or failed an operation."""


class EngineStartError(EngineError):
    """The server exited or did not become ready; carries its exit code and log tail."""

    def __init__(self, message: str, *, exit_code: int | None, log_tail: str) -> None:
        super().__init__(f"{message}\n--- last lines of the vLLM log ---\n{log_tail}")
        self.exit_code = exit_code
        self.log_tail = log_tail


class VLLMServer:
    """vLLM's OpenAI server as a child process.

    `start()` spawns it; `wait_ready()` blocks until it serves; `stop()` ends it and all of
    its processes. As a context manager it does all three. What it serves, and how a new
    policy gets in, is `VLLMEngine`'s.

    `unix_socket` (the default): it listens on `socket_path`, in a 0700 folder of its own under
    the temporary folder (the same one across restarts, removed by `stop()`), and the gateway
    on this machine calls it at `base_url`, an `http+unix://` URL. Otherwise it listens on TCP
    at `host`:`port` (another node's engine, which the gateway reaches over the network).

    The parent-death signal is tied to the thread that calls `start()`: call it from the
    main thread or from one that lives as long as the server.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        served_model_name: str = "policy",
        max_model_len: int = 1024,
        dtype: str = "float32",
        kv_cache_space_gb: float = 1,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
        start_timeout_s: float = 300,
        device: Literal["cpu", "cuda"] = "cpu",
        gpu_memory_utilization: float | None = None,
        enable_sleep_mode: bool | None = None,
        env: dict[str, str] | None = None,
        worker_extension: bool = True,
        stop_grace_s: float = 5.0,
        enforce_eager: bool = False,
        logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "processed_logprobs",
        tool_call_parser: str | None = "auto",
        worker_in_engine_core: bool | None = None,
        limit_images: int | None = None,
        unix_socket: bool = True,
    ) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.model_dir = Path(model_dir).absolute()
        # Its sockets (the server's, and vLLM's own between its processes: VLLM_RPC_BASE_PATH).
        self.private_dir = Path(tempfile.gettempdir()) / f"rollover-engine-{secrets.token_hex(6)}"
        self.socket_path = self.private_dir / "engine.sock" if unix_socket else None
        if self.socket_path is not None and len(str(self.socket_path).encode()) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"the engine's socket path {self.socket_path} is longer than a Unix socket's "
                f"{MAX_SOCKET_PATH_BYTES} bytes: point TMPDIR at a shorter folder"
            )
        # The owner's key: every route opens to it (given to the server on its stdin).
        self._key = secrets.token_urlsafe(32)
        self._opened_to: str | None = None  # the gateway key the running server opens generation to
        self.host = host
        self.port_picked = not port and not unix_socket  # ours to change if another server takes it first
        self.port = port or (0 if unix_socket else free_port(host))
        self.served_model_name = served_model_name
        # A second served name, new at every start: readiness waits for a server that lists
        # it, so another server that took the port is never taken for ours.
        self.instance_name = ""
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.kv_cache_space_gb = kv_cache_space_gb
        self.extra_args = tuple(extra_args)
        # Images per prompt (0: the model reads text only); the gateway refuses more with 400.
        self.max_images, self.image_args = image_limit(self.model_dir, limit_images, self.extra_args)
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        # Eager mode skips torch.compile: ~10 s faster start on CPU, slower decoding.
        self.enforce_eager = enforce_eager
        # processed (the default): after temperature/top-k/top-p, i.e. the distribution
        # sampled from, the behaviour policy μ; the trainer divides its logits by the same
        # temperature, so μ and π_old share a basis at any T (the gateway forces top-k/top-p
        # off in train mode). raw: log-softmax of the model's logits, a T=1 basis.
        self.logprobs_mode = logprobs_mode
        # Agent frameworks send `tools` and read `tool_calls`: vLLM parses them out of the text.
        self.tool_call_parser = (
            None if "--tool-call-parser" in self.extra_args else resolve_tool_call_parser(tool_call_parser, model_dir)
        )
        self.device = device
        # On CPU vLLM runs its one worker in a process of its own, pinned to one core with the
        # other reserved; run in the engine core's process instead (measured here, tiny model,
        # 2 cores: ready in 22 s instead of 41 s, 64 x 64 tokens at 16 concurrent in 6.6 s
        # instead of 13.4 s). None = on for CPU; GPU keeps vLLM's own executor.
        self.worker_in_engine_core = (
            (device == "cpu" and "--distributed-executor-backend" not in self.extra_args)
            if worker_in_engine_core is None
            else worker_in_engine_core
        )
        self.gpu_memory_utilization = gpu_memory_utilization
        # Sleep mode is what frees GPU memory for the collocated trainer; vLLM's CPU
        # backend has nothing to free, so it is off there.
        self.enable_sleep_mode = (device == "cuda") if enable_sleep_mode is None else enable_sleep_mode
        self.extra_env = dict(env or {})
        # Our worker extension fixes tied LM heads after a reload (see
        # RolloverWorkerExtension); a caller that brings its own extension loses that.
        self.worker_extension = worker_extension and "--worker-extension-cls" not in self.extra_args
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="rollover-vllm-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._lock = threading.Lock()
        self.start_seconds: float | None = None
        self._started_at = 0.0

    # ---------------------------------------------------------------- addresses

    @property
    def base_url(self) -> str:
        """The OpenAI base URL the gateway registers and calls (`rollover.endpoints`: an
        `http+unix://` URL for an engine on a socket)."""
        if self.socket_path is not None:
            return unix_endpoint(self.socket_path, "/v1")
        return f"http://{self.host}:{self.port}/v1"

    def client(self, timeout: float = 30.0) -> httpx.Client:
        """An HTTP client to the server's root with the owner's key, which opens every route
        (management at the root, OpenAI's under /v1): how its owner, and tests, call it."""
        transport = (
            httpx.HTTPTransport(uds=str(self.socket_path), verify=client_tls())
            if self.socket_path is not None
            else None
        )
        return httpx.Client(transport=transport, **self._client_options(timeout))

    def async_client(self, timeout: float = 30.0) -> httpx.AsyncClient:
        """`client()`, for asyncio."""
        transport = (
            httpx.AsyncHTTPTransport(uds=str(self.socket_path), verify=client_tls())
            if self.socket_path is not None
            else None
        )
        return httpx.AsyncClient(transport=transport, **self._client_options(timeout))

    def _client_options(self, timeout: float) -> dict[str, Any]:
        return {
            "base_url": self._root,
            "headers": self._auth,
            "timeout": timeout,
            "trust_env": False,
            "verify": client_tls(),
        }

    @property
    def _root(self) -> str:
        return "http://localhost" if self.socket_path is not None else f"http://{self.host}:{self.port}"

    @property
    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._key}"}

    @property
    def pid(self) -> int | None:
        """The supervisor's pid, which is also the process group id of all of vLLM."""
        return self._proc.pid if self._proc is not None else None

    @property
    def server_pid(self) -> int | None:
        """The vLLM API server's pid (the supervisor's child), once it exists."""
        if self._proc is None:
            return None
        children = child_pids(self._proc.pid)
        return children[0] if children else None

    # ---------------------------------------------------------------- lifecycle

    def command(self) -> list[str]:
        """The argv that starts the server (the `vllm` console script is not used)."""
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            *([self.instance_name] if self.instance_name else []),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            *(
                ["--uds", str(self.socket_path)]
                if self.socket_path is not None
                else ["--host", self.host, "--port", str(self.port)]
            ),
            "--middleware",
            GUARD,
        ]
        if self.device == "cuda" and self.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.enable_sleep_mode:
            args.append("--enable-sleep-mode")
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.logprobs_mode != "raw_logprobs":
            args += ["--logprobs-mode", self.logprobs_mode]
        if self.worker_extension:
            args += ["--worker-extension-cls", WORKER_EXTENSION]
        if self.tool_call_parser is not None:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.worker_in_engine_core:
            args += ["--distributed-executor-backend", "uni"]
        return args + list(self.image_args) + list(self.extra_args)

    def _env(self) -> dict[str, str]:
        # A trainer rank's launcher variables would make vLLM think it is one of its ranks.
        env = {
            k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")
        }
        env.update(
            VLLM_SERVER_DEV_MODE="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
            VLLM_RPC_BASE_PATH=str(self.private_dir),
        )
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_space_gb)
            # OpenMP threads that sleep at a barrier rather than spin: the engine shares the
            # cores with the trainer and the agents, and a thread spinning while its partner
            # waits for a core stalls every op (32 SmolLM2 tokens: 18-36 s spinning, 4-4.5 s
            # passive, 2 cores at load 3-6). vLLM's own cut to one thread is skipped on CPU.
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if self.worker_in_engine_core:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # without it vLLM's CPU platform forces "mp"
        # vLLM's worker imports our extension: make this checkout importable there even
        # when rollover is not pip-installed.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        """Spawn the server (returns at once; see `wait_ready`)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                raise EngineError("engine already running")
            if not (self.model_dir / "config.json").is_file():
                raise EngineStartError(
                    f"{self.model_dir} is not a model folder (no config.json)",
                    exit_code=None,
                    log_tail="",
                )
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._make_private_dir()
            if self.socket_path is not None:
                self.socket_path.unlink(missing_ok=True)  # the last start's: vLLM binds, never replaces
            self.instance_name = f"rollover-{secrets.token_hex(6)}"
            self._opened_to = None
            self._log_file = open(self.log_path, "ab")
            self._log_file.write(f"$ {' '.join(self.command())}\n".encode())
            self._log_file.flush()
            self._started_at = time.monotonic()
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rollover.engine.supervisor",
                    str(os.getpid()),
                    str(self.stop_grace_s),
                    "--",
                    *self.command(),
                ],
                stdin=subprocess.PIPE,  # the owner's key, read by the server's guard
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                env=self._env(),
                start_new_session=True,  # own process group: stop() signals all of it
                close_fds=True,
            )
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(f"{self._key}\n".encode())
                self._proc.stdin.close()
            except OSError:
                pass  # it died at once: wait_ready says why
            log.info("vLLM pid %d on %s, log %s", self._proc.pid, self.base_url, self.log_path)

    def _make_private_dir(self) -> None:
        """The folder of the engine's sockets: made 0700, or the one made at an earlier start,
        if it is still this user's own and closed to others."""
        try:
            self.private_dir.mkdir(mode=0o700)
        except FileExistsError:
            info = self.private_dir.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                raise EngineStartError(
                    f"{self.private_dir} exists and is not this engine's private folder", exit_code=None, log_tail=""
                ) from None

    def _fail_start(self, message: str) -> EngineStartError:
        code = self._proc.poll() if self._proc is not None else None
        self.stop()
        return EngineStartError(message, exit_code=code, log_tail=tail_lines(self.log_path, 40))

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Block until `/health` and `/v1/models` answer, the models listing this start's
        `instance_name` (the server on the port is ours); return seconds since `start()`.

        A port this engine picked that another server took before vLLM bound it is given up
        for another, and vLLM started again there (from this thread: call it from one that
        lives as long as the engine, as for `start`). Raises `EngineStartError` (and stops
        the engine) if the process exits otherwise or the deadline passes.
        """
        if self._proc is None:
            raise EngineError("engine not started")
        limit = self.start_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        ports_tried = 1
        while True:
            code = self._proc.poll()
            if code is not None:
                if self.socket_path is not None or not port_taken(self.host, self.port):
                    raise self._fail_start(f"vLLM exited with code {code} before it was ready")
                if not self.port_picked or ports_tried >= PORT_ATTEMPTS:
                    raise self._fail_start(f"vLLM's port {self.port} on {self.host} is taken by another server")
                taken, ports_tried = self.port, ports_tried + 1
                self.stop()
                self.port = free_port(self.host)
                log.warning("vLLM's port %d was taken by another server; starting it on %d", taken, self.port)
                self.start()
                deadline = time.monotonic() + limit
                continue
            if self._serves_this_start():
                break
            if time.monotonic() > deadline:
                raise self._fail_start(f"vLLM was not ready after {limit:.0f} s")
            time.sleep(0.5)
        self.start_seconds = time.monotonic() - self._started_at
        log.info("vLLM ready in %.1f s", self.start_seconds)
        return self.start_seconds

    def _serves_this_start(self) -> bool:
        """`/health` answers, and `/v1/models` lists this start's `instance_name` (at the
        address of now: a port given up for another is not asked again)."""
        try:
            with self.client(timeout=5.0) as client:
                if client.get("/health").status_code != 200:
                    return False
                models = client.get("/v1/models")
                ids = [m["id"] for m in models.json().get("data", [])]
                return models.status_code == 200 and self.instance_name in ids
        except (httpx.HTTPError, ValueError, TypeError, AttributeError):
            return False

    def is_alive(self) -> bool:
        """True while the server process runs (it may still be starting)."""
        return self._proc is not None and self._proc.poll() is None

    def failure(self) -> str | None:
        """Why a started engine is down (exit code and the tail of its log); None while it
        runs or before it was started."""
        if self._proc is None or self._proc.poll() is None:
            return None
        return f"vLLM exited with code {self._proc.returncode}; last lines of {self.log_path}:\n{tail_lines(self.log_path, 20)}"

    def stop(self, grace_s: float | None = None) -> None:
        """Stop vLLM: SIGTERM to the supervisor (it stops the server, which stops its
        engine and workers, then sweeps the process group); SIGKILL to the group for
        whatever is left after `grace_s` (default `stop_grace_s`) plus the sweep wait.

        Idempotent (see `stop_supervised_group`).
        """
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        with self._lock:
            proc, self._proc = self._proc, None
            # 3 s more: the supervisor's own sweep wait.
            if proc is not None and not stop_supervised_group(proc, grace_s + 3):
                log.warning("vLLM did not exit within %.0f s of SIGTERM; killed", grace_s)
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
            shutil.rmtree(self.private_dir, ignore_errors=True)

    def __enter__(self) -> VLLMServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass

    # ---------------------------------------------------------------- management calls

    @staticmethod
    def _check(resp: httpx.Response, what: str) -> httpx.Response:
        if resp.status_code >= 400:
            raise EngineError(f"{what} failed: HTTP {resp.status_code}: {resp.text[:2000]}")
        return resp

    async def _post(self, path: str, *, json: Any = None, params: Any = None, timeout: float = 600.0) -> httpx.Response:
        if not self.is_alive():
            raise EngineError(f"engine is not running (POST {path})")
        async with self.async_client(timeout) as client:
            resp = await client.post(path, json=json, params=params)
        return self._check(resp, f"POST {path}")

    async def open_to_gateway(self, key: str) -> None:
        """Open the server's generation routes to the gateway that sends `key`
        (`rollover.gateway.keys.upstream_key`), in place of the one they were open to."""
        if key != self._opened_to:
            await self._post(GRANT_PATH, json={"key": key}, timeout=30.0)
            self._opened_to = key

    async def health(self) -> bool:
        """True if the server answers `/health` now (a stronger check than `is_alive`)."""
        if not self.is_alive():
            return False
        try:
            async with self.async_client(5.0) as client:
                return (await client.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False
