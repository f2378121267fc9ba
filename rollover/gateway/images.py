"""Images in a proxied call: read from the chat request's `image_url` parts (the Anthropic and
Responses routes translate theirs into such parts), checked, and recorded once by content hash.

Only inline images are taken: `data:` URLs with base64 data of a PNG, JPEG, GIF or WEBP image,
each at most `gateway.max_image_bytes`. The gateway fetches nothing (an http(s) URL is refused:
nothing here reaches the network), and the engine the call goes to must take images (its
registered `max_images`: 0 for a text-only model) and that many. Every refusal is a 400 that
names the part and the limit, and never repeats the image's data.

The engine gets the request as the agent sent it. The record keeps it with each image's data
replaced by a reference (`rollover-image:<sha256>`), the images in prompt order with what the
trainer needs besides the engine's expanded prompt ids (hash, format, size in pixels), and the
bytes themselves go to the store's image table once per content: a rollout that re-sends one
screenshot every turn stores it once.
"""

from __future__ import annotations

import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass
from typing import Any

REFERENCE_PREFIX = "rollover-image:"
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}
NO_NETWORK = "image URLs are not fetched (the gateway reaches no network): send the image inline as a data: URL"


class ImageRefused(Exception):
    """A call's image the gateway will not pass on: a 400 with this reason."""


@dataclass(frozen=True)
class Image:
    """One decoded, checked image of a call."""

    sha256: str
    media_type: str
    data: bytes
    width: int
    height: int

    @property
    def reference(self) -> str:
        return REFERENCE_PREFIX + self.sha256

    def description(self) -> dict[str, Any]:
        """What a call's record keeps of the image beside its reference."""
        return {
            "sha256": self.sha256,
            "media_type": self.media_type,
            "width": self.width,
            "height": self.height,
            "bytes": len(self.data),
        }


@dataclass(frozen=True)
class CallImages:
    """A call's images in prompt order and its request as recorded (the data replaced by
    references)."""

    images: tuple[Image, ...]
    recorded_body: dict[str, Any]


def decode_data_url(url: str, where: str, max_bytes: int) -> Image:
    """The image a `data:` URL holds, checked; `ImageRefused` naming `where` otherwise."""
    if url.startswith(("http://", "https://")):
        raise ImageRefused(f"{where}: {NO_NETWORK}")
    if not url.startswith("data:"):
        raise ImageRefused(f"{where}: only data: URLs are taken (data:image/png;base64,...)")
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ImageRefused(f"{where}: the data: URL must be base64 (data:image/png;base64,...)")
    # Refused by its length before it is decoded: base64 holds 3 bytes in every 4 characters.
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise ImageRefused(f"{where}: the image is over gateway.max_image_bytes ({max_bytes} bytes)")
    try:
        data = binascii.a2b_base64(payload.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ImageRefused(f"{where}: the image data is not valid base64") from None
    if len(data) > max_bytes:
        raise ImageRefused(f"{where}: the image is {len(data)} bytes, over gateway.max_image_bytes ({max_bytes})")
    media_type, width, height = _inspect(data, where)
    return Image(hashlib.sha256(data).hexdigest(), media_type, data, width, height)


def _inspect(data: bytes, where: str) -> tuple[str, int, int]:
    """The image's media type and size, after Pillow has checked its structure."""
    from PIL import Image as PILImage

    accepted = ", ".join(FORMATS)
    try:
        with warnings.catch_warnings():
            # Past Pillow's pixel bound an image is refused, not warned about (decompression bombs).
            warnings.simplefilter("error", PILImage.DecompressionBombWarning)
            with PILImage.open(io.BytesIO(data)) as image:
                fmt, (width, height) = image.format, image.size
                image.verify()
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning):
        raise ImageRefused(f"{where}: the image has over {PILImage.MAX_IMAGE_PIXELS} pixels") from None
    except Exception:  # Pillow raises many types for bad data: all of them mean the same here
        raise ImageRefused(f"{where}: the data is not a readable image ({accepted})") from None
    if fmt not in FORMATS:
        raise ImageRefused(f"{where}: {fmt} images are not taken ({accepted})")
    return FORMATS[fmt], width, height


def has_images(body: dict[str, Any]) -> bool:
    """Whether a chat request has an image part (cheap: nothing decoded)."""
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(message, dict)
        and isinstance(message.get("content"), list)
        and any(_is_image_part(part) for part in message["content"])
        for message in messages
    )


def call_images(body: dict[str, Any], max_image_bytes: int) -> CallImages | None:
    """A chat request's images, checked, and its body as recorded; None when it has none."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    images: list[Image] = []
    recorded_messages: list[Any] = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image_part(part) for part in content):
            recorded_messages.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            if not _is_image_part(part):
                parts.append(part)
                continue
            where = f"messages.{m}.content.{p}.image_url"
            image = decode_data_url(_url(part, where), where, max_image_bytes)
            images.append(image)
            parts.append(part | {"image_url": _image_url(part) | {"url": image.reference}})
        recorded_messages.append(message | {"content": parts})
    if not images:
        return None
    return CallImages(tuple(images), body | {"messages": recorded_messages})


def check_count(images: CallImages | None, max_images: int) -> None:
    """Refuse more images than the engine takes in one prompt; with `max_images` 0 (a text-only
    model) any image, even before it is decoded (`images` None)."""
    if max_images == 0:
        raise ImageRefused("the served model takes no images (a text-only model): send text")
    if images is not None and len(images.images) > max_images:
        raise ImageRefused(
            f"{len(images.images)} images in one prompt: the engine takes at most {max_images}"
            " (actor_rollout_ref.rollout.limit_images, vLLM's --limit-mm-per-prompt)"
        )


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _image_url(part: dict[str, Any]) -> dict[str, Any]:
    value = part.get("image_url")
    return value if isinstance(value, dict) else {}


def _url(part: dict[str, Any], where: str) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ImageRefused(f'{where}: an image_url part is {{"image_url": {{"url": "data:..."}}}}')
    return url


def restore_images(body: dict[str, Any], images: dict[str, tuple[str, bytes]]) -> dict[str, Any]:
    """A recorded request with its image references put back as data: URLs (`images`: media
    type and bytes by hash), as the agent sent it: what `previous_response_id` continues."""
    import base64

    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    restored = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            restored.append(message)
            continue
        parts = []
        for part in content:
            url = _image_url(part).get("url") if _is_image_part(part) else None
            if isinstance(url, str) and url.startswith(REFERENCE_PREFIX) and url[len(REFERENCE_PREFIX) :] in images:
                media_type, data = images[url[len(REFERENCE_PREFIX) :]]
                inline = f"data:{media_type};base64,{base64.b64encode(data).decode()}"
                part = part | {"image_url": _image_url(part) | {"url": inline}}
            parts.append(part)
        restored.append(message | {"content": parts})
    return body | {"messages": restored}


def references(body: dict[str, Any]) -> list[str]:
    """The image hashes a recorded request refers to, in order."""
    found = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            url = _image_url(part).get("url") if _is_image_part(part) else None
            if isinstance(url, str) and url.startswith(REFERENCE_PREFIX):
                found.append(url[len(REFERENCE_PREFIX) :])
    return found
