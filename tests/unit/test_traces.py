"""runtime.workloads.traces: seeded, shaped as documented, JSONL round trip; scripts/make_trace.py.
Arrival times: Turn.arrival_s / think_s, workloads.with_arrivals, --prompts and trace files."""

from __future__ import annotations

import json
import os
import statistics
import sys

import pytest

from runtime.serve.prompts import load_prompts
from runtime.workloads.generate import Turn, make_workload, with_arrivals
from runtime.workloads.traces import TraceRequest, make_trace, read_jsonl, trace_shape, write_jsonl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import make_trace as make_trace_script  # noqa: E402


def _by_session(trace: list[TraceRequest]) -> dict[int, list[TraceRequest]]:
    out: dict[int, list[TraceRequest]] = {}
    for r in trace:
        out.setdefault(r.session_id, []).append(r)
    return out


@pytest.mark.parametrize("shape", ["chat", "long-replies", "agent"])
def test_same_seed_same_trace(shape):
    small = trace_shape(shape, sessions=5)
    a = make_trace(small, seed=1, vocab=1000)
    assert a == make_trace(small, seed=1, vocab=1000)
    assert a != make_trace(small, seed=2, vocab=1000)
    assert all(0 <= t < 1000 for r in a for t in r.input_tokens + r.output_tokens)
    assert all(r.input_tokens and r.output_tokens for r in a)


def test_chat_prompts_extend_the_history_and_sessions_interleave():
    trace = make_trace(trace_shape("chat", sessions=20), seed=0)
    sessions = _by_session(trace)
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, cur in zip(turns, turns[1:], strict=False):
            history = prev.input_tokens + prev.output_tokens
            assert cur.input_tokens[: len(history)] == history
            assert len(cur.input_tokens) > len(history)  # a new user message
    # Arrival order interleaves sessions (not one session after the other).
    order = [r.session_id for r in trace]
    assert order != sorted(order)
    assert any(len(t) > 1 for t in sessions.values())


def test_long_replies_are_longer_than_chat_replies():
    chat = make_trace(trace_shape("chat", sessions=30), seed=0)
    long = make_trace(trace_shape("long-replies", sessions=30), seed=0)
    chat_median = statistics.median(len(r.output_tokens) for r in chat)
    long_median = statistics.median(len(r.output_tokens) for r in long)
    assert long_median > 3 * chat_median


def test_agent_shares_the_system_prompt_and_collapses_old_observations():
    shape = trace_shape("agent", sessions=4, turns_mean=8.0, keep_observations=2)
    trace = make_trace(shape, seed=0)
    system = trace[0].input_tokens[: shape.system_len]
    assert len(system) == 4096
    assert all(r.input_tokens[: shape.system_len] == system for r in trace)
    diverged = 0
    for turns in _by_session(trace).values():
        for prev, cur in zip(turns, turns[1:], strict=False):
            prefix = prev.input_tokens + prev.output_tokens
            # The previous action is always in the next prompt...
            assert _contains(cur.input_tokens, prev.output_tokens)
            # ...but once an observation is collapsed, the prompt is no longer an
            # extension of the previous one: it diverges inside the cached path.
            if cur.turn > shape.keep_observations:
                assert cur.input_tokens[: len(prefix)] != prefix
                diverged += 1
            else:
                assert cur.input_tokens[: len(prefix)] == prefix
    assert diverged > 0


def _contains(seq: tuple[int, ...], part: tuple[int, ...]) -> bool:
    n = len(part)
    return any(seq[i : i + n] == part for i in range(len(seq) - n + 1))


def test_respond_replaces_replies_and_is_checked():
    shape = trace_shape("chat", sessions=3)
    seen: list[int] = []

    def respond(prompt: tuple[int, ...], n: int) -> list[int]:
        seen.append(len(prompt))
        return [7] * n

    trace = make_trace(shape, seed=0, respond=respond)
    assert all(set(r.output_tokens) == {7} for r in trace)
    assert seen == [len(r.input_tokens) for r in trace]
    drawn = make_trace(shape, seed=0)
    assert [len(r.output_tokens) for r in drawn] == [len(r.output_tokens) for r in trace]
    with pytest.raises(ValueError, match="respond returned 1 tokens"):
        make_trace(shape, seed=0, respond=lambda prompt, n: [1])


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="unknown trace shape"):
        trace_shape("nope")
    with pytest.raises(ValueError, match="unknown TraceShape fields"):
        trace_shape("chat", session=3)
    with pytest.raises(ValueError, match="sessions"):
        trace_shape("chat", sessions=0)
    with pytest.raises(ValueError, match="vocab"):
        make_trace("chat", vocab=1)


