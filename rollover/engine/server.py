"""vLLM's OpenAI-compatible server as a child process that Rollover owns: its command line and
environment, start (a free port, readiness), stop (the whole process tree), and its health.

The process tree: a small supervisor (process-group leader, `rollover.engine.supervisor`) ->
vLLM API server -> engine core -> worker. The server runs with `VLLM_SERVER_DEV_MODE=1`, which
exposes the management endpoints the engine's weight loads use (`rollover.engine.vllm_engine`).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
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

from rollover.engine.images import image_limit
from rollover.engine.tool_calls import resolve_tool_call_parser
from rollover.processes import child_pids, free_port, port_taken, stop_supervised_group, tail_lines

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rollover.engine.weights.RolloverWorkerExtension"
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
    ) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.model_dir = Path(model_dir).absolute()
        self.host = host
        self.port_picked = not port  # ours to change if another server takes it first
        self.port = port or free_port(host)
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
    def server_url(self) -> str:
        """Root of the server (management endpoints live here)."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenAI base URL (what an OpenAI client and the gateway's upstream use)."""
        return f"{self.server_url}/v1"

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
            "--host",
            self.host,
            "--port",
            str(self.port),
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
        )
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_space_gb)
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
            self.instance_name = f"rollover-{secrets.token_hex(6)}"
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
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                env=self._env(),
                start_new_session=True,  # own process group: stop() signals all of it
                close_fds=True,
            )
            log.info("vLLM pid %d on %s, log %s", self._proc.pid, self.base_url, self.log_path)

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
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    if not port_taken(self.host, self.port):
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
                try:
                    if client.get(f"{self.server_url}/health").status_code == 200:
                        models = client.get(f"{self.base_url}/models")
                        ids = [m["id"] for m in models.json().get("data", [])]
                        if models.status_code == 200 and self.instance_name in ids:
                            break
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise self._fail_start(f"vLLM was not ready after {limit:.0f} s")
                time.sleep(0.5)
        self.start_seconds = time.monotonic() - self._started_at
        log.info("vLLM ready in %.1f s", self.start_seconds)
        return self.start_seconds

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
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            resp = await client.post(f"{self.server_url}{path}", json=json, params=params)
        return self._check(resp, f"POST {path}")

    async def health(self) -> bool:
        """True if the server answers `/health` now (a stronger check than `is_alive`)."""
        if not self.is_alive():
            return False
        try:
            async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
                return (await client.get(f"{self.server_url}/health")).status_code == 200
        except httpx.HTTPError:
            return False
