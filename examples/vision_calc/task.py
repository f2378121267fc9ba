"""The vision calc task: the calc task (examples/calc) with its expression shown only as an image.

  user:      [image: 37+45] Compute the expression in the image.
  assistant: <calc>37+45</calc>
  tool:      82
  assistant: ANSWER: 82

The image is what an agent's screenshot would be: the expression's characters drawn with
Pillow's built-in font, one per 28x28 cell (one image token of the tiny vision model each),
with a little jitter in place and shade so that no two renderings are the same picture. The
question's text never names the numbers: the model must read them from the pixels.
"""

from __future__ import annotations

import base64
import io
import random
import zlib
from typing import Any

from examples.calc.task import SYSTEM_PROMPT, calculate, make_tasks, score

__all__ = ["QUESTION", "SYSTEM_PROMPT", "calculate", "demonstration", "image_url", "make_tasks", "render", "score"]

QUESTION = "Compute the expression in the image."
CELL = 28
WIDTH = 5  # cells: the longest expression ("99-99") fills them; shorter ones are padded


def render(expression: str, seed: int | None = None) -> bytes:
    """The expression as a PNG; `seed` fixes the jitter (None: from the expression)."""
    from PIL import Image, ImageDraw, ImageFont

    rng = random.Random(zlib.crc32(expression.encode()) if seed is None else seed)
    font = ImageFont.load_default(size=22)
    image = Image.new("RGB", (CELL * WIDTH, CELL), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for index, char in enumerate(expression[:WIDTH]):
        shade = rng.randint(0, 60)
        centre = (index * CELL + CELL // 2 + rng.randint(-2, 2), CELL // 2 + rng.randint(-2, 2))
        draw.text(centre, char, fill=(shade, shade, shade), font=font, anchor="mm")
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def image_url(expression: str, seed: int | None = None) -> str:
    return "data:image/png;base64," + base64.b64encode(render(expression, seed)).decode()


def user_message(expression: str, seed: int | None = None) -> dict[str, Any]:
    """The question as an OpenAI chat message: the picture, then the text."""
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": image_url(expression, seed)}},
            {"type": "text", "text": QUESTION},
        ],
    }


def demonstration(
    task: dict[str, Any], final_format: str = "ANSWER: {}", seed: int | None = None
) -> list[dict[str, Any]]:
    """A transcript that reads the image and uses the calculator (the warm-up's)."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        user_message(task["expression"], seed),
        {"role": "assistant", "content": f"<calc>{task['expression']}</calc>"},
        {"role": "tool", "content": str(task["answer"])},
        {"role": "assistant", "content": final_format.format(task["answer"])},
    ]
