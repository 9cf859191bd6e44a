"""OpenReward environments for otray's tests and benchmarks/env_io.py, served by the real SDK.

``python -m tests.openreward_envs --port P`` serves ``Echo`` (the default env), ``Faulty`` and
``Slow``:

- ``Echo``: ``say(text)`` answers the text back with reward None; ``finish(ok)`` ends the
  episode with reward 1.0 or 0.0, or ``finished: False`` with no reward when ``ok`` is null
  (an episode the env ended unfinished); ``score_group`` scores a group by reply length rank.
- ``Faulty``: ``boom()`` raises (the SDK's ToolFailed), ``hang()`` never returns.
- ``Slow``: ``wait()`` sleeps ``SLOW_S`` seconds and rewards 1.0 on the third call (finishing).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any, Optional

from openreward.environments import Environment, GroupScore, Server, TextBlock, ToolOutput, tool
from pydantic import BaseModel

SLOW_S = 0.2


class _Tasks(Environment):
    @classmethod
    def list_splits(cls) -> list[str]:
        return ["train", "test"]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict[str, Any]]:
        return [{"n": i, "split_name": split} for i in range(20 if split == "train" else 5)]

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(text=f"{type(self).__name__} task {self.task_spec['n']}")]


class SayArgs(BaseModel):
    text: str


class FinishArgs(BaseModel):
    ok: Optional[bool] = None


class NoArgs(BaseModel):
    pass


class Echo(_Tasks):
    @tool
    async def say(self, params: SayArgs) -> ToolOutput:
        """Echo the text."""
        return ToolOutput(blocks=[TextBlock(text=params.text)])

    @tool
    async def finish(self, params: FinishArgs) -> ToolOutput:
        """End the episode."""
        if params.ok is None:
            return ToolOutput(blocks=[TextBlock(text="given up")], finished=True, metadata={"finished": False})
        return ToolOutput(blocks=[TextBlock(text="done")], reward=1.0 if params.ok else 0.0, finished=True)

    async def score_group(self, candidates: Any) -> list[GroupScore]:
        lengths = [sum(len(getattr(b, "text", "")) for m in c.messages for b in m.blocks) for c in candidates]
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        return [GroupScore(reward=float(order.index(i))) for i in range(len(lengths))]


class Faulty(_Tasks):
    @tool
    async def boom(self, params: NoArgs) -> ToolOutput:
        """Raise."""
        raise RuntimeError("the tool broke")

    @tool
    async def hang(self, params: NoArgs) -> ToolOutput:
        """Never return."""
        await asyncio.sleep(3600)
        return ToolOutput(blocks=[])


class PeakArgs(BaseModel):
    reset: bool = False


class Slow(_Tasks):
    calls = 0
    inflight = most = 0  # over all sessions of this server: wait() calls running at once, and the most seen

    @tool
    async def wait(self, params: NoArgs) -> ToolOutput:
        """Wait a while; the third call finishes with reward 1."""
        Slow.inflight += 1
        Slow.most = max(Slow.most, Slow.inflight)
        try:
            await asyncio.sleep(SLOW_S)
        finally:
            Slow.inflight -= 1
        self.calls += 1
        return ToolOutput(blocks=[TextBlock(text=f"waited {self.calls}")], reward=1.0 if self.calls >= 3 else None,
                          finished=self.calls >= 3)

    @tool
    async def peak(self, params: PeakArgs) -> ToolOutput:
        """The most wait() calls seen running at once (and start counting afresh with reset)."""
        seen = Slow.most
        if params.reset:
            Slow.most = 0
        return ToolOutput(blocks=[TextBlock(text=str(seen))])


if __name__ == "__main__":
    os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8092)
    Server([Echo, Faulty, Slow]).run(host="127.0.0.1", port=parser.parse_args().port)