def test_jsonl_round_trip_and_errors(tmp_path):
    trace = make_trace(trace_shape("agent", sessions=2, system_len=32), seed=0, vocab=50)
    path = str(tmp_path / "t.jsonl")
    assert write_jsonl(trace, path) == len(trace)
    assert list(read_jsonl(path)) == trace
    lines = [json.loads(line) for line in open(path)]
    assert set(lines[0]) == {"session_id", "turn", "input_tokens", "output_tokens", "arrival_s"}
    later = [obj for obj in lines if obj["turn"] > 0]
    assert later and all(set(obj) == set(lines[0]) | {"think_s"} for obj in later)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session_id": 0, "input_tokens": [1]}\n')
    with pytest.raises(ValueError, match="line 1: missing keys \\['output_tokens'\\]"):
        list(read_jsonl(str(bad)))
    named = tmp_path / "named.jsonl"
    named.write_text('{"session_id": "a", "input_tokens": [1], "output_tokens": [2]}\n')
    assert list(read_jsonl(str(named))) == [TraceRequest("a", 0, (1,), (2,))]
    bad.write_text('{"session_id": [0], "input_tokens": [1], "output_tokens": [3]}\n')
    with pytest.raises(ValueError, match="session_id must be"):
        list(read_jsonl(str(bad)))
    bad.write_text('{"session_id": 0, "input_tokens": [1, -2], "output_tokens": [3]}\n')
    with pytest.raises(ValueError, match="input_tokens must be a list"):
        list(read_jsonl(str(bad)))


def test_make_trace_script(tmp_path, capsys):
    out = str(tmp_path / "chat.jsonl")
    assert make_trace_script.main(["chat", "--seed", "4", "--set", "sessions=3", "--out", out]) == 0
    assert list(read_jsonl(out)) == make_trace(trace_shape("chat", sessions=3), seed=4)
    assert "3 sessions" in capsys.readouterr().out
    assert make_trace_script.main(["chat", "--set", "sessions=0", "--out", out]) == 2
    with pytest.raises(SystemExit):
        make_trace_script.main(["chat", "--set", "bogus=1", "--out", out])


def test_trace_times_are_planned_arrivals_and_gaps():
    shape = trace_shape("chat", sessions=30, session_rate=2.0, think_s=5.0)
    trace = make_trace(shape, seed=3)
    arrivals = [r.arrival_s for r in trace]
    assert all(a is not None for a in arrivals)
    assert arrivals == sorted(arrivals)  # the trace is in arrival order
    firsts = sorted(r.arrival_s for r in trace if r.turn == 0)
    gaps = [b - a for a, b in zip([0.0, *firsts], firsts, strict=False)]
    assert 0.25 < statistics.fmean(gaps) < 1.0  # mean 1 / session_rate = 0.5 s
    for turns in _by_session(trace).values():
        assert turns[0].think_s == 0.0
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.arrival_s == pytest.approx(prev.arrival_s + cur.think_s)
            assert cur.think_s > 0
    thinks = [r.think_s for r in trace if r.turn > 0]
    assert 2.5 < statistics.fmean(thinks) < 10.0  # mean think_s = 5
    # Times do not change the tokens: the same draws in the same order as before.
    slower = make_trace(trace_shape("chat", sessions=30, session_rate=0.5), seed=3)
    assert {(r.session_id, r.turn, r.input_tokens) for r in slower} == {
        (r.session_id, r.turn, r.input_tokens) for r in trace
    }


def test_trace_file_times_are_optional_and_checked(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"session_id": 0, "input_tokens": [1], "output_tokens": [2], "arrival_s": 1.5}\n'
        '{"session_id": 0, "turn": 1, "input_tokens": [1, 2, 3], "output_tokens": [4], '
        '"think_s": 2}\n'
    )
    got = list(read_jsonl(str(path)))
    assert got[0] == TraceRequest(0, 0, (1,), (2,), 1.5, 0.0)
    assert got[1].arrival_s is None and got[1].think_s == 2.0
    for bad, message in [
        ('"arrival_s": -1', "arrival_s must be a finite number of seconds >= 0, got -1"),
        ('"arrival_s": "soon"', "arrival_s must be a number of seconds, got 'soon'"),
        ('"think_s": NaN', "think_s must be a finite number of seconds >= 0, got nan"),
        ('"think_s": true', "think_s must be a number of seconds, got True"),
    ]:
        path.write_text(
            '{"session_id": 0, "input_tokens": [1], "output_tokens": [2], ' + bad + "}\n"
        )
        with pytest.raises(ValueError, match="line 1: " + message.replace("(", "\\(")):
            list(read_jsonl(str(path)))
    with pytest.raises(ValueError, match="TraceRequest.think_s"):
        TraceRequest(0, 0, (1,), (2,), think_s=-0.5)


