"""Images in observations: the :class:`Image` type, observations made of parts, and their checks.

An env observation (``reset``'s first message, ``StepResult.observation``) is either a plain
string, as it always was, or a list of parts, in the order the user message shows them::

    [Image.from_pil(picture), "How many squares are in the picture?"]

A part is a ``str`` or an :class:`Image`. The OpenAI chat shape is taken as well (what a user of
the ``openai`` client already writes): ``{"type": "text", "text": ...}`` and
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``; :func:`parts`
turns either into the typed list. An :class:`Image` holds the encoded file (PNG or JPEG bytes),
checked once where it is made: it decodes, it is within :data:`MAX_IMAGE_BYTES` and
:data:`MAX_IMAGE_PIXELS`. Encoded bytes are what travel between actors (a 56x56 PNG is a few
hundred bytes; the pixels a model takes are made where the model is, once per image:
:mod:`otray.vlm`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass, field
from typing import Any, Union

from otray.types import OtrayError

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an encoded image larger than this is refused
MAX_IMAGE_PIXELS = 4096 * 4096  # a decoded image larger than this is refused (decompression bombs)
FORMATS = ("png", "jpeg")
IMAGE_MARKER = "<image>"  # how an image shows in the text of an observation (logs, messages)


class ImageError(OtrayError, ValueError):
    """An image cannot be used: unreadable, too large, of a format otray does not take, for a model
    that takes no images, or more images than the model takes. The message says which and what to do."""


@dataclass(frozen=True)
class Image:
    """One encoded image (``data``: PNG or JPEG bytes) and its size in pixels. Make one with
    :meth:`from_bytes`, :meth:`from_pil` or :meth:`from_data_url`: each checks it."""

    data: bytes = field(repr=False)
    format: str
    width: int
    height: int

    @classmethod
    def from_bytes(cls, data: bytes, *, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS) -> Image:
        """Check ``data`` (it decodes as PNG or JPEG, within the limits) and wrap it."""
        if not isinstance(data, (bytes, bytearray)):
            raise ImageError(f"an image must be bytes (a PNG or JPEG file), got {type(data).__name__}")
        if len(data) > max_bytes:
            raise ImageError(f"image of {len(data)} bytes is over the limit of {max_bytes}: send a smaller image")
        from PIL import Image as PILImage

        try:
            with PILImage.open(io.BytesIO(data)) as img:
                fmt = (img.format or "").lower()
                width, height = img.size
                if width * height > max_pixels:
                    raise ImageError(f"image of {width}x{height} pixels is over the limit of {max_pixels} pixels: "
                                     "resize it")
                img.load()  # decode it all: a truncated file fails here, not in a model's worker
        except ImageError:
            raise
        except Exception as e:  # noqa: BLE001 - PIL raises many kinds for a bad file
            raise ImageError(f"unreadable image ({len(data)} bytes): {type(e).__name__}: {e}; "
                             "send PNG or JPEG bytes") from e
        if fmt not in FORMATS:
            raise ImageError(f"image format {fmt or 'unknown'!r} is not taken: send PNG or JPEG")
        return cls(bytes(data), fmt, width, height)

    @classmethod
    def from_pil(cls, image: Any, format: str = "png") -> Image:
        """Encode a PIL image (RGB; other modes are converted) as PNG (lossless, the default) or JPEG."""
        if format not in FORMATS:
            raise ImageError(f"image format {format!r} is not taken: use one of {FORMATS}")
        buf = io.BytesIO()
        image.convert("RGB").save(buf, format=format.upper())
        return cls.from_bytes(buf.getvalue())

    @classmethod
    def from_data_url(cls, url: str, **limits: Any) -> Image:
        """An image from a ``data:image/png;base64,...`` URL. A remote URL is refused here: fetching is
        the caller's decision (serve allows it only where an admin said so)."""
        if not isinstance(url, str) or not url.startswith("data:"):
            shown = url[:60] if isinstance(url, str) else type(url).__name__
            raise ImageError(f"image URL {shown!r} is not a data URL: send the image inline as "
                             "data:image/png;base64,... (remote URLs are not fetched)")
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ImageError("a data URL image must be base64: data:image/png;base64,...")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"the data URL's base64 does not decode: {e}") from e
        return cls.from_bytes(data, **limits)

    def data_url(self) -> str:
        return f"data:image/{self.format};base64," + base64.b64encode(self.data).decode()

    def to_pil(self) -> Any:
        """The decoded image, in RGB."""
        from PIL import Image as PILImage

        return PILImage.open(io.BytesIO(self.data)).convert("RGB")

    @property
    def digest(self) -> str:
        """A hash of the encoded bytes: what caches of this image's pixels are keyed by."""
        return hashlib.sha256(self.data).hexdigest()[:32]


