"""An engine: vLLM's server (`rollover.engine.server`) and the policy it serves, its weights
or LoRA adapters, their version, and the gateway's registration of it.

The server runs with `VLLM_SERVER_DEV_MODE=1`, which exposes the management endpoints we use
for weight sync: `POST /collective_rpc` (method `rollover_reload_weights` from our worker
extension, or vLLM's own `reload_weights`), `POST /reset_prefix_cache`, on GPU `POST /sleep` /
`POST /wake_up`, and for partial rollout `POST /pause?mode=keep` / `POST /resume` (vLLM's RL
endpoints: requests frozen in the scheduler across a weight load). Every load bumps the policy
version and re-registers the engine with the gateway, so each recorded call carries the version
that produced it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from rollover.adapter_folder import policy_adapters
from rollover.engine.server import EngineError, VLLMServer
from rollover.gateway.client import GatewayClient, GatewayError, NotFoundError, is_transient
from rollover.gateway.keys import upstream_key
from rollover.retry import RetryPolicy, call_with_retries

log = logging.getLogger(__name__)


class GatewayRegistrationError(EngineError):
    """`POST /api/models` on the gateway failed (after retries)."""


class _PrefixCacheBusy(Exception):
    """vLLM kept cached blocks because requests still hold them."""


class VLLMEngine(VLLMServer):
    """vLLM's server with the policy it serves: weight reload, LoRA adapters and gateway
    registration.

    Weight sync: `save_weights()` from `rollover.engine.weights`, then `load_weights(dir)`;
    each load bumps `policy_version` and, when `attach_gateway()` was called, re-registers the
    endpoint with the gateway so every recorded call carries the version that produced it.
    `options` are the server's (`VLLMServer`).
    """

    def __init__(self, model_dir: str | Path, *, keep_requests: bool = False, **options: Any) -> None:
        super().__init__(model_dir, **options)
        # Partial rollout: a weight load freezes the requests in flight and continues them with
        # the new weights (vLLM's pause with mode=keep) instead of expecting none in flight.
        self.keep_requests = keep_requests
        self.policy_version = 0
        self.weights_dir: Path = self.model_dir
        # LoRA: the adapter served as the policy (a name per version) and its folder; the
        # gateway rewrites every proxied call's model to the name.
        self.adapter_name: str | None = None
        self.adapter_dir: Path | None = None
        # Several policies: each policy's adapter, by policy name, as served now.
        self.policies: dict[str, str] = {}
        self.gateway_url: str | None = None
        self._gateway_key: str | None = None
        self._sleep_level = 0
        self.last_reload: Any = None
        # LoRA: the id this server gave each adapter name it serves, which an in-place reload
        # addresses (vLLM counts from 1 in the order names are first loaded, never reusing one).
        self._lora_ids: dict[str, int] = {}
        self._loras_loaded = 0

    async def restart(self) -> float:
        """Start the engine again (after a crash) on the same port (another if it picked that
        one and it was taken meanwhile), serving the weights and `policy_version` it served
        before, and re-register it with the attached gateway, live (back in rotation).
        Returns the seconds it took."""
        started = time.monotonic()
        await asyncio.to_thread(self.stop)
        self._sleep_level = 0
        self._lora_ids, self._loras_loaded = {}, 0  # a new server: no adapter loaded
        served_before = self.base_url
        self.start()  # in the caller's thread: the parent-death signal is tied to it
        await asyncio.to_thread(self.wait_ready)
        if self.base_url != served_before and self.gateway_url is not None:
            # Its port was taken meanwhile: the gateway must stop sending calls to the old one
            # (the other engines behind it stay registered).
            async with GatewayClient(self.gateway_url, self._gateway_key or "") as client:
                await client.remove_model(served_before)
        if self.weights_dir != self.model_dir:
            await self.load_weights(self.weights_dir, version=self.policy_version)
        elif self.adapter_dir is not None:
            self.adapter_name, self.policies = None, {}  # the new server has no adapter loaded
            await self.load_adapter(self.adapter_dir, version=self.policy_version)
        elif self.gateway_url is not None:
            await self.register_with_gateway(self.gateway_url, self._gateway_key or "")
        return time.monotonic() - started

    async def reset_prefix_cache(self, attempts: int = 20) -> None:
        """Drop cached KV blocks computed with the old weights, and for a model that takes
        images the vision encoder's cached outputs too (`/reset_encoder_cache`): they are the
        old weights' as well, and after a reload without it the scheduler and the worker
        disagree on what is cached (vLLM 0.32 on CPU died with "Encoder cache miss" at the
        first picture it had seen before the load).

        vLLM answers `success: false` while blocks are held by running requests; the
        caller should have drained traffic, so we only retry briefly.
        """

        async def reset() -> None:
            resp = await self._post("/reset_prefix_cache")
            try:
                ok = bool(resp.json().get("success", True))
            except ValueError:
                ok = True  # older servers answer with an empty 200
            if not ok:
                raise _PrefixCacheBusy

        try:
            await call_with_retries(
                "resetting the prefix cache",
                reset,
                RetryPolicy(
                    lambda exc: isinstance(exc, _PrefixCacheBusy), attempts=attempts, first_wait=0.05, max_wait=1.0
                ),
                log,
            )
        except _PrefixCacheBusy:
            raise EngineError("reset_prefix_cache kept failing: requests still running on the engine?") from None
        await self._reset_encoder_cache()

    async def _reset_encoder_cache(self) -> None:
        """For a model that takes images, drop the vision encoder's cached outputs with the KV
        blocks (see `reset_prefix_cache`); every reset of the KV blocks after a load comes here."""
        if self.max_images:
            await self._post("/reset_encoder_cache")

    async def load_weights(self, weights_dir: str | Path, *, version: int | None = None) -> int:
        """Reload the weights in place from `weights_dir` (see `save_weights`).

        Then reset the prefix cache, set `policy_version` to `version` (default: +1), and
        re-register with the attached gateway. Traffic should be drained first: requests
        running during the reload may mix old and new weights (with `keep_requests` they are
        frozen instead: see `_load_keeping_requests`). If the engine sleeps (GPU), the weights
        are woken first and the KV cache after. Returns the version.
        Raises `EngineError` if vLLM refuses the reload (version unchanged), and
        `GatewayRegistrationError` if only the re-registration failed (version bumped).
        """
        wdir = Path(weights_dir).absolute()
        if not any(wdir.glob("*.safetensors")):
            raise EngineError(f"no *.safetensors in {wdir}")
        self.adapter_name = self.adapter_dir = None  # whole weights: the base is the policy again
        self.policies = {}
        if self.keep_requests:
            version = await self._load_keeping_requests(lambda: self._reload(wdir), version)
            self.weights_dir = wdir
            return version
        sleeping = self._sleep_level > 0
        if sleeping:
            await self.wake_up(tags=["weights"])
        await self._reload(wdir)
        if sleeping:
            await self.wake_up(tags=["kv_cache"])
        await self.reset_prefix_cache()
        self.weights_dir = wdir
        self.policy_version = self.policy_version + 1 if version is None else int(version)
        if self.gateway_url is not None:
            await self.register_with_gateway(self.gateway_url, self._gateway_key or "")
        return self.policy_version

    async def load_adapter(self, adapter_dir: str | Path, *, version: int) -> str:
        """LoRA: serve the PEFT adapter in `adapter_dir` as the policy at `version`, under one
        stable name (`{served_model_name}-lora`), its files in a stable folder beside
        `adapter_dir` (`served/<name>`, what vLLM reads the adapter from). A name new to the
        server is loaded with vLLM's `/v1/load_lora_adapter`; every later version is swapped in
        place in the worker (`RolloverWorkerExtension.rollover_reload_loras`), under the id the
        requests hold, and the prefix cache dropped (its blocks of the old adapter would be
        found under the same name). Then re-register with the attached gateway (which sends
        every call to that name, recording the version). With `keep_requests` (partial rollout)
        the requests in flight are frozen across the swap and continue with the new adapter,
        as across a weight load (`_load_keeping_requests`). Returns the name.

        A folder of several policies' adapters (a PEFT folder per policy, no adapter of its
        own) serves each as `{policy}-lora`, and the registration tells the gateway which name
        serves which policy (`policies`), so agents pick one by name."""
        adir = Path(adapter_dir).absolute()
        by_policy = policy_adapters(adir)
        served = {policy: f"{policy}-lora" for policy in by_policy}
        name = next(iter(served.values()), f"{self.served_model_name}-lora")
        sources = [(served[p], d) for p, d in by_policy.items()] or [(name, adir)]
        stable = {
            lora_name: _stage_adapter(source, adir.parent / "served" / lora_name) for lora_name, source in sources
        }
        previous = {*self.policies.values(), self.adapter_name} - {None, *served.values(), name}
        known = [lora_name for lora_name in stable if lora_name in self._lora_ids]

        async def reload() -> None:
            for lora_name, path in stable.items():
                if lora_name not in self._lora_ids:
                    await self._post("/v1/load_lora_adapter", json={"lora_name": lora_name, "lora_path": str(path)})
                    self._loras_loaded += 1
                    self._lora_ids[lora_name] = self._loras_loaded
            if known:
                swap = [[lora_name, self._lora_ids[lora_name], str(stable[lora_name])] for lora_name in known]
                resp = await self._post(
                    "/collective_rpc", json={"method": "rollover_reload_loras", "kwargs": {"adapters": swap}}
                )
                log.debug("rollover_reload_loras: %s", resp.text[:500])

        if self.keep_requests and known:
            await self._load_keeping_requests(reload, version)
        else:
            if self._sleep_level > 0:
                await self.wake_up()
            await reload()
            if known:
                await self.reset_prefix_cache()
            self.policy_version = int(version)
        self.adapter_name, self.adapter_dir, self.policies = name, adir, served
        if self.gateway_url is not None:
            await self.register_with_gateway(self.gateway_url, self._gateway_key or "")
        stale = sorted(n for n in previous if n is not None)  # another set of policies than before
        if stale:
            await self._unload_adapters(stale)
        return name

    async def _unload_adapters(self, names: list[str]) -> None:
        async with self.async_client(60.0) as client:
            for old in names:
                resp = await client.post("/v1/unload_lora_adapter", json={"lora_name": old})
                if resp.status_code >= 400:  # not fatal: the slot is taken back when vLLM needs it
                    log.warning("unloading LoRA adapter %s: HTTP %d %s", old, resp.status_code, resp.text[:200])
                self._lora_ids.pop(old, None)

    async def _reload(self, wdir: Path) -> None:
        method = "rollover_reload_weights" if self.worker_extension else "reload_weights"
        resp = await self._post(
            "/collective_rpc",
            json={"method": method, "kwargs": {"weights_path": str(wdir)}},
        )
        log.debug("%s: %s", method, resp.text[:500])
        try:
            # One entry per worker; ours reports the in-engine reload seconds.
            self.last_reload = resp.json()["results"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            self.last_reload = None

    async def _load_keeping_requests(self, reload: Callable[[], Awaitable[None]], version: int | None) -> int:
        """Partial rollout's load (`reload`: of the weights, or of the adapters in place): the
        requests in flight are frozen, not drained.

        Awake (CPU, or a GPU engine kept resident): tell the gateway the engine is frozen,
        `POST /pause?mode=keep` (vLLM keeps every request in its scheduler and steps none),
        reload, drop the KV cache (`reset_prefix_cache?reset_running_requests=true` preempts
        the kept requests: their prompt and tokens so far are recomputed with the new weights
        when they go on), register the new version (the gateway marks where each call's tokens
        change version), `POST /resume`. Asleep (collocated GPU: `sleep` froze the requests
        with mode=keep and dropped the KV cache): wake the weights, reload, register, wake the
        KV cache, which resumes vLLM's scheduler. Either way the gateway knows the new version
        before the first token it samples."""
        asleep = self._sleep_level > 0
        if not asleep:
            await self._tell_gateway(frozen=True)
            await self._post("/pause", params={"mode": "keep"})
        try:
            if asleep:
                await self.wake_up(tags=["weights"])
            await reload()
            if not asleep:
                resp = await self._post("/reset_prefix_cache", params={"reset_running_requests": "true"})
                if resp.json().get("success") is False:
                    raise EngineError("reset_prefix_cache with reset_running_requests failed while paused")
                await self._reset_encoder_cache()
            self.policy_version = self.policy_version + 1 if version is None else int(version)
        finally:
            try:
                await self._tell_gateway(frozen=False)  # the new version, or the old after a failure
            finally:
                if self.is_alive():
                    if asleep:
                        await self.wake_up(tags=["kv_cache"])
                    else:
                        await self._post("/resume")
        return self.policy_version

    async def _tell_gateway(self, *, frozen: bool) -> None:
        if self.gateway_url is not None:
            await self.register_with_gateway(self.gateway_url, self._gateway_key or "", frozen=frozen)

    async def sleep(self, level: int = 1) -> None:
        """Free accelerator memory during a policy update (GPU, needs sleep mode).

        Level 1 moves the weights to host memory and drops the KV cache; level 2 drops
        both (the next `load_weights` rewrites the weights anyway, so level 2 is the
        usual choice for collocated training). With `keep_requests` the requests in flight
        are frozen, not aborted (vLLM's mode=keep; their KV cache is recomputed on wake), and
        the gateway is told, so their time asleep does not count against their deadlines.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if not self.enable_sleep_mode:
            raise EngineError("sleep() needs the server started with sleep mode (device='cuda')")
        if self.keep_requests:
            await self._tell_gateway(frozen=True)
            await self._post("/sleep", params={"level": level, "mode": "keep"})
        else:
            await self._post("/sleep", params={"level": level})
        self._sleep_level = level

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what `sleep` freed; `tags` is a subset of ("weights", "kv_cache")."""
        params = [("tags", t) for t in tags] if tags else None
        await self._post("/wake_up", params=params)
        if not tags or "kv_cache" in tags:
            self._sleep_level = 0

    async def is_sleeping(self) -> bool:
        async with self.async_client(30.0) as client:
            resp = self._check(await client.get("/is_sleeping"), "GET /is_sleeping")
        return bool(resp.json().get("is_sleeping"))

    # ---------------------------------------------------------------- gateway

    def attach_gateway(self, gateway_url: str, admin_key: str) -> None:
        """Re-register with this gateway after every weight load (call
        `register_with_gateway` once yourself for the initial registration)."""
        self.gateway_url = gateway_url.rstrip("/")
        self._gateway_key = admin_key

    async def take_out_of_rotation(self) -> None:
        """Ask the attached gateway to send this endpoint no calls (it died; `restart` brings it
        back), so its rollouts move to the live engines now. Best effort, retried for a few
        seconds: a gateway that cannot be told finds out at its next call here."""
        if self.gateway_url is None:
            return
        async with GatewayClient(self.gateway_url, self._gateway_key or "", retry_seconds=5) as client:
            try:
                await client.set_model_live(self.base_url, False)
            except NotFoundError:
                pass  # not registered (yet): no calls come here
            except (GatewayError, httpx.HTTPError) as exc:
                log.warning("could not take %s out of the gateway's rotation: %s", self.base_url, exc)

    def registration(self, *, frozen: bool = False) -> list[dict[str, Any]]:
        """The `POST /api/models` body for this engine (live: a registration puts it in rotation;
        `frozen`: its requests are held for a weight load)."""
        entry: dict[str, Any] = {
            "model": self.adapter_name or self.served_model_name,
            "endpoint": self.base_url,
            "policy_version": self.policy_version,
        }
        if frozen:
            entry["frozen"] = True
        if self.policies:
            entry["policies"] = dict(self.policies)
        if self.max_images:
            entry["max_images"] = self.max_images
        return [entry]

    async def register_with_gateway(
        self, gateway_url: str, admin_key: str, *, attempts: int = 3, frozen: bool = False
    ) -> None:
        """Upsert this endpoint and its `policy_version` in the gateway's model registry, its
        generation routes opened to that gateway first; a gateway that is restarting or failing
        is retried, a refusal (4xx) is not."""
        await self.open_to_gateway(upstream_key(admin_key))
        async with GatewayClient(gateway_url, admin_key) as client:
            try:
                await call_with_retries(
                    "registering the engine with the gateway",
                    lambda: client.register_models(self.registration(frozen=frozen)),
                    RetryPolicy(is_transient, attempts=attempts),
                    log,
                )
            except (GatewayError, httpx.HTTPError) as exc:
                raise GatewayRegistrationError(f"POST {client.base_url}/api/models failed: {exc}") from exc


def _stage_adapter(source: Path, stable: Path) -> Path:
    """`source`'s adapter files in `stable`, each replaced atomically (a hard link where the
    file system allows, else a copy), so whatever vLLM reads from `stable` is one whole adapter
    version: the newest."""
    stable.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if not file.is_file():
            continue
        staged = stable / f".{file.name}.{os.getpid()}.tmp"
        staged.unlink(missing_ok=True)
        try:
            os.link(file, staged)
        except OSError:
            shutil.copyfile(file, staged)
        os.replace(staged, stable / file.name)
    return stable
