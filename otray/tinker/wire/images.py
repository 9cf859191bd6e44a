"""Images in Tinker requests: ``ImageChunk`` (bytes) and ``ImageAssetPointerChunk`` (a location) -> an
:class:`otray.vision.Image` and the token ids it takes in the base model's sequences.

As Tinker's service does, the server computes an image's token count from the image and the model's
processor (``otray.vlm.VisionInputs``) and fails fast when the chunk's ``expected_tokens`` disagrees.
An image chunk stands for the image tokens only: a Qwen-VL renderer sends ``<|vision_start|>`` and
``<|vision_end|>`` as text chunks around it. Problems are :class:`~otray.vision.ImageError`s; the
request parsers (``wire``, ``runs``) turn them into user errors naming the datum or prompt.

Runs in the TinkerService actor (a request's images, checked and tokenized)."""

from __future__ import annotations

import base64
import binascii
from typing import Any, Optional

from otray.vision import Image, ImageError, fetch_image


def image_tokens(image: Image, fmt: Any, expected: Optional[int], vision: Any) -> list[int]:
    """The token ids ``image`` takes in a sequence of the model ``vision`` (``VisionInputs``, None for a
    text-only model) belongs to, checked against the chunk's ``format`` and ``expected_tokens``."""
    if vision is None:
        raise ImageError("an image was sent to a base model that takes no images (a text-only model): send token "
                         "chunks only, or choose a vision-language base model")
    if fmt not in (None, "", image.format):
        raise ImageError(f"the chunk says format {fmt!r} but its bytes are {image.format}")
    n = vision.tokens_per_image(image)
    if expected is not None and expected != n:
        raise ImageError(f"the chunk says expected_tokens={expected} but this model makes {n} tokens of this "
                         f"{image.width}x{image.height} image; compute them with the model's image processor")
    return [vision.image_token_id] * n


def chunk_image(chunk: dict[str, Any], fetch: bool = False) -> Image:
    """The image of a JSON prompt chunk: an ``ImageChunk``'s base64 ``data``, or an
    ``ImageAssetPointerChunk``'s ``location`` (a data URL; an http(s) URL only where ``fetch``, the
    service's ``fetch_image_urls``, allows; a local path is never read: it could be another user's file)."""
    if chunk.get("type") == "image":
        data = chunk.get("data")
        try:
            raw = base64.b64decode(data, validate=True) if isinstance(data, str) else None
        except (binascii.Error, ValueError):
            raw = None
        if raw is None:
            raise ImageError("an ImageChunk's data must be base64 image bytes (the SDK's ImageChunk)")
        return Image.from_bytes(raw)
    location = chunk.get("location")
    if not isinstance(location, str):
        raise ImageError("an ImageAssetPointerChunk needs a location")
    if location.startswith(("http://", "https://")):
        if not fetch:
            raise ImageError(f"image location {location[:80]!r} is remote and this service does not fetch images: "
                             "send the bytes in an ImageChunk, or a data: URL as the location")
        return fetch_image(location)
    return Image.from_data_url(location)
