"""What a node's engines run with: `EngineSettings`, built once from the config and frozen.
The engine part reads no key of the whole config: its server flags, how many engines a node
runs, how weights reach them, and how often a crashed one is restarted are all here."""

from __future__ import annotations

from dataclasses import dataclass

from rollover.config import RolloverConfig


@dataclass(frozen=True)
class EngineSettings:
    served_model_name: str = "policy"
    host: str = "127.0.0.1"  # the address engines listen on and register under
    max_model_len: int = 2048
    dtype: str = "float32"
    kv_cache_space_gb: float = 1.0  # CPU
    gpu_memory_utilization: float = 0.5  # GPU
    flags: tuple[str, ...] = ()  # vLLM server flags of the rollout keys (LoRA's among them)
    tensor_parallel_size: int = 1
    engines_per_node: int = 1
    tool_call_parser: str | None = None
    start_timeout_seconds: float = 300.0
    keep_requests: bool = False  # partial rollout: a weight load freezes requests, not drains them
    lora: bool = False  # only an adapter is synced, loaded at runtime
    max_restarts: int = 3
    bucket_megabytes: int = 2048  # the weight sync's file size
    device: str = "auto"  # trainer.device: the engines sit on the trainer's devices
    limit_images: int | None = None  # images per prompt a vision model's engine takes; None = its default

    @classmethod
    def from_config(cls, config: RolloverConfig) -> EngineSettings:
        rollout, model = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
        return cls(
            served_model_name=model.served_model_name,
            host=rollout.engine_host,
            max_model_len=rollout.max_model_len,
            dtype=rollout.dtype,
            kv_cache_space_gb=rollout.kv_cache_space_gb,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            flags=tuple(rollout.vllm_flags(model.lora_rank)),  # enforce_eager among them
            tensor_parallel_size=rollout.tensor_model_parallel_size,
            engines_per_node=config.engines_per_node,
            tool_call_parser=rollout.tool_call_parser_setting,
            start_timeout_seconds=rollout.start_timeout_seconds,
            keep_requests=config.agentlightning.async_rollout.partial_rollout,
            lora=model.lora,
            max_restarts=rollout.max_engine_restarts,
            bucket_megabytes=rollout.checkpoint_engine.update_weights_bucket_megabytes,
            device=config.trainer.device,
            limit_images=rollout.limit_images,
        )