def test_make_trace_script_arrival_options(tmp_path, capsys):
    out = str(tmp_path / "chat.jsonl")
    argv = ["chat", "--set", "sessions=4", "--session-rate", "3", "--think-s", "0.5"]
    assert make_trace_script.main([*argv, "--out", out]) == 0
    want = make_trace(trace_shape("chat", sessions=4, session_rate=3.0, think_s=0.5), seed=0)
    assert list(read_jsonl(out)) == want
    assert "last arrival" in capsys.readouterr().out
    assert make_trace_script.main([*argv, "--no-times", "--out", out]) == 0
    got = list(read_jsonl(out))
    assert all(r.arrival_s is None and r.think_s == 0.0 for r in got)
    assert [r.input_tokens for r in got] == [r.input_tokens for r in want]
    assert make_trace_script.main(["chat", "--session-rate", "0", "--out", out]) == 2


def test_turn_times_are_validated():
    assert Turn(0, 0, 0, (1,), arrival_s=2).arrival_s == 2
    assert not Turn(0, 0, 0, (1,)).timed and Turn(0, 0, 1, (1,), think_s=0.1).timed
    with pytest.raises(ValueError, match="Turn.arrival_s must be a finite .* got -0.1"):
        Turn(0, 0, 0, (1,), arrival_s=-0.1)
    with pytest.raises(ValueError, match="Turn.think_s must be a finite .* got inf"):
        Turn(0, 0, 1, (1,), think_s=float("inf"))
    with pytest.raises(TypeError, match="Turn.think_s must be a number of seconds, got '1'"):
        Turn(0, 0, 1, (1,), think_s="1")  # type: ignore[arg-type]


def test_with_arrivals_is_seeded_poisson_with_think_times():
    trace = make_workload("multiturn", sessions=200, turns=2, vocab=100, first_prompt_len=40)
    timed = with_arrivals(trace, 4.0, seed=5, think_s=0.25)
    assert timed == with_arrivals(trace, 4.0, seed=5, think_s=0.25)  # same on every rank
    assert timed != with_arrivals(trace, 4.0, seed=6, think_s=0.25)
    assert [t.user_tokens for t in timed] == [t.user_tokens for t in trace]
    firsts = [t for t in timed if t.turn == 0]
    assert firsts[0].arrival_s == 0.0
    starts = [t.arrival_s for t in firsts]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    mean_gap = starts[-1] / (len(starts) - 1)
    assert 0.18 < mean_gap < 0.33  # 1 / rate = 0.25 s
    later = [t for t in timed if t.turn > 0]
    assert all(t.arrival_s is None and t.think_s > 0 for t in later)
    assert 0.18 < statistics.fmean(t.think_s for t in later) < 0.33
    at_once = with_arrivals(timed, None)
    assert all(t.arrival_s == 0.0 for t in at_once if t.turn == 0)
    assert all(t.think_s == 0.0 and t.arrival_s is None for t in at_once if t.turn > 0)
    with pytest.raises(ValueError, match="rate must be > 0 requests per second, got 0"):
        with_arrivals(trace, 0)
    with pytest.raises(ValueError, match="think_s must be a finite number .* got -1"):
        with_arrivals(trace, 1.0, think_s=-1)


def test_prompts_file_times(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"input_ids": [1, 2], "session": "a", "arrival_s": 0.5}\n'
        '{"input_ids": [3], "session": "a", "think_s": 1.25}\n'
        '{"input_ids": [4]}\n'
    )
    turns = load_prompts(path, 10)
    assert [(t.arrival_s, t.think_s) for t in turns] == [(0.5, 0.0), (None, 1.25), (None, 0.0)]
    for line, message in [
        ('{"input_ids": [1], "arrival_s": -2}', ":1: arrival_s must be a finite .* got -2"),
        ('{"input_ids": [1], "arrival_s": [1]}', ":1: arrival_s must be a number .* got \\[1\\]"),
        ('{"input_ids": [1], "think_s": 3}', ":1: think_s=3.0 on a session's first turn"),
    ]:
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            load_prompts(path, 10)
