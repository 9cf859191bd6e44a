"""The Serve app's config (otray/serve/config.py): bundled files load, bad values are named."""

from pathlib import Path

import pytest

from otray.serve import config
from otray.types import ConfigError

from tests.conftest import ROOT  # noqa: E402 (the repository root)


def test_bundled_serve_configs_load_with_overrides():
    files = sorted((ROOT / "conf" / "serve").glob("*.yaml"))
    assert files
    for f in files:
        cfg = config.load_serve(f, ["port=8123"])
        assert isinstance(cfg, config.ServeConfig) and cfg.port == 8123 and cfg.models


def test_unknown_and_mistyped_keys_are_named():
    with pytest.raises(ConfigError, match=r"unknown config key 'models\[0\].max_batc'; did you mean 'models\[0\].max_batch'"):
        config.load_serve({"models": [{"name": "m", "max_batc": 4}]})
    with pytest.raises(ConfigError, match=r"unknown config key 'prot'; did you mean 'port'"):
        config.load_serve(None, ["prot=9000"])
    with pytest.raises(ConfigError, match=r"port"):
        config.load_serve({"port": "eighty"})
    with pytest.raises(ConfigError, match=r"model names must be unique"):
        config.load_serve({"models": [{"name": "a"}, {"name": "a"}]})


def test_serve_lora_settings():
    with pytest.raises(ConfigError, match=r"max_lora_rank serves adapters on a vLLM engine.*backend: vllm"):
        config.load_serve({"models": [{"name": "m", "backend": "hf", "max_lora_rank": 8}]})
    with pytest.raises(ConfigError, match=r"max_lora_rank must be >= 0"):
        config.load_serve({"models": [{"name": "m", "backend": "vllm", "max_lora_rank": -1}]})
    assert config.load_serve({"models": [{"name": "m", "backend": "vllm", "max_lora_rank": 16}]}).models[0].max_lora_rank == 16


def test_serve_layout():
    from otray.serve.app import single_layout

    two = [{"name": "a"}, {"name": "b"}]
    with pytest.raises(ConfigError, match=r"layout: single serves one base model.*a, b.*layout: split"):
        config.load_serve({"models": two, "layout": "single"})
    with pytest.raises(ConfigError, match=r"layout"):
        config.load_serve({"layout": "merged"})
    assert single_layout(config.load_serve({}))
    assert not single_layout(config.load_serve({"models": two}))
    assert not single_layout(config.load_serve({"layout": "split"}))


@pytest.mark.parametrize("loader, source, says", [
    ("serve", {"port": 0}, "port must be >= 1 and <= 65535, got 0"),
    ("serve", {"max_n": 0}, "max_n must be >= 1, got 0"),
    ("serve", {"request_timeout_s": 0}, "request_timeout_s must be > 0, got 0"),
    ("serve", {"models": [{"name": "tiny", "max_lora_rank": -1}]}, "models[0].max_lora_rank must be >= 0, got -1"),
    ("tinker", {"long_poll_s": 41}, "long_poll_s must be > 0 and <= 40, got 41"),
    ("tinker", {"gap_timeout_s": -1}, "gap_timeout_s must be > 0, got -1"),
    ("tinker", {"models": [{"name": "a", "max_rank": 0}]}, "models[0].max_rank must be >= 1, got 0"),
    ("tinker", {"models": [{"name": "a"}, {"name": "b", "sampler": {"max_loras": 0}}]},
     "models[1].sampler.max_loras must be >= 1, got 0"),
])
def test_service_configs_check_numbers_from_one_table(loader, source, says):
    """``otray serve`` and ``otray tinker`` configs are range-checked like jobs (otray.ranges): the error
    names the key (a list item by index), the value and the range."""
    from otray.serve.config import load_serve
    from otray.tinker.config import load_tinker

    with pytest.raises(ConfigError) as e:
        (load_serve if loader == "serve" else load_tinker)(source)
    assert str(e.value).startswith(says), str(e.value)
