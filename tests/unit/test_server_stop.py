"""``runtime.server.stop`` and ``runtime.server.params`` without a server: where an answer
ends, which text may be streamed, and which request fields are refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.server.params import ParamError, RequestParams, StopSpec, unsupported_names
from runtime.server.stop import AnswerText, answer_of


class CharCodec:
    """One token per character (ids are code points); 0xFFFD decodes as a split
    multi-byte character would."""

    has_text = True

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def _stream(stop: StopSpec, text: str) -> tuple[list[str], AnswerText]:
    answer = AnswerText(CharCodec(), stop)  # type: ignore[arg-type]
    deltas = [answer.push(ord(c)) for c in text]
    deltas.append(answer.finish())
    return deltas, answer


def test_a_stop_string_cuts_before_it_and_is_never_sent() -> None:
    deltas, answer = _stream(StopSpec(("ab",)), "xacabzz")
    assert deltas[:3] == ["x", "", "ac"]  # "a" held back: it could start "ab"
    assert "".join(deltas) == "xac" == answer.text
    assert answer.stopped and answer.finish_reason == "stop"
    assert answer.ids == [ord(c) for c in "xacab"]  # up to the token that completed it


def test_no_stop_releases_everything_and_is_length() -> None:
    deltas, answer = _stream(StopSpec(("ab",)), "xaa")
    assert "".join(deltas) == "xaa" and deltas[-1] == "a"  # the held "a" at the end
    assert answer.finish_reason == "length"


def test_stop_ids_end_the_answer_without_the_token() -> None:
    answer = answer_of(CharCodec(), StopSpec((), frozenset({ord("!")})), [104, 105, 33, 106])  # type: ignore[arg-type]
    assert answer.text == "hi" and answer.ids == [104, 105] and answer.stopped


def test_an_incomplete_character_is_held_back() -> None:
    answer = AnswerText(CharCodec(), StopSpec())  # type: ignore[arg-type]
    assert answer.push(ord("a")) == "a"
    assert answer.push(0xFFFD) == ""
    assert answer.finish() == "\ufffd"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=4),
)
def test_streamed_text_is_the_whole_text_cut_at_the_first_stop(text: str, stops: list[str]) -> None:
    deltas, answer = _stream(StopSpec(tuple(stops)), text)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    # OpenAI's rule: the answer ends where a stop string first completes.
    ends = [text.find(s) + len(s) for s in stops if s in text]
    expected = text
    if ends:
        end = min(ends)
        expected = text[: min(i for i in (text[:end].find(s) for s in stops) if i >= 0)]
    assert hits or not answer.stopped
    assert "".join(deltas) == expected == answer.text


def _parse(body: dict, chat: bool = False) -> RequestParams:
    return RequestParams.parse(body, chat, default_max=8, limit=100, vocab_size=50)


@pytest.mark.parametrize(
    "field,value",
    [
        ("suffix", "tail"),
        ("best_of", 3),
        ("guided_json", {"type": "object"}),
        ("structured_outputs", {"json": {}}),
        ("frobnicate", 1),
    ],
)
def test_completions_refuse_what_they_do_not_implement(field: str, value: object) -> None:
    with pytest.raises(ParamError, match=repr(field)) as err:
        _parse({"prompt": [1], field: value})
    assert err.value.param == field


@pytest.mark.parametrize(
    "field,value",
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tools", "x"),
        ("tool_choice", "auto"),
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {}}),
        ("echo", False),  # a completions field
    ],
)
def test_chat_refuses_what_it_does_not_implement(field: str, value: object) -> None:
    with pytest.raises(ParamError, match=repr(field)):
        _parse({"messages": [], field: value}, chat=True)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 5),
        ("temperature", -1),
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", 2),
        ("top_p", 0),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", 1.5),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0),
        ("logit_bias", {"50": 1}),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"3": "big"}),
        ("logit_bias", [1]),
        ("logprobs", 21),
        ("logprobs", -1),
        ("seed", "x"),
        ("n", 0),
        ("n", 65),
        ("min_tokens", -1),
        ("min_tokens", 9),  # above max_tokens (8)
        ("include_stop_str_in_output", "yes"),
        ("echo", 1),
        ("stream_options", {"include_usage": True}),  # without stream
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ParamError, match=field) as err:
        _parse({"prompt": [1], field: value})
    assert err.value.param == field


def test_top_logprobs_needs_logprobs() -> None:
    with pytest.raises(ParamError, match="'logprobs' must be set to true") as err:
        _parse({"messages": [], "top_logprobs": 3}, chat=True)
    assert err.value.param == "top_logprobs"
    with pytest.raises(ParamError, match="top_logprobs"):
        _parse({"messages": [], "logprobs": True, "top_logprobs": 21}, chat=True)
    assert _parse({"messages": [], "logprobs": True, "top_logprobs": 3}, True).logprobs == 3
    assert _parse({"messages": [], "logprobs": True}, True).logprobs == 0
    assert _parse({"messages": [], "logprobs": False, "top_logprobs": 0}, True).logprobs is None


def test_sampling_fields_are_parsed_to_sampling_params() -> None:
    body = {"prompt": [1], "temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.1}
    body |= {"seed": 7, "presence_penalty": 1, "frequency_penalty": -1, "n": 3}
    body |= {"repetition_penalty": 1.3, "logit_bias": {"4": 200, 2: -5}, "logprobs": 2}
    body |= {"min_tokens": 2, "stop_token_ids": [5], "include_stop_str_in_output": True}
    params = _parse(body)
    assert params.n == 3 and params.seed == 7
    stop = params.stop_spec((9,))
    assert stop.min_tokens == 2 and stop.include_stop and stop.eos_ids == frozenset({9})
    sampling = params.sampling(stop, 8)
    assert sampling.temperature == 0.5 and sampling.top_p == 0.9 and sampling.top_k == 0
    assert sampling.min_p == 0.1 and sampling.seed == 8 and sampling.logprobs == 2
    assert sampling.presence_penalty == 1 and sampling.frequency_penalty == -1
    assert sampling.repetition_penalty == 1.3
    assert sampling.logit_bias == ((2, -5.0), (4, 100.0))  # clamped as vLLM does
    assert sampling.min_tokens == 2 and sampling.stop_ids == frozenset({5, 9})
    assert not sampling.plain


def test_neutral_values_are_accepted() -> None:
    body = {"prompt": [1], "n": 1, "temperature": 0, "top_p": 1, "logprobs": None, "echo": False}
    body |= {"seed": 3, "user": "u", "suffix": None, "presence_penalty": 0.0, "best_of": 1}
    params = _parse(body)
    assert params.max_tokens == 8
    assert params.sampling(params.stop_spec(()), None).plain
    chat = {"messages": [], "tools": [], "response_format": {"type": "text"}, "logprobs": False}
    assert _parse(chat, chat=True).max_tokens == 8


def test_stop_fields() -> None:
    params = _parse({"prompt": [1], "stop": ["a", "a", "bc"], "stop_token_ids": [3, 4]})
    assert params.stop_strings == ("a", "bc") and params.stop_token_ids == (3, 4)
    eos = frozenset({7, 9})
    assert params.stop_spec((7, 9)) == StopSpec(("a", "bc"), frozenset({3, 4, 7, 9}), eos)
    no_eos = _parse({"prompt": [1], "stop_token_ids": [3], "ignore_eos": True})
    assert no_eos.stop_spec((7,)) == StopSpec((), frozenset({3}))
    with pytest.raises(ParamError, match="'ignore_eos' must be a boolean"):
        _parse({"prompt": [1], "ignore_eos": 1})
    assert _parse({"prompt": [1], "return_token_ids": True}).max_tokens == 8
    with pytest.raises(ParamError, match="'return_token_ids' must be a boolean"):
        _parse({"prompt": [1], "return_token_ids": "yes"})
    assert _parse({"prompt": [1], "stop": "x"}).stop_strings == ("x",)
    for bad in ([1, 2], ["a"] * 5 + ["b", "c", "d", "e"], [""], 5):
        with pytest.raises(ParamError, match="'stop'"):
            _parse({"prompt": [1], "stop": bad})
    for bad_ids in ([True], [50], "3"):
        with pytest.raises(ParamError, match="stop_token_ids"):
            _parse({"prompt": [1], "stop_token_ids": bad_ids})


def test_max_tokens_and_stream_types() -> None:
    assert _parse({"prompt": [1], "max_tokens": 5}).max_tokens == 5
    assert (
        _parse({"messages": [], "max_tokens": 5, "max_completion_tokens": 6}, True).max_tokens == 6
    )
    for body in ({"max_tokens": True}, {"max_tokens": 101}, {"stream": "yes"}):
        with pytest.raises(ParamError):
            _parse({"prompt": [1], **body})
    with pytest.raises(ParamError, match="stream_options"):
        _parse({"prompt": [1], "stream_options": {"include_usage": "no"}})


def test_the_documented_refusals_are_the_table() -> None:
    names = unsupported_names()
    for name in ("tools", "response_format", "suffix", "guided_json", "best_of"):
        assert name in names
    for name in ("stop", "max_tokens", "temperature", "logprobs", "n", "echo", "seed"):
        assert name not in names


def test_stop_reason_is_the_string_or_the_stop_id_and_null_at_the_end_of_sequence() -> None:
    by_string = answer_of(CharCodec(), StopSpec(("cd",)), [ord(c) for c in "abcde"])  # type: ignore[arg-type]
    assert by_string.text == "ab" and by_string.stop_reason == "cd"
    ids = frozenset({33, 35})
    by_id = answer_of(CharCodec(), StopSpec((), ids, frozenset({35})), [104, 33])  # type: ignore[arg-type]
    assert by_id.stop_reason == 33 and by_id.generated == 2
    by_eos = answer_of(CharCodec(), StopSpec((), ids, frozenset({35})), [104, 35])  # type: ignore[arg-type]
    assert by_eos.stopped and by_eos.stop_reason is None
    length = answer_of(CharCodec(), StopSpec(("zz",)), [104])  # type: ignore[arg-type]
    assert length.finish_reason == "length" and length.stop_reason is None


def test_include_stop_keeps_the_string_or_the_stop_token() -> None:
    spec = StopSpec(("cd",), include_stop=True)
    deltas, answer = _stream(spec, "abcdef")
    assert "".join(deltas) == "abcd" == answer.text and answer.stop_reason == "cd"
    ids = frozenset({33, 35})
    kept = answer_of(CharCodec(), StopSpec((), ids, frozenset({35}), include_stop=True), [104, 33])  # type: ignore[arg-type]
    assert kept.text == "h!" and kept.ids == [104, 33]
    eos = answer_of(CharCodec(), StopSpec((), ids, frozenset({35}), include_stop=True), [104, 35])  # type: ignore[arg-type]
    assert eos.text == "h" and eos.ids == [104]  # the end of sequence never is


def test_min_tokens_ignores_stops_until_reached() -> None:
    ids = frozenset({33})
    answer = answer_of(CharCodec(), StopSpec(("b",), ids, min_tokens=3), [33, ord("b"), 97, 33])  # type: ignore[arg-type]
    # "!" and "b" come before the 3rd token: kept; the 4th token "!" stops.
    assert answer.text == "!ba" and answer.stop_reason == 33 and answer.generated == 4
    later = answer_of(CharCodec(), StopSpec(("b",), ids, min_tokens=2), [97, 97, ord("b")])  # type: ignore[arg-type]
    assert later.text == "aa" and later.stop_reason == "b"
