"""The session timeline behind export_session_trace (otray/tinker/service/timeline.py): grouping by session and
track, the caps on spans and sessions, and the Trace Event Format it writes. Pure: no Ray, no service."""

from __future__ import annotations

import json

from otray.tinker.service.timeline import Timeline, chrome_trace


def test_requests_group_by_session_and_track_and_the_caps_drop_the_oldest():
    t = Timeline(max_spans=3, max_sessions=2)
    t.opened("s-a:train:0:req:1", "forward_backward")
    t.running("s-a:train:0:req:1")
    t.closed("s-a:train:0:req:1", "ok")
    t.opened("sample:s-a:sampler:0:1", "sample")
    t.opened("sample:0f3c9e", "sample")  # a base model sampled without a session: not kept
    t.opened("sample:s-a:sampler:0:1", "sample")  # a resubmission while open: the same span
    assert [s.kind for s in t.spans("s-a")] == ["forward_backward", "sample"] and "0f3c9e" not in t.sessions
    for seq in range(2, 5):
        t.opened(f"s-a:train:0:req:{seq}", "optim_step")
    assert [s.request_id.rsplit(":", 1)[1] for s in t.spans("s-a")] == ["2", "3", "4"]  # the newest 3
    t.opened("s-b:train:0:req:1", "forward_backward")
    t.opened("s-c:train:0:req:1", "forward_backward")
    assert list(t.sessions) == ["s-b", "s-c"]  # the least recently used session went first


def test_the_trace_has_a_track_per_client_and_marks_what_is_still_pending():
    t = Timeline()
    t.opened("s-a:train:0:req:1", "forward_backward")
    t.running("s-a:train:0:req:1")
    t.closed("s-a:train:0:req:1", "user error")
    t.opened("sample:s-a:sampler:2:7", "sample")
    trace = json.loads(chrome_trace("s-a", t.spans("s-a")))
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["sampler:2", "train:0"]
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], names[e["tid"]]) for e in slices] == [
        ("forward_backward", "train:0"), ("running", "train:0"), ("sample", "sampler:2")]
    assert slices[0]["args"]["outcome"] == "user error" and slices[2]["args"]["outcome"] == "pending"
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
