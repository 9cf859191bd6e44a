"""Stability info and provenance: what ``stable_reinforce`` trains on.

A sampling client made with ``record_stability_info=True`` has every sampled sequence recorded
here under its ``sequence_id`` (the id the ``asample`` promise names): the prompt, the sampled
tokens and the sampler's logprob of each, in the sampler's own numerics. A training datum names
those sequences in its provenance (the SDK's ``Datum.with_provenance``): runs of
``PromptProvenanceSpan`` / ``SampledProvenanceSpan`` that tile its ``model_input`` and its
``target_tokens``. :func:`resolve` checks every run against the recording (the tokens must be the
ones recorded) and gives the datum the recorded logprobs of its sampled tokens, so the loss's
importance weight is taken against what the sampler really computed, not what a client sent.

As Tinker documents: a recording belongs to the session that sampled it, and can be trained on for
a day after its last use (``stability_ttl_s``); another session's, an expired or an unknown id is a
user error naming it. Recordings live in the service actor's memory as int32/float32 arrays, at most
``stability_max_sequences`` of them and ``stability_max_tokens`` tokens (the least recently used go
first; 50M tokens is ~0.4 GB), and not across a restart.

Runs in the TinkerService actor."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace
import numpy as np

from otray.tinker.service.store import session_of
from otray.tinker.wire.messages import DatumSpans, TrainCall
from otray.tinker.errors import UserError
from otray.types import Datum

PROMPT, SAMPLED = "prompt_tokens", "sampled_tokens"  # the ProvenanceSpan oneof's arms (wire.Span.kind)


@dataclass(frozen=True)
class Recorded:
    """One sampled sequence as the sampler produced it (compact arrays: a request's samples share
    their prompt's)."""

    owner: str
    session_id: str
    prompt: np.ndarray  # int32
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32

    @property
    def size(self) -> int:
        return len(self.tokens) + len(self.prompt)


@dataclass
class Provenance:
    """What a stable_reinforce datum gets from its recordings: per target position, the sampler's
    logprob (0 where not sampled) and 1 where the position is a sampled token."""

    sampler_logprobs: list[float]
    sampled: list[float]


class Recordings:
    def __init__(self, ttl_s: float = 86400.0, max_sequences: int = 200_000, max_tokens: int = 50_000_000):
        self.ttl_s, self.max_sequences, self.max_tokens = ttl_s, max_sequences, max_tokens
        self.items: OrderedDict[str, tuple[Recorded, float]] = OrderedDict()  # least recently used first
        self.tokens = 0  # prompt + sampled tokens held (a shared prompt counted per sequence: an upper bound)
        self.recorded = self.trained = 0  # sequences recorded, and named by training requests, since start

    def add(self, sequence_id: str, rec: Recorded) -> None:
        self.recorded += 1
        old = self.items.pop(sequence_id, None)
        self.tokens += rec.size - (old[0].size if old else 0)
        self.items[sequence_id] = (rec, time.monotonic())
        self._expire()

    def take(self, owner: str, session_id: str, ids: set[str]) -> dict[str, Recorded]:
        """The recordings of ``ids``, each used now (its day starts again); any that is unknown,
        expired or another session's is a :class:`UserError` naming it."""
        self._expire()
        out: dict[str, Recorded] = {}
        for sid in sorted(ids):
            hit = self.items.get(sid)
            if hit is None or hit[0].owner != owner or hit[0].session_id != session_id:
                raise UserError(f"sequence_id {sid!r} has no stability info in this session: sample it with a "
                                "sampling client made with record_stability_info=True, in the same session as "
                                f"the training client, and train on it within {self.ttl_s / 3600:g} h of its last use")
            out[sid] = hit[0]
        now = time.monotonic()
        self.trained += len(out)
        for sid in out:
            self.items[sid] = (out[sid], now)
            self.items.move_to_end(sid)
        return out

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self.items and (len(self.items) > self.max_sequences or self.tokens > self.max_tokens
                              or next(iter(self.items.values()))[1] < cutoff):
            self.tokens -= self.items.popitem(last=False)[1][0].size


def with_recordings(call: TrainCall, recordings: Recordings, owner: str) -> list[Datum]:
    """A stable_reinforce call's datums, each given the recorded sampler logprobs of its sampled
    tokens (``sampler_logprobs``) and those positions as its ``ratio_mask``; any datum whose
    provenance does not match its recordings is a :class:`UserError` naming the datum."""
    ids = {s.sequence_id for d in call.spans if d is not None for s in (*d.model_input, *d.targets)}
    recs = recordings.take(owner, session_of(call.model_id), ids)
    out = []
    for i, (datum, spans) in enumerate(zip(call.datums, call.spans)):
        assert spans is not None  # wire refuses a stable_reinforce datum without provenance
        prov = resolve(f"datum {i}", datum.input_ids, datum.target_ids, datum.advantages, spans, recs)
        out.append(replace(datum, sampler_logprobs=prov.sampler_logprobs, ratio_mask=prov.sampled))
    return out


def resolve(where: str, tokens: list[int], targets: list[int], advantages: list[float], spans: DatumSpans,
            recs: dict[str, Recorded]) -> Provenance:
    """Check a datum's provenance against the recordings; its sampler logprobs and sampled positions.
    Every ``model_input`` token must be the one its span names, and every target of a sampled span
    (the targets of a prompt span carry no loss and are often padding, as in the cookbook's datums).
    An advantage on a position that is not a sampled token is refused (only sampled tokens have a
    recorded logprob to weigh against)."""
    for field, ids, runs in (("model_input", tokens, spans.model_input), ("target_tokens", targets, spans.targets)):
        pos = 0
        for span in runs:
            rec = recs[span.sequence_id]
            source = rec.prompt if span.kind == PROMPT else rec.tokens
            what = "prompt" if span.kind == PROMPT else "sampled tokens"
            if span.offset + span.length > len(source):
                raise UserError(f"{where}: a {field} span reads positions {span.offset}..{span.offset + span.length} "
                                f"of sequence {span.sequence_id!r}'s {what}, which has {len(source)}")
            got = ids[pos:pos + span.length]
            want = source[span.offset:span.offset + span.length].tolist()
            if got != want and (field == "model_input" or span.kind == SAMPLED):
                k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                raise UserError(f"{where}: {field}[{pos + k}] is token {got[k]} but its span says it is token "
                                f"{want[k]} ({what} position {span.offset + k} of sequence {span.sequence_id!r})")
            pos += span.length
    q, sampled = [0.0] * len(targets), [0.0] * len(targets)
    pos = 0
    for span in spans.targets:
        if span.kind == SAMPLED:
            q[pos:pos + span.length] = recs[span.sequence_id].logprobs[span.offset:span.offset + span.length].tolist()
            sampled[pos:pos + span.length] = [1.0] * span.length
        pos += span.length
    bad = next((i for i, (a, s) in enumerate(zip(advantages, sampled)) if a != 0.0 and not s), None)
    if bad is not None:
        raise UserError(f"{where}: advantages[{bad}] is {advantages[bad]:g} on a position that is not a sampled "
                        "token; stable_reinforce takes advantages on sampled tokens only (put prompt-side "
                        "penalties into the sampled tokens' advantages)")
    return Provenance(q, sampled)

