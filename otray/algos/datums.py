"""Trajectories -> learner datums (the shift by one, masks, aligned logprobs).

For a sequence ``seq`` of length L the learner predicts token ``t+1`` from the
prefix ending at ``t``; so ``input_ids = seq[:-1]`` and every per-token field
describes the *target* ``seq[1:]``: its loss mask, its sampler logprob, its
advantage. A sampled first token cannot be a target (nothing precedes it), which
never happens because every episode starts with a prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from otray.types import Datum, Trajectory
from otray.vlm import VisionInputs


def trajectory_to_datum(traj: Trajectory, advantage: float) -> Datum:
    """One trajectory with one scalar advantage spread over its sampled tokens."""
    seq = traj.token_ids
    if len(seq) < 2:
        raise ValueError("a trajectory needs at least two tokens to make a datum")
    mask = [float(m) for m in traj.loss_mask[1:]]
    return Datum(
        input_ids=list(seq[:-1]),
        target_ids=list(seq[1:]),
        mask=mask,
        advantages=[advantage * m for m in mask],
        sampler_logprobs=list(traj.logprobs[1:]),
        images=tuple(traj.images),
    )


def build_datums(trajs: Sequence[Trajectory], advantages: Sequence[float]) -> list[Datum]:
    """Datums for the trajectories that sampled anything (errors with no tokens drop out)."""
    return [
        trajectory_to_datum(t, a)
        for t, a in zip(trajs, advantages, strict=True)
        if t.num_sampled > 0 and len(t.token_ids) >= 2
    ]


def sft_datum(prompt_ids: Sequence[int], completion_ids: Sequence[int], images: Sequence[object] = ()) -> Datum:
    """A supervised datum: cross-entropy on the completion tokens only (``images``: the prompt's, whose
    expanded image tokens ``prompt_ids`` holds)."""
    traj_mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
    seq = list(prompt_ids) + list(completion_ids)
    mask = [float(m) for m in traj_mask[1:]]
    return Datum(
        input_ids=seq[:-1],
        target_ids=seq[1:],
        mask=mask,
        advantages=[0.0] * len(mask),
        sampler_logprobs=[0.0] * len(mask),
        weights=list(mask),
        images=tuple(images),
    )


def chat_datum(tokenizer, messages: Sequence[dict[str, str]], *, train_role: str = "assistant") -> Datum:
    """Cross-entropy on the ``train_role`` messages of one conversation, nothing else.

    The conversation is rendered by the tokenizer's chat template prefix by prefix,
    so each trained message's tokens are exactly those a sampler would have produced
    after the generation prompt: its content and its end-of-turn token (mask 1).
    Template text after the end-of-turn token (a newline) and every other message
    get mask 0. A template whose renderings are not prefixes of each other cannot be
    split this way and raises ``DatasetError``.

    A message's content may show images (OpenAI content parts with ``image_url`` data URLs, or
    ``otray.vision`` parts): a vision-language model's template renders them, and each image's token
    is widened to the model's image tokens (mask 0) in the datum, which carries the images.
    """
    from otray.models import chat_prompt_ids, end_of_turn_ids
    from otray.types import DatasetError
    from otray.vision import ImageError, images_of, template_content
    from otray.vlm import vision_inputs_at

    if not messages or not any(isinstance(m, dict) and m.get("role") == train_role for m in messages):
        raise DatasetError(f"a conversation needs at least one {train_role!r} message to train on")
    images = []
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), (str, list)):
            raise DatasetError(f"message {i} must be an object with a string 'role' and a 'content' (a string or a "
                               f"list of content parts), got {str(m)[:200]}")
        try:
            images += images_of(m["content"])
            rendered.append({"role": m["role"], "content": template_content(m["content"])})
        except ImageError as e:
            raise DatasetError(f"message {i}: {e}") from None
    messages = rendered
    try:
        vision = vision_inputs_at(str(getattr(tokenizer, "name_or_path", ""))) if images else None
    except ImageError as e:  # an image for a text-only model
        raise DatasetError(str(e)) from None
    eot = set(end_of_turn_ids(tokenizer))
    seq: list[int] = []
    mask: list[int] = []
    for i, msg in enumerate(messages):
        full = chat_prompt_ids(tokenizer, list(messages[: i + 1]), add_generation_prompt=False)
        head = (chat_prompt_ids(tokenizer, list(messages[:i]), add_generation_prompt=True)
                if msg["role"] == train_role else full)
        if head[: len(seq)] != seq or full[: len(head)] != head:
            raise DatasetError("the chat template does not render this conversation prefix by prefix "
                               f"(message {i}); SFT on it needs a template whose turns only append tokens")
        span = full[len(head):]
        ends = [j for j, t in enumerate(span) if t in eot]
        trained = ends[-1] + 1 if ends else len(span)
        mask += [0] * (len(head) - len(seq)) + [1] * trained + [0] * (len(span) - trained)
        seq = full
    if vision is not None:
        seq, mask = _widen_images(vision, seq, mask, images)
    return Datum(input_ids=seq[:-1], target_ids=seq[1:], mask=[float(m) for m in mask[1:]],
                 advantages=[0.0] * (len(seq) - 1), sampler_logprobs=[0.0] * (len(seq) - 1),
                 weights=[float(m) for m in mask[1:]], images=tuple(images))


def _widen_images(vision: VisionInputs, seq: list[int], mask: list[int], images: list) -> tuple[list[int], list[int]]:
    """``seq`` with each image's one template token widened to its model's image tokens, ``mask`` alike (0)."""
    from otray.types import DatasetError
    from otray.vision import ImageError

    try:
        wide = vision.expand(seq, images)
    except ImageError as e:
        raise DatasetError(str(e)) from None
    out_mask: list[int] = []
    j = 0
    for t, m in zip(seq, mask):
        if t == vision.image_token_id:
            n = vision.tokens_per_image(images[j])
            j += 1
            out_mask.extend([0] * n)
        else:
            out_mask.append(m)
    return wide, out_mask
