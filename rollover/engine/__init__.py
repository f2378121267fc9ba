"""The inference engine: vLLM's OpenAI server owned by Rollover, and weight sync into it."""

from rollover.engine.vllm_engine import EngineError, EngineStartError, VLLMEngine
from rollover.engine.weights import save_weights

__all__ = ["EngineError", "EngineStartError", "VLLMEngine", "save_weights"]
