"""Vision-language models: the tiny VLM otray builds, and what a model takes for its images.

``build_tiny_vlm(path, seed)`` makes the test and demo VLM: a real Qwen2-VL (transformers'
``Qwen2VLForConditionalGeneration``: its ViT with 14-pixel patches merged 2x2, its
``<|vision_start|><|image_pad|><|vision_end|>`` tokens, its 3-D multimodal rotary positions)
at a tiny size, with otray's tiny tokenizer plus those three tokens, the Qwen2-VL image processor
and a chat template that renders ``{"type": "image"}`` content parts as Qwen2-VL's does.
Byte-identical per seed. A hub Qwen2-VL / Qwen2.5-VL directory loads through the same code.

How images reach a model (:class:`VisionInputs`, one per model directory):

1. a chat template renders each image as one ``<|image_pad|>``; :meth:`VisionInputs.expand` widens
   each to the image's token count (its patch grid / merge size^2, as the model's processor says);
2. the trajectory keeps those ids and the images' encoded bytes (``Trajectory.images``);
3. sampler and learner both call :meth:`VisionInputs.model_kwargs` on the same ids and images:
   ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``, so the model computes the same
   positions and image features in both; an image's pixels are made once per process (cached by digest);
4. neither samples nor scores the vision tokens as text (:func:`unsampled_ids`): a sampled
   ``<|image_pad|>`` would be an image slot without an image to the learner (a tiny model at random
   init samples one within a few steps).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from otray.models import EOT, IM_END, chat_prompt_ids, is_vision_config, is_vision_model, save_seeded, train_tokenizer
from otray.vision import Image, ImageError, images_of, template_content

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_IMAGE_SIDE = 56  # the tiny VLM's processor resizes every image to 56x56: 4x4 patches, 4 tokens
# The tiny VLM's rotary base. Qwen2-VL gives an image token's height and width the last two of three sections
# of the rotary frequencies: at the usual base of 10000 and head_dim 32, one column turned a query by 0.003
# radians at most (one row by 0.1), and the model could not tell left from right: "where is the shape?"
# stayed at chance after 400 warm-up steps, at either vision-tower rate. At 10 the slowest pair turns by
# 0.12 radians a column, and the same warm-up learns it (74% and 100%; docs/notes/learning.md).
TINY_VL_ROPE_THETA = 10.0
DEFAULT_MAX_IMAGES = 8  # images one sequence may hold (``max_images`` in otray_vision.json overrides)


def build_tiny_vlm(path: str | os.PathLike, seed: int = 0, shape: Any = None) -> Path:
    """Build a randomly initialized tiny Qwen2-VL + tokenizer + image processor into ``path``."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from otray.models import SHAPES

    spec = shape or SHAPES["tiny"]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(seed, spec.vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END]})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    start, pad, end = tokenizer.convert_tokens_to_ids([VISION_START, IMAGE_PAD, VISION_END])
    im_end, eot = tokenizer.convert_tokens_to_ids([IM_END, EOT])
    head_dim = spec.hidden_size // spec.num_attention_heads
    side = 3 * head_dim // 16  # mrope sections (time, height, width) of head_dim / 2 rotary pairs: Qwen2-VL's 1:1.5:1.5
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": TINY_VL_ROPE_THETA,
                             "mrope_section": [head_dim // 2 - 2 * side, side, side]},
            bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot, tie_word_embeddings=True),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=spec.hidden_size, num_heads=2, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=pad, video_token_id=pad, vision_start_token_id=start, vision_end_token_id=end,
        tie_word_embeddings=True, torch_dtype="float32")
    save_seeded(Qwen2VLForConditionalGeneration, config, tokenizer, path, seed)
    pixels = TINY_IMAGE_SIDE * TINY_IMAGE_SIDE
    Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels).save_pretrained(path)
    (path / "otray_vision.json").write_text(json.dumps({"max_images": DEFAULT_MAX_IMAGES}))
    (path / "otray_tiny.json").write_text(json.dumps({"seed": seed, "shape": spec.__dict__, "vision": True},
                                                     sort_keys=True))
    return path


VISION_MODULES = ("visual", "vision_tower", "vision_model", "multi_modal_projector")  # Qwen2-VL, LLaVA, Idefics...


def is_vision_param(name: str) -> bool:
    """Whether parameter ``name`` belongs to a vision-language model's vision tower or its projector."""
    return any(part in VISION_MODULES for part in name.split("."))


NEVER = -1e9  # the logit of a token a policy never samples (finite: a prompt's image token is still a target)


def unsampled_ids(config: Any) -> list[int]:
    """Tokens a vision-language policy never samples: its image / video / vision start and end tokens
    (sampling one would make the text look like an image slot to the learner). Sampler and learner both
    set their logits to :data:`NEVER`, so the policy's distribution is the same in both. None for text models."""
    if not is_vision_config(config):
        return []
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(v) for v in (getattr(config, n, None) for n in names) if v is not None})


