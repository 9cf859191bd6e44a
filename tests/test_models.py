import hashlib

import pytest

from otray.models import LoraSpec, apply_lora, build_tiny_model, load_model, load_tokenizer
from otray.types import ModelLoadError


def _digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_tiny_model_is_byte_identical_per_seed(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=0)
    b = build_tiny_model(tmp_path / "b", seed=0)
    c = build_tiny_model(tmp_path / "c", seed=1)
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]


def test_tiny_model_shape_and_tokenizer(tiny_path, tokenizer):
    model = load_model(tiny_path)
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert cfg.hidden_size // cfg.num_attention_heads >= 32
    # single-digit tokens, a chat template, an end-of-turn eos
    assert len(tokenizer.encode("12345", add_special_tokens=False)) == 5
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist.*tiny"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_tokenizer(str(tmp_path / "empty"))


def test_lora_trains_only_the_adapter(tiny_path):
    model = apply_lora(load_model(tiny_path), LoraSpec(rank=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