def fetch_image(url: str, max_bytes: int = MAX_IMAGE_BYTES, timeout_s: float = 10.0) -> Image:
    """Download an http(s) image (at most ``max_bytes``, within ``timeout_s``) and check it: for servers
    whose admin allows fetching (``fetch_image_urls``). Failures are :class:`ImageError`s naming the URL."""
    import urllib.error
    import urllib.request

    if not url.startswith(("http://", "https://")):
        raise ImageError(f"only http(s) image URLs are fetched, got {url[:80]!r}")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 - http(s) only, checked above
            data = reply.read(max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ImageError(f"could not fetch the image at {url[:80]!r}: {e}") from None
    if len(data) > max_bytes:
        raise ImageError(f"the image at {url[:80]!r} is over the limit of {max_bytes} bytes: send a smaller image")
    return Image.from_bytes(data, max_bytes=max_bytes)


Part = Union[str, Image]
Observation = Union[str, list]  # a str, or a list of parts (str / Image / OpenAI content dicts)


def parts(observation: Any) -> list[Part]:
    """``observation`` as a list of typed parts (a plain string is one part). Raises :class:`ImageError`
    (a ``ValueError``) naming the first part that is neither text nor an image."""
    if isinstance(observation, str):
        return [observation]
    if not isinstance(observation, (list, tuple)):
        raise ImageError(f"an observation must be a str or a list of parts (str / Image), "
                         f"got {type(observation).__name__}")
    out: list[Part] = []
    for i, p in enumerate(observation):
        if isinstance(p, (str, Image)):
            out.append(p)
        elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
            out.append(p["text"])
        elif isinstance(p, dict) and p.get("type") == "image_url":
            url = p.get("image_url")
            out.append(Image.from_data_url(url.get("url") if isinstance(url, dict) else url))
        else:
            raise ImageError(f"observation part {i} is {type(p).__name__} {str(p)[:60]!r}: a part is a str, an "
                             "otray.vision.Image, or an OpenAI content dict of type 'text' or 'image_url'")
    return out


def images_of(observation: Any) -> list[Image]:
    """The images of an observation, in order (none for a plain string)."""
    return [] if isinstance(observation, str) else [p for p in parts(observation) if isinstance(p, Image)]


def text_of(observation: Any) -> str:
    """The observation's text, each image shown as :data:`IMAGE_MARKER` (for logs and messages)."""
    if isinstance(observation, str):
        return observation
    return "".join(IMAGE_MARKER if isinstance(p, Image) else p for p in parts(observation))


def template_content(observation: Any) -> str | list[dict[str, str]]:
    """The observation as a chat template's message content: the string itself, or the content list a
    vision-language template renders (``{"type": "image"}`` where each image goes)."""
    if isinstance(observation, str):
        return observation
    return [{"type": "image"} if isinstance(p, Image) else {"type": "text", "text": p} for p in parts(observation)]


def openai_content(observation: Any) -> str | list[dict[str, Any]]:
    """The observation in the OpenAI chat shape (images as data URLs): what serve and clients take."""
    if isinstance(observation, str):
        return observation
    return [{"type": "image_url", "image_url": {"url": p.data_url()}} if isinstance(p, Image)
            else {"type": "text", "text": p} for p in parts(observation)]