class VisionInputs:
    """What one vision-language model takes beside token ids, made the same way for sampler and learner.

    ``processor`` is the model's image processor (Qwen2-VL's: resize to its pixel bounds, cut
    ``patch_size`` patches, merge ``merge_size`` x ``merge_size`` of them into one token)."""

    CACHE = 1024  # images whose pixels are kept (least recently used dropped)

    def __init__(self, processor: Any, image_token_id: int, max_images: int = DEFAULT_MAX_IMAGES):
        self.processor = processor
        self.image_token_id = image_token_id
        self.max_images = max_images
        self.merge = int(getattr(processor, "merge_size", 1))
        self._pixels: OrderedDict[str, tuple[Any, Any]] = OrderedDict()

    @classmethod
    def load(cls, path: str, config: Any = None) -> VisionInputs:
        """The inputs of the model at ``path`` (its ``preprocessor_config.json``); ``config``: its config."""
        from transformers import AutoConfig, AutoImageProcessor

        config = config or AutoConfig.from_pretrained(path)
        if not is_vision_config(config):
            raise ImageError(f"the model at {path!r} takes no images (its config has no vision tower): "
                             "use a vision-language model, e.g. model.path: tiny-vl")
        processor = AutoImageProcessor.from_pretrained(path)
        limit = DEFAULT_MAX_IMAGES
        extra = Path(path) / "otray_vision.json"
        if extra.exists():
            limit = int(json.loads(extra.read_text()).get("max_images", limit))
        return cls(processor, int(config.image_token_id), limit)

    def _encode(self, image: Image) -> tuple[Any, Any]:
        """``(pixel_values, grid_thw)`` of one image, cached by its digest."""
        key = image.digest
        hit = self._pixels.get(key)
        if hit is not None:
            self._pixels.move_to_end(key)
            return hit
        out = self.processor(images=[image.to_pil()], return_tensors="pt")
        hit = (out["pixel_values"], out["image_grid_thw"][0])
        self._pixels[key] = hit
        if len(self._pixels) > self.CACHE:
            self._pixels.popitem(last=False)
        return hit

    def tokens_per_image(self, image: Image) -> int:
        """How many ``<|image_pad|>`` tokens ``image`` takes in a prompt."""
        return int(self._encode(image)[1].prod()) // (self.merge * self.merge)

    def check_count(self, images: Sequence[Image]) -> None:
        if len(images) > self.max_images:
            raise ImageError(f"{len(images)} images in one sequence; this model takes at most {self.max_images} "
                             "(otray_vision.json max_images): send fewer images")

    def expand(self, ids: Sequence[int], images: Sequence[Image]) -> list[int]:
        """``ids`` with the k-th image token widened to the k-th image's token count (one token each
        in ``ids``, as a chat template writes them)."""
        self.check_count(images)
        slots = sum(1 for t in ids if t == self.image_token_id)
        if slots != len(images):
            raise ImageError(f"the prompt has {slots} image tokens but {len(images)} images were given: "
                             "every image needs its place in the text (an image part), and no more")
        out: list[int] = []
        k = 0
        for t in ids:
            if t == self.image_token_id:
                out.extend([t] * self.tokens_per_image(images[k]))
                k += 1
            else:
                out.append(t)
        return out

    def check_tokens(self, ids: Sequence[int], images: Sequence[Image]) -> None:
        """Raise :class:`ImageError` unless ``ids`` hold exactly the expanded tokens of ``images``."""
        self.check_count(images)
        want = sum(self.tokens_per_image(im) for im in images)
        have = sum(1 for t in ids if t == self.image_token_id)
        if have != want:
            raise ImageError(f"the sequence holds {have} image tokens but its {len(images)} image(s) take {want}: "
                             "the image tokens must be the ones this model's processor makes for these images")

    def model_kwargs(self, ids: Any, rows: Sequence[Sequence[Image]]) -> dict[str, Any]:
        """The keyword arguments a forward (or ``generate``) over the ``(rows, width)`` tensor ``ids`` takes
        for ``rows[i]``'s images: none when no row has any."""
        import torch

        found = [self._encode(im) for row in rows for im in row]
        if not found:
            return {}
        device = ids.device
        pixels = torch.cat([p for p, _ in found]).to(device)
        grid = torch.stack([g for _, g in found]).to(device)
        return {"pixel_values": pixels, "image_grid_thw": grid,
                "mm_token_type_ids": (ids == self.image_token_id).to(torch.int32)}


@functools.lru_cache(maxsize=8)
def vision_inputs_at(path: str) -> VisionInputs:
    """The :class:`VisionInputs` of the model directory ``path`` (one per process and path)."""
    if not path or not is_vision_model(path):
        raise ImageError(f"an image was given to a text-only model ({path or 'unknown path'}): use a "
                         "vision-language model (e.g. model.path: tiny-vl), or send no images")
    return VisionInputs.load(path)


