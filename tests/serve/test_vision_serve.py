"""Serve with a vision-language model: the official openai client sends image_url parts (data URLs), the
answer is the model's on that picture; remote URLs, broken images and images for a text model are 400s."""

from __future__ import annotations

import http.server
import threading

import pytest

from envs.shapes import draw, scene
from otray.types import SamplingParams

from tests.conftest import SERVE_PORT

PORT = SERVE_PORT  # (tests/conftest.py: Serve is started once per pytest process)
QUESTION = "How many shapes are in the picture?"


@pytest.fixture(scope="module")
def vl_served(ray_local, tiny_path):
    from ray import serve

    from otray.models import resolve_model_path
    from otray.serve import config as serve_config
    from otray.serve.app import APP_NAME, run
    from tests.conftest import ROOT

    vl_path = resolve_model_path("tiny-vl", ROOT / ".cache" / "models")

    def deploy(**extra):
        run(serve_config.load_serve({"port": PORT, "auth": "off", "request_timeout_s": 60, "max_tokens": 16, **extra,
                                     "models": [{"name": "tiny-vl", "path": vl_path}, {"name": "tiny", "path": tiny_path}]}))

    deploy()
    yield {"path": vl_path, "deploy": deploy}
    serve.delete(APP_NAME)  # Serve stays up for the next module (tests/conftest.py SERVE_PORT)


def _client():
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", max_retries=0, timeout=60)


def _ask(picture_url: str, model: str = "tiny-vl", **kw):
    return _client().chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": picture_url}}, {"type": "text", "text": QUESTION}]}], **kw)


def test_image_url_chat_answers_as_the_model_does_on_that_picture(vl_served):
    from otray.actors.sampling.backends.hf import HFBackend
    from otray.vlm import observation_prompt

    backend = HFBackend(vl_served["path"])
    for seed in range(3):
        picture = draw(scene(seed)[1])
        ids, images = observation_prompt(backend.tokenizer, [], [picture, QUESTION])
        local = backend.generate([ids], SamplingParams(max_tokens=6, temperature=0), 1, images=[tuple(images)])[0][0]
        want = backend.tokenizer.decode([t for t in local.token_ids if t not in backend.stop_token_ids],
                                        skip_special_tokens=True)
        answer = _ask(picture.data_url())
        assert answer.choices[0].message.content == want
        assert answer.usage.prompt_tokens == len(ids)  # the picture's 4 image tokens counted
        streamed = "".join(c.choices[0].delta.content or "" for c in _ask(picture.data_url(), stream=True) if c.choices)
        assert streamed == want


def test_bad_images_are_400s_naming_the_problem(vl_served):
    import openai

    picture = draw(scene(0)[1])
    cases = [("https://example.com/cat.png", "tiny-vl", "is remote and this server does not fetch images"),
             ("data:image/png;base64,AAAA", "tiny-vl", "unreadable image"),
             (picture.data_url(), "tiny", "an image was given to a text-only model")]
    for url, model, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            _ask(url, model)


def test_remote_images_fetched_where_the_admin_allows(vl_served):
    picture = draw(scene(1)[1])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            body = picture.data if self.path == "/shapes.png" else b"no"
            self.send_response(200 if self.path == "/shapes.png" else 404)
            self.send_header("content-type", "image/png")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        vl_served["deploy"](fetch_image_urls=True)
        base = f"http://127.0.0.1:{server.server_address[1]}"
        fetched = _ask(f"{base}/shapes.png").choices[0].message.content
        assert fetched == _ask(picture.data_url()).choices[0].message.content
        import openai

        with pytest.raises(openai.BadRequestError, match="could not fetch the image"):
            _ask(f"{base}/missing.png")
    finally:
        server.shutdown()
        vl_served["deploy"]()
