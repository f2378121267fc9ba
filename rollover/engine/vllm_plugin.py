"""Rollover's vLLM plugin (entry point `vllm.general_plugins`: vLLM runs `register` first in
every process it starts, its model inspection included): LoRA on CPU takes one matrix product
per adapter, not one per token (`rollover.engine.cpu_lora`), a seeded request whose prefill is
split does not kill the engine on CPU (`rollover.engine.cpu_seeds`), and vision-language models load
on a CPU install that has no torchvision.

Why: transformers 5 builds Qwen2-VL's processor with a video processor, and every video
processor needs torchvision, as does the module vLLM's Qwen2-VL imports `smart_resize` from;
this install leaves torchvision out (its builds break vLLM's import here). So, only where
torchvision is missing: that module is stood in for by transformers' own torchvision-free image
processor module (the same `smart_resize`, the PIL image processor), and the processor's video
part by one that refuses videos (the engine is started with no video allowed). Images go
through the model's own image processor either way. With torchvision installed nothing changes.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

TORCHVISION_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def register() -> None:
    from rollover.engine import cpu_lora, cpu_seeds

    cpu_lora.install()
    cpu_seeds.install()
    if importlib.util.find_spec("torchvision") is not None:
        return
    _stand_in_image_module()
    _stand_in_video_processor()


def _stand_in_image_module() -> None:
    if TORCHVISION_IMAGE_MODULE in sys.modules:
        return
    pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    module = type(sys)(TORCHVISION_IMAGE_MODULE)
    module.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
    module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
    module.Qwen2VLImageProcessorKwargs = pil.Qwen2VLImageProcessorKwargs  # type: ignore[attr-defined]
    sys.modules[TORCHVISION_IMAGE_MODULE] = module


def _stand_in_video_processor() -> None:
    from transformers import processing_utils
    from transformers.video_processing_utils import VideoProcessorMixin

    class NoVideoProcessor(VideoProcessorMixin):
        """A processor's video part where videos cannot be read: it refuses them."""

        model_input_names = ["pixel_values_videos", "video_grid_thw"]

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise ValueError("this engine takes no videos (no torchvision in this install): send images")

    class NoVideoAutoProcessor:
        @classmethod
        def from_pretrained(cls, *args: Any, **kwargs: Any) -> NoVideoProcessor:
            return NoVideoProcessor()

    # transformers looks the auto class up as a module attribute, and checks the instance
    # against `VideoProcessorMixin` by a top-level name it exports only with torchvision.
    auto = importlib.import_module("transformers.models.auto.video_processing_auto")
    setattr(auto, "AutoVideoProcessor", NoVideoAutoProcessor)  # noqa: B010 (a module mypy cannot see)
    setattr(processing_utils.transformers_module, "VideoProcessorMixin", VideoProcessorMixin)  # noqa: B010
