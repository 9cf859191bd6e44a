"""Streamed answers of an HF model decoded in turns: each turn adds ``stream_chunk_tokens`` tokens to the
sequences so far with their KV cache (:class:`~otray.actors.sampling.backends.hf_turns.Turns`), so a streamed
answer costs what the complete one costs, not a prompt computed again for every chunk.

Streamed requests with equal sampling settings and ``n`` that wait together form one group: one ``Turns`` over
all their prompts, whose turns any member's reader runs, once per turn (a reader that finds a turn newer than
what it has read takes it without running another). Before a group forms, its first reader waits up to
``batch_wait_ms`` for as many prompts as were streaming when the last groups ended, as the complete answers'
batcher (:class:`~otray.serve.batching.Loaded`) waits for its calls: closed-loop clients come back
together. A seeded request streams alone, its samples equal to its complete answer's. Turns and the batcher's
calls take the model's one lock in turn, so complete answers run between a stream's turns.

Runs in a Serve replica's process (the ModelServer, or the Gateway in the single layout), on its generate
threads."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from otray.serve.recent_load import RecentLoad
from otray.types import FinishReason, SamplingParams

Sofar = tuple[list[int], Optional[FinishReason]]  # a sample's tokens so far, and its finish reason once it ended


@dataclass(eq=False)
class Stream:
    """One streamed request: its prompt, sampling settings (its stop strings included), ``n`` and tokens a turn;
    its rows (``first`` to ``first + n``) of a group once one forms."""

    prompt: list[int]
    params: SamplingParams
    n: int
    chunk: int
    group: Optional["_Group"] = None
    first: int = 0


@dataclass(eq=False)
class _Group:
    """Streams decoded together: their call (``turns``), how many turns it made (``version``), every row's
    tokens after the last one, whether the call is done, and the error that ended it."""

    turns: Any
    members: list[Stream]
    version: int = 0
    sofar: list[Sofar] = field(default_factory=list)
    finished: bool = False
    error: Optional[BaseException] = None


class StreamTurns:
    """The streams of one model (an HF backend with ``turns``): :meth:`open` one, read it with :meth:`next` (from
    a generate thread: it blocks), :meth:`close` it when its reader is done (or gone)."""

    def __init__(self, backend: Any, lock: threading.Lock, max_batch: int, batch_wait_s: float):
        self.backend, self.lock, self.max_batch = backend, lock, max(1, max_batch)
        self.queue: list[Stream] = []
        self.arrived = threading.Condition()
        self.load = RecentLoad(batch_wait_s, self.max_batch)  # streams: what a group waits to gather

    def open(self, prompt: list[int], params: SamplingParams, n: int, chunk: int) -> Stream:
        stream = Stream(prompt, params, n, max(1, chunk))
        with self.arrived:
            self.queue.append(stream)
            self.arrived.notify_all()
        return stream

    def next(self, stream: Stream, seen: int) -> tuple[int, list[Sofar], bool]:
        """The stream's samples after the first turn past the ``seen``-th of its group (running that turn when
        no other reader has): ``(turns so far, each sample's tokens so far, whether they all ended)``."""
        with self.lock:
            if stream.group is None:
                self._form(stream)
            group = stream.group
            if group.version == seen and not group.finished:
                try:
                    group.finished = group.turns.turn()
                    group.sofar = group.turns.sofar()
                except BaseException as e:  # noqa: BLE001 - every member's reader gets it
                    group.error, group.finished = e, True
                group.version += 1
                if group.finished:
                    with self.arrived:
                        self.load.ended(len(group.members) + len(self.queue))
            if group.error is not None:
                raise group.error
            return group.version, group.sofar[stream.first:stream.first + stream.n], group.finished

    def close(self, stream: Stream) -> None:
        """The stream's reader is done: a stream still queued leaves the queue; a group's rows of it are decoded
        with the others until the group ends (the group goes with its last reader)."""
        with self.arrived:
            if stream in self.queue:
                self.queue.remove(stream)

    def _form(self, stream: Stream) -> None:
        """A group for ``stream`` (called under the model's lock): the queued streams that may share its call,
        after waiting up to ``batch_wait_s`` for the recent load."""
        with self.arrived:
            if stream.params.seed is None:  # (a seeded stream starts alone at once)
                self.load.gather(self.arrived, lambda: len(self.queue))
            members = [stream]
            if stream.params.seed is None:  # a seeded stream alone: its samples must not depend on others
                members += [s for s in self.queue if s is not stream and s.params == stream.params
                            and s.n == stream.n and s.chunk == stream.chunk][:self.max_batch - 1]
            for s in members:
                if s in self.queue:
                    self.queue.remove(s)
        self._start(members)

    def _start(self, members: list[Stream]) -> None:
        """``members``' call; one that cannot start (a prompt past the context) starts each member alone, so one
        bad request fails only its own reader."""
        group, first = _Group(None, members), members[0]
        for i, s in enumerate(members):
            s.group, s.first = group, i * first.n
        try:
            group.turns = self.backend.turns([s.prompt for s in members], first.params, first.n,
                                             turn_tokens=first.chunk)
        except BaseException as e:  # noqa: BLE001 - its readers get the error
            if len(members) > 1:
                for s in members:
                    self._start([s])
            else:
                group.error, group.finished = e, True
