"""Any Gymnasium env as an otray env (``entry: gymnasium``): text spaces as they are, image spaces as
image parts (a vision-language model's observations), other spaces through ``obs_to_text``/``text_to_action``;
rejected actions are counted, not sent."""

from __future__ import annotations

from typing import Any

from otray.env import Env, StepResult
from otray.structured import import_object
from otray.types import ConfigError, EnvStateError, Task


class GymnasiumEnv(Env):
    """Any Gymnasium env as an otray env.

    ``env``: a ``gymnasium.Env``, a registered Gymnasium id (``gymnasium.make(id,
    **make_kwargs)``) or an import path ``module:Class`` (called with ``make_kwargs``).
    Observations and actions must be text (``gymnasium.spaces.Text``), unless you
    give ``obs_to_text(obs, info) -> str`` (or a list of parts: :mod:`otray.vision`) and/or
    ``text_to_action(text) -> action`` (functions or import paths). An image observation space (a
    ``uint8`` ``Box`` of shape ``(H, W)``, ``(H, W, 1)`` or ``(H, W, 3)``) needs no ``obs_to_text``: each
    observation becomes ``[Image, image_prompt]`` for a vision-language model. A reply that ``text_to_action`` rejects (raises
    ``ValueError``) or that the action space does not contain is not sent to the env:
    the policy is told why and gets ``invalid_action_reward``; ``info["invalid_actions"]``
    counts them. The Gymnasium episode's ``terminated or truncated`` is ``done``, and so
    is reaching ``max_turns`` (default: the env spec's ``max_episode_steps``, else 1).
    """

    def __init__(self, env: Any, *, obs_to_text: Any = None, text_to_action: Any = None,
                 make_kwargs: dict[str, Any] | None = None, max_turns: int | None = None,
                 invalid_action_reward: float = 0.0, system_prompt: str | None = None,
                 image_prompt: str = "What do you do next?"):
        import gymnasium as gym

        if isinstance(env, str):
            env = import_object(env)(**(make_kwargs or {})) if ":" in env else gym.make(env, **(make_kwargs or {}))
        self.env = env
        self.obs_to_text = import_object(obs_to_text) if isinstance(obs_to_text, str) else obs_to_text
        self.text_to_action = import_object(text_to_action) if isinstance(text_to_action, str) else text_to_action
        name = type(getattr(env, "unwrapped", env)).__name__
        self.image_prompt = image_prompt
        self.images = is_image_space(env.observation_space)
        if self.obs_to_text is None and not (isinstance(env.observation_space, gym.spaces.Text) or self.images):
            raise ConfigError(f"{name}'s observation space is {env.observation_space}, neither gymnasium.spaces.Text "
                              "nor an image (a uint8 Box of shape (H, W[, 1 or 3])): give obs_to_text(obs, info) -> str")
        if self.text_to_action is None and not isinstance(env.action_space, gym.spaces.Text):
            raise ConfigError(f"{name}'s action space is {env.action_space}, not gymnasium.spaces.Text: "
                              "give text_to_action(text) -> action")
        spec = getattr(env, "spec", None)
        self.max_turns = max_turns or (spec.max_episode_steps if spec and spec.max_episode_steps else 1)
        self.invalid_action_reward = invalid_action_reward
        self.system_prompt = system_prompt
        self._live = False
        self._invalid = 0

    def _text(self, obs: Any, info: dict[str, Any]) -> Any:
        if self.obs_to_text is not None:
            return self.obs_to_text(obs, info)
        if self.images:
            return [image_of(obs), self.image_prompt]
        return str(obs)

    def reset(self, task: Task, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        seed = task.data.get("seed", seed)
        obs, info = self.env.reset(seed=seed, options=task.data.get("options"))
        self._live, self._invalid, self._turn = True, 0, 0
        return self._text(obs, info), dict(info)

    def step(self, action: str) -> StepResult:
        if not self._live:
            raise EnvStateError("GymnasiumEnv.step called before reset (or after the episode ended)")
        self._turn += 1
        out_of_turns = self._turn >= self.max_turns
        try:
            act = self.text_to_action(action) if self.text_to_action is not None else action
            if not self.env.action_space.contains(act):
                raise ValueError(f"{act!r} is not in the action space {self.env.action_space}")
        except ValueError as e:
            self._invalid += 1
            self._live = not out_of_turns
            return StepResult(f"Invalid action: {e}", float(self.invalid_action_reward), out_of_turns,
                              {"invalid_actions": self._invalid})
        obs, reward, terminated, truncated, info = self.env.step(act)
        done = bool(terminated or truncated or out_of_turns)
        self._live = not done
        return StepResult("" if done else self._text(obs, info), float(reward), done,
                          {**info, "truncated_by_env": bool(truncated), "invalid_actions": self._invalid})

    def close(self) -> None:
        self.env.close()


def is_image_space(space: Any) -> bool:
    """Whether a Gymnasium space holds pictures: a ``uint8`` Box of shape ``(H, W)``, ``(H, W, 1)`` or ``(H, W, 3)``."""
    import gymnasium as gym
    import numpy as np

    shape = getattr(space, "shape", None) or ()
    return (isinstance(space, gym.spaces.Box) and space.dtype == np.uint8
            and (len(shape) == 2 or (len(shape) == 3 and shape[2] in (1, 3))))


def image_of(obs: Any) -> Any:
    """An image observation (a ``uint8`` array) as an :class:`otray.vision.Image` (PNG)."""
    import numpy as np
    from PIL import Image as PILImage

    from otray.vision import Image

    pixels = np.asarray(obs, dtype=np.uint8)
    return Image.from_pil(PILImage.fromarray(pixels[..., 0] if pixels.ndim == 3 and pixels.shape[2] == 1 else pixels))