def vision_inputs(model: Any) -> VisionInputs:
    """The :class:`VisionInputs` of a loaded model (found by its directory, ``config._name_or_path``;
    a PEFT model's config is its base model's)."""
    config = model.config
    if not is_vision_config(config):
        raise ImageError("this model takes no images (a text-only model): use a vision-language model, "
                         "e.g. model.path: tiny-vl, or send text only")
    return vision_inputs_at(str(config._name_or_path))




def observation_prompt(tokenizer: Any, before: list[dict[str, Any]], observation: Any,
                       tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[Image]]:
    """The prompt ids of ``before`` + a user turn showing ``observation`` (with the generation prompt), and
    the observation's images: a plain string as always; images rendered by the chat template and widened
    to the model's image tokens (an ImageError for a text-only model)."""
    images = images_of(observation)
    vision = vision_inputs_at(str(getattr(tokenizer, "name_or_path", ""))) if images else None
    ids = chat_prompt_ids(tokenizer, before + [{"role": "user", "content": template_content(observation)}],
                          tools=tools)
    return (vision.expand(ids, images) if vision else ids), images


class FeatureCache:
    """The vision tower's features per image, for sampling (no gradients): a ``generate`` over ``n``
    samples of a prompt (rows that repeat its images) and an episode's later turns run the tower once
    per distinct image, not once per row and turn. Keyed by the image's digest; the sampler calls
    :meth:`clear` whenever its weights change (a LoRA may cover the vision tower). The learner does not
    use it: its features carry gradients."""

    LAYOUTS = ("qwen2_vl", "qwen2_5_vl")  # models whose features are the tower's pooled output alone

    def __init__(self, size: int = 256, version: Any = None, across_calls: bool = True):
        """``version()``: the weights' version, when they can change without :meth:`clear` (a learner's model
        sampled in place): the cache empties when it changes. ``across_calls`` False: each ``generate``
        starts empty (weights that change with no version to tell)."""
        self.size, self.version, self.across_calls = size, version, across_calls
        self.seen: Any = None  # the version the cached features are of
        self.items: OrderedDict[str, Any] = OrderedDict()
        self.runs = 0  # images the tower ran on
        self.hits = 0  # images answered from the cache

    def clear(self) -> None:
        self.items.clear()

    @contextlib.contextmanager
    def serving(self, model: Any, images: Sequence[Image]) -> Any:
        """Within this block ``model``'s vision tower answers for ``images`` (every image of the batch, in
        the order their pixels are given: :meth:`VisionInputs.model_kwargs`) from the cache, running only
        on the images it has not seen. Any other call (a different image count) runs the tower as usual."""
        now = self.version() if self.version is not None else None
        if not self.across_calls or now != self.seen:
            self.clear()
            self.seen = now
        owner = next((m for m in model.modules() if "get_image_features" in type(m).__dict__ and "visual" in m._modules),
                     None)
        if owner is None or getattr(model.config, "model_type", None) not in self.LAYOUTS:
            yield self  # another layout (e.g. Qwen3-VL's deepstack features): the model encodes as it does
            return
        tower = owner.get_image_features
        digests = [im.digest for im in images]

        def features(pixel_values: Any, image_grid_thw: Any = None, **kwargs: Any) -> Any:
            if image_grid_thw is None or len(image_grid_thw) != len(digests):
                return tower(pixel_values, image_grid_thw, **kwargs)
            return self._features(tower, pixel_values, image_grid_thw, digests, kwargs)

        owner.get_image_features = features
        try:
            yield self
        finally:
            del owner.get_image_features  # the class's method again

    def _features(self, tower: Any, pixels: Any, grid: Any, digests: list[str], kwargs: dict[str, Any]) -> Any:
        import torch
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        rows = grid.prod(-1).tolist()  # pixel rows (patches) per image
        starts = [sum(rows[:i]) for i in range(len(rows))]
        missing = {}  # digest -> the first image with it
        for i, d in enumerate(digests):
            if d not in self.items:
                missing.setdefault(d, i)
        if missing:
            first = list(missing.values())
            out = tower(torch.cat([pixels[starts[i]:starts[i] + rows[i]] for i in first]), grid[first], **kwargs)
            for d, feats in zip(missing, out.pooler_output):
                self.items[d] = feats
        self.runs += len(missing)
        self.hits += len(digests) - len(missing)
        answer = tuple(self.items[d] for d in digests)
        for d in digests:
            self.items.move_to_end(d)
        while len(self.items) > max(self.size, len(set(digests))):
            self.items.popitem(last=False)
        return BaseModelOutputWithPooling(pooler_output=answer)
