"""The samples' images as the model reads them: each recorded image (by content hash, fetched
once a step) through the model's own image processor, every sample's in the order of its
placeholder runs (`samples.Sample.pixels`).

A sample whose placeholder runs do not match its images (a left cut through an image, say) is
not trained on and is counted (`training/n_image_mismatch_samples`): its pixels would go to the
wrong tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from rollover.training.samples import UpdateBatch
from rollover.vision.inputs import PixelInputs, concatenated, image_runs, load_image_processor, pixel_inputs

Fetch = Callable[[str], Awaitable[bytes]]


class SampleImages:
    """Pixel inputs for the samples of a vision-language model (`model_dir`'s processor);
    `fetch(sha256)` gives a recorded image's bytes (the gateway's `GET /api/images/{sha256}`)."""

    def __init__(self, model_dir: str | Path, fetch: Fetch) -> None:
        import json

        self.processor = load_image_processor(model_dir)
        self.image_token_id = int(json.loads((Path(model_dir) / "config.json").read_text())["image_token_id"])
        self.fetch = fetch

    async def attach(self, batch: UpdateBatch) -> tuple[UpdateBatch, int]:
        """The batch with every sample's pixels, without the samples whose placeholders do not
        match their images, and how many those were."""
        hashes = sorted({h for sample in batch.samples for h in sample.images})
        data = await asyncio.gather(*(self.fetch(h) for h in hashes))
        # One image through the processor at a time: its patches do not depend on the others.
        pixels = await asyncio.to_thread(lambda: {h: pixel_inputs(self.processor, [d]) for h, d in zip(hashes, data)})
        kept, dropped = [], 0
        for sample in batch.samples:
            if not sample.images:
                if image_runs(sample.input_ids, self.image_token_id):
                    dropped += 1  # placeholders with no image recorded for them
                else:
                    kept.append(sample)
                continue
            mine: PixelInputs | None = concatenated([pixels[h] for h in sample.images])
            assert mine is not None
            if image_runs(sample.input_ids, self.image_token_id) != list(mine.tokens):
                dropped += 1
                continue
            sample.pixels = mine
            kept.append(sample)
        return UpdateBatch(kept, batch.rollouts), dropped
