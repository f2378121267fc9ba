"""The engines of one node: `n_gpus_per_node / tensor_model_parallel_size` vLLM servers, each
on its own devices, collocated with the node's trainer ranks."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollover.config import RolloverConfig
from rollover.distributed.world import World
from rollover.engine.vllm_engine import VLLMEngine


def node_engines(config: RolloverConfig, model_path: str | Path, run_dir: Path, world: World) -> list[VLLMEngine]:
    """This node's engines, not started. On GPU engine i sees devices
    `[i * tp, (i + 1) * tp)` of the node; on CPU they share the host."""
    rollout = config.actor_rollout_ref.rollout
    tp = rollout.tensor_model_parallel_size
    device = world.device(config.trainer.device).type
    engines = []
    for index in range(config.engines_per_node):
        name = f"node{world.node_rank}-engine{index}"
        lora_rank = config.actor_rollout_ref.model.lora_rank
        # LoRA: adapters are loaded and unloaded at runtime, one per policy version.
        env: dict[str, str] = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if lora_rank > 0 else {}
        extra = rollout.vllm_flags(lora_rank)  # enforce_eager among them
        if tp > 1:
            extra += ["--tensor-parallel-size", str(tp)]
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in range(index * tp, (index + 1) * tp))
        engines.append(
            VLLMEngine(
                model_path,
                host=rollout.engine_host,
                served_model_name=config.actor_rollout_ref.model.served_model_name,
                max_model_len=rollout.max_model_len,
                dtype=rollout.dtype,
                kv_cache_space_gb=rollout.kv_cache_space_gb,
                gpu_memory_utilization=rollout.gpu_memory_utilization if device == "cuda" else None,
                extra_args=extra,
                tool_call_parser=rollout.tool_call_parser_setting,
                log_path=run_dir / ("engine.log" if index == 0 and world.node_rank == 0 else f"{name}.log"),
                start_timeout_s=rollout.start_timeout_seconds,
                device="cuda" if device == "cuda" else "cpu",
                env=env,
                keep_requests=config.agentlightning.async_rollout.partial_rollout,
                limit_images=rollout.limit_images,
            )
        )
    return engines


async def wait_all_ready(engines: list[VLLMEngine]) -> None:
    """Engines start side by side; the first that fails to start raises."""
    await asyncio.gather(*(asyncio.to_thread(engine.wait_ready) for engine in engines))


async def register_all(engines: list[VLLMEngine], gateway_url: str, admin_key: str, policy_version: int) -> None:
    """Put the engines in the gateway's rotation at `policy_version`; each re-registers itself
    after every weight load and restart."""
    for engine in engines:
        engine.policy_version = policy_version
        engine.attach_gateway(gateway_url, admin_key)
        await engine.register_with_gateway(gateway_url, admin_key)
