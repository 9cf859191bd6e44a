"""The OpenAI HTTP shapes: request validation, response and stream-chunk bodies, error bodies.

Pure functions (no Ray, no model), so every rule is unit-tested. A bad request raises
:class:`APIError`, which the app turns into a 4xx response with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``; nothing a client sends should end
in a 500.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from otray.types import OtrayError
from otray.vision import Image, ImageError


class APIError(OtrayError):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    """What a request may ask for (``serve`` config section)."""

    max_tokens: int = 512  # per completion
    max_n: int = 8
    max_prompt_tokens: int = 4096  # further capped by the model's context


@dataclass
class GenerationRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    model: str
    chat: bool
    prompt: str | None = None  # completions
    messages: list[dict[str, str]] = field(default_factory=list)  # chat
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_usage: bool = False  # stream_options.include_usage
    # chat messages' images in order (``otray.vision.Image``, or a remote URL str until the app fetches it);
    # each shows in ``messages`` as a ``{"type": "image"}`` content part (what a VLM's chat template renders)
    images: list[Any] = field(default_factory=list)


_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "seed", "stop", "user", "stream_options",
           "frequency_penalty", "presence_penalty"}
ALLOWED = {True: _COMMON | {"messages", "max_completion_tokens"}, False: _COMMON | {"prompt", "echo"}}


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise APIError(400, f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}", param=key)
    if not lo <= value <= hi:
        raise APIError(400, f"'{key}' must be between {lo} and {hi}, got {value}", param=key)
    return value


def parse_request(body: Any, *, chat: bool, limits: Limits) -> GenerationRequest:
    """Validate a decoded JSON body; raises APIError naming the offending field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - ALLOWED[chat])
    if unknown:
        raise APIError(400, f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required: a name from GET /v1/models", param="model")
    if body.get("frequency_penalty") or body.get("presence_penalty"):
        raise APIError(400, "frequency_penalty and presence_penalty are not supported (leave them 0)",
                       param="frequency_penalty" if body.get("frequency_penalty") else "presence_penalty")
    if body.get("echo"):
        raise APIError(400, "'echo' is not supported", param="echo")
    max_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    req = GenerationRequest(
        model=model, chat=chat,
        max_tokens=_number(body, max_key, 16, 1, limits.max_tokens, integer=True),
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 1e-6, 1.0)),
        n=_number(body, "n", 1, 1, limits.max_n, integer=True),
        seed=_number(body, "seed", None, -(2**63), 2**63 - 1, integer=True) if body.get("seed") is not None else None)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
    req.stream = stream
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    req.include_usage = bool(options.get("include_usage", False))
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, "'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
        req.stop = stop
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                    or not isinstance(m.get("content"), (str, list)):
                raise APIError(400, f"messages[{i}] must be {{'role': 'system'|'user'|'assistant', 'content': str "
                                    "or a list of content parts}", param=f"messages[{i}]")
            req.messages.append({"role": m["role"], "content": _content(m["content"], i, req.images)})
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string", param="prompt")
        req.prompt = prompt
    return req


def _content(content: str | list[Any], i: int, images: list[Any]) -> str | list[dict[str, str]]:
    """A message's content for the chat template: the string itself, or its parts with each image as
    ``{"type": "image"}`` (the image, or a remote URL to fetch, appended to ``images``)."""
    if isinstance(content, str):
        return content
    out: list[dict[str, str]] = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
            continue
        if kind != "image_url":
            raise APIError(400, f"{where} must be a 'text' or 'image_url' content part", param=where)
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise APIError(400, f"{where}.image_url must be {{'url': 'data:image/png;base64,...'}}", param=where)
        if url.startswith(("http://", "https://")):
            images.append(url)  # fetched by the app where its admin allows it, else refused there
        else:
            try:
                images.append(Image.from_data_url(url))
            except ImageError as e:
                raise APIError(400, f"{where}: {e}", param=where) from None
        out.append({"type": "image"})
    return out


def apply_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """Cut ``text`` at the first stop string; whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


@dataclass
class Choice:
    text: str
    finish_reason: str  # stop | length
    completion_tokens: int


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(req: GenerationRequest, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
    """A complete (non-streaming) completions or chat.completions response."""
    created, rid = int(time.time()), new_id(req.chat)
    if req.chat:
        items = [{"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
                  "logprobs": None} for i, c in enumerate(choices)]
    else:
        items = [{"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
                 for i, c in enumerate(choices)]
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": created,
            "model": req.model, "choices": items,
            "usage": usage(prompt_tokens, sum(c.completion_tokens for c in choices))}


def chunk_body(req: GenerationRequest, rid: str, created: int, index: int, text: str | None,
               finish_reason: str | None, first: bool = False) -> dict[str, Any]:
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``)."""
    if req.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "choices": [choice]}
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
            "choices": [{"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": None}]}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event line pair."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
