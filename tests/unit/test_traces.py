"""runtime.traces: seeded, shaped as documented, JSONL round trip; scripts/make_trace.py."""

from __future__ import annotations

import json
import os
import statistics
import sys

import pytest

from runtime.traces import TraceRequest, make_trace, read_jsonl, trace_shape, write_jsonl

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
    first = json.loads(open(path).readline())
    assert set(first) == {"session_id", "turn", "input_tokens", "output_tokens"}
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
