"""``runtime.server``'s vLLM parameters over HTTP, per parameter: sampling with seeds
(reproducible whatever the batch), penalties, logit bias, stopping (``min_tokens``,
``stop_reason``, ``include_stop_str_in_output``), log-probabilities, ``echo``, ``n``,
prompt batches, ``--max-model-len``, and the 400s of vLLM's ranges.

One in-process server (``--concurrency 8``: one running batch) on the tiny text
checkpoint of ``test_server`` for the module; the reference is an engine without a
cache on the same weights, with the same ``runtime.sampling`` sampler. The parameters
the docs' table lists as implemented are each exercised here
(``test_the_docs_table_lists_every_parameter_and_this_module_exercises_it``).
"""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="needs the openai client (test extra)")
pytest.importorskip("aiohttp", reason="needs aiohttp (server extra)")
pytest.importorskip("tokenizers", reason="needs tokenizers (test extra)")

from runtime.engine import Engine  # noqa: E402
from runtime.sampling import Sampler, SamplingParams  # noqa: E402
from runtime.serve import main as serve  # noqa: E402
from runtime.server.params import PARAMETERS, unsupported_names  # noqa: E402
from tests.unit.test_server import LiveServer, build_text_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
PROMPT = "the cache is warm and the answer"
CONTEXT = 48
"""``--max-model-len`` of the module's server."""


@pytest.fixture(scope="module")
def live(tmp_path_factory, one_rank_topology):
    checkpoint = build_text_checkpoint(tmp_path_factory.mktemp("sampling_ckpt"))
    argv = ["--model", str(checkpoint), "--page-size", "4", "--device-pages", "256"]
    argv += ["--cache", "host", "--max-new-tokens", "16", "--max-model-len", str(CONTEXT)]
    server = LiveServer(argv, one_rank_topology)
    yield server
    server.close()


@pytest.fixture(scope="module")
def engine(live, one_rank_topology) -> Engine:
    return Engine(serve.build_model(live.args, one_rank_topology), None, keep_logits=True)


def _client(live):
    return live.client()


def _complete(live, prompt=PROMPT, **kwargs):
    kwargs.setdefault("max_tokens", 10)
    return _client(live).completions.create(model=live.server.name, prompt=prompt, **kwargs)


def _ids(live, text: str = PROMPT) -> list[int]:
    return live.server.codec.encode_prompt(text)


def _reference(
    engine: Engine, ids: list[int], n: int, eos: tuple[int, ...] = (), **sampling
) -> list[int]:
    """The engine's tokens with ``runtime.sampling`` (no server, no batch, no cache), cut
    before the first of ``eos``."""
    sampler = Sampler(SamplingParams(**sampling), ids) if sampling else None
    out = engine.serve(ids, max_new_tokens=n, sampler=sampler).output_ids
    cut = [i for i, t in enumerate(out) if t in eos]
    return out[: cut[0]] if cut else out


# -- sampling ---------------------------------------------------------------------------------


def test_greedy_is_unchanged_and_temperature_zero_is_greedy(live, engine) -> None:
    greedy = _reference(engine, _ids(live), 10, _eos(live))
    for extra in ({}, {"temperature": 0}, {"temperature": 0, "seed": 5, "top_p": 0.5}):
        assert _complete(live, **extra).choices[0].token_ids == greedy
    # top_k 1, a tiny top_p and min_p 1 keep only the most likely token: greedy at any
    # temperature.
    for extra in ({"top_p": 1e-6}, {"extra_body": {"top_k": 1}}, {"extra_body": {"min_p": 1}}):
        assert _complete(live, temperature=1.5, seed=3, **extra).choices[0].token_ids == greedy


def test_seeded_sampling_is_reproducible_and_seeds_differ(live, engine) -> None:
    ask = lambda seed: _complete(live, temperature=1.0, seed=seed).choices[0]  # noqa: E731
    seven, again, eight = ask(7), ask(7), ask(8)
    assert seven.token_ids == again.token_ids and seven.text == again.text
    assert seven.token_ids != eight.token_ids
    assert seven.token_ids != _reference(engine, _ids(live), 10)  # not greedy
    # The same tokens as the engine's sampler with that seed, outside any batch.
    want = _reference(engine, _ids(live), 10, _eos(live), temperature=1.0, seed=7)
    assert seven.token_ids == want
    unseeded = {tuple(_complete(live, temperature=1.0).choices[0].token_ids) for _ in range(3)}
    assert len(unseeded) > 1  # a fresh seed per request


def test_a_seeded_answer_does_not_depend_on_the_batch(live) -> None:
    """Alone, then among concurrent requests (sampled and greedy, other prompts and
    lengths, one streamed), the same seeded request gets the same answer."""
    kwargs = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)
    alone = _complete(live, **kwargs).choices[0].token_ids
    others = [
        dict(prompt="other prompt one", temperature=1.0, seed=1, max_tokens=9),
        dict(prompt="x" * 30, max_tokens=14),
        dict(prompt=PROMPT, temperature=1.3, max_tokens=5),
        dict(prompt="short", temperature=0.7, seed=99, max_tokens=16, stream=True),
        dict(prompt=PROMPT[::-1], frequency_penalty=1.0, max_tokens=11),
    ]

    def run(item: dict) -> object:
        item = dict(item)
        if item.pop("stream", False):
            return list(_complete(live, stream=True, **item))
        return _complete(live, **item)

    with ThreadPoolExecutor(len(others) + 2) as pool:
        futures = [pool.submit(run, o) for o in others]
        mine = pool.submit(lambda: _complete(live, **kwargs).choices[0].token_ids)
        futures.append(pool.submit(lambda: _complete(live, n=3, **kwargs)))
        assert mine.result() == alone
        batched_n = futures[-1].result()
        for f in futures:
            f.result()
    # n > 1: choice j is seeded with seed + j (vLLM's), so choice 0 is the seed's answer.
    assert [c.index for c in batched_n.choices] == [0, 1, 2]
    assert batched_n.choices[0].token_ids == alone
    one = _complete(live, **{**kwargs, "seed": 1235}).choices[0].token_ids
    assert batched_n.choices[1].token_ids == one


def test_penalties_and_logit_bias_change_the_answer_as_specified(live, engine) -> None:
    ids = _ids(live)
    greedy = _reference(engine, ids, 10, _eos(live))
    # logit_bias +100 on one token: greedy picks it every time; -100 on the greedy first
    # token: it never comes first.
    target = live.server.codec.encode_prompt("q")[0]
    assert target not in ids
    biased = _complete(live, logit_bias={str(target): 100}).choices[0]
    assert biased.token_ids == [target] * 10 and biased.text == "q" * 10
    banned = _complete(live, logit_bias={str(greedy[0]): -100}).choices[0].token_ids
    assert banned[0] != greedy[0]
    bias = ((greedy[0], -100.0),)
    assert banned == _reference(engine, ids, 10, _eos(live), logit_bias=bias)
    # A +3 bias makes "q" the greedy answer throughout (the tiny model's logits spread
    # less); each penalty then takes "q" back after it was generated.
    lift = {str(target): 3}
    assert _complete(live, logit_bias=lift).choices[0].token_ids == [target] * 10
    cases = [
        {"frequency_penalty": 1.0},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 100.0},
        {"presence_penalty": 1.5, "frequency_penalty": 0.5},
    ]
    for case in cases:
        body = dict(case)
        extra = {}
        if "repetition_penalty" in body:
            extra["repetition_penalty"] = body.pop("repetition_penalty")
        got = _complete(live, logit_bias=lift, extra_body=extra, **body).choices[0].token_ids
        want = _reference(engine, ids, 10, _eos(live), logit_bias=((target, 3.0),), **case)
        assert got == want, case
        assert got[0] == target and got.count(target) < 10, (case, got)
    # A negative presence penalty rewards repeats: still "q" throughout.
    rewarded = _complete(live, logit_bias=lift, presence_penalty=-2.0).choices[0]
    assert rewarded.token_ids == [target] * 10


def test_one_request_at_a_time_samples_the_same(live, tmp_path_factory, one_rank_topology):
    """``--concurrency 1`` (``Engine.serve``, no batch): the same seeded answers, choices
    and log-probabilities as the batched server."""
    argv = ["--model", str(live.args.model), "--page-size", "4", "--device-pages", "64"]
    argv += ["--cache", "host", "--concurrency", "1"]
    single = LiveServer(argv, one_rank_topology)
    try:
        kwargs = dict(temperature=1.0, seed=21, n=2, logprobs=2, presence_penalty=0.5)
        one = _complete(single, **kwargs)
        many = _complete(live, **kwargs)
    finally:
        single.close()
    assert [c.token_ids for c in one.choices] == [c.token_ids for c in many.choices]
    for a, b in zip(one.choices, many.choices, strict=True):
        assert a.logprobs.token_logprobs == pytest.approx(b.logprobs.token_logprobs, abs=1e-4)


# -- stopping ---------------------------------------------------------------------------------


def test_stop_reason_min_tokens_and_usage_count_the_stop_token(live, engine) -> None:
    greedy = _reference(engine, _ids(live), 10, _eos(live))
    first = greedy[0]
    out = _complete(live, extra_body={"stop_token_ids": [first]})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == first
    assert choice.token_ids == [] and choice.text == ""
    assert out.usage.completion_tokens == 1  # the stop token counts (vLLM's usage)
    # min_tokens: the stop ids are masked until 3 tokens are out.
    held = _complete(live, extra_body={"stop_token_ids": [first], "min_tokens": 3}).choices[0]
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]
    stops = frozenset({first, *_eos(live)})
    want = _reference(engine, _ids(live), 10, _eos(live), min_tokens=3, stop_ids=stops)
    assert held.token_ids == want[: len(held.token_ids)]
    # include_stop_str_in_output keeps the stop token's text.
    kept = _complete(
        live, extra_body={"stop_token_ids": [first], "include_stop_str_in_output": True}
    ).choices[0]
    assert kept.token_ids == [first] and kept.stop_reason == first
    assert kept.text == live.server.codec.decode([first])
    # Not stopped: finish_reason length, stop_reason null.
    plain = _complete(live, max_tokens=4).choices[0]
    assert plain.finish_reason == "length" and plain.stop_reason is None


def _eos(live) -> tuple[int, ...]:
    return tuple(live.server.codec.eos_token_ids)


def test_a_stop_string_is_the_stop_reason_and_may_be_kept(live, engine) -> None:
    text = live.server.codec.decode(_reference(engine, _ids(live), 10, _eos(live)))
    stop = next(
        text[i : i + 2]
        for i in range(1, len(text) - 2)
        if "\ufffd" not in text[i : i + 2] and text.index(text[i : i + 2]) == i
    )
    cut = text.index(stop)
    for stream in (False, True):
        for keep in (False, True):
            extra = {"include_stop_str_in_output": keep}
            if stream:
                chunks = list(_complete(live, stop=stop, stream=True, extra_body=extra))
                got = "".join(c.choices[0].text for c in chunks if c.choices)
                last = [c.choices[0] for c in chunks if c.choices][-1]
            else:
                last = _complete(live, stop=stop, extra_body=extra).choices[0]
                got = last.text
            assert got == text[: cut + (len(stop) if keep else 0)], (stream, keep)
            assert last.finish_reason == "stop" and last.stop_reason == stop


def test_ignore_eos_generates_max_tokens(live) -> None:
    eos = _eos(live)
    assert eos, "the checkpoint states an end-of-sequence id"
    # Bias the end-of-sequence token up: the answer ends there unless ignore_eos.
    bias = {str(eos[0]): 100}
    ended = _complete(live, logit_bias=bias)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    assert ended.choices[0].stop_reason is None  # the end of sequence: no stop_reason
    going = _complete(live, logit_bias=bias, extra_body={"ignore_eos": True}).choices[0]
    assert going.finish_reason == "length" and len(going.token_ids) == 10


# -- log-probabilities, echo --------------------------------------------------------------------


def test_completion_logprobs_are_the_models(live, engine) -> None:
    ids = _ids(live)
    first_logits = engine.serve(ids, max_new_tokens=1).last_logits
    assert first_logits is not None
    norm = math.log(sum(math.exp(x) for x in first_logits))
    out = _complete(live, logprobs=3, max_tokens=6).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.tokens == [live.server.codec.token_text(t) for t in out.token_ids]
    # Greedy: the chosen token is the most likely one; the first position's values are
    # log_softmax of the prompt's logits (float32, batched vs alone: 1e-4).
    assert lp.token_logprobs[0] == pytest.approx(first_logits[out.token_ids[0]] - norm, abs=1e-4)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        # At most 3 + the chosen one; byte tokens that decode alike share a key.
        assert 1 <= len(top) <= 4 and chosen == pytest.approx(max(top.values()))
        assert all(v <= 0 for v in top.values())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    streamed = [
        c.choices[0].logprobs
        for c in _complete(live, logprobs=3, max_tokens=6, stream=True)
        if c.choices and c.choices[0].logprobs
    ]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert _complete(live, max_tokens=2).choices[0].logprobs is None


def test_chat_logprobs_and_top_logprobs(live) -> None:
    client = _client(live)
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(
        model=live.server.name, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2
    ).choices[0]
    content = out.logprobs.content
    assert len(content) == len(out.token_ids) == 5  # type: ignore[attr-defined]
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(
            entry.top_logprobs[0].logprob
        )
        assert entry.bytes == list(entry.token.encode())
    none = client.chat.completions.create(model=live.server.name, messages=messages, max_tokens=2)
    assert none.choices[0].logprobs is None
    chunks = client.chat.completions.create(
        model=live.server.name, messages=messages, max_tokens=5, logprobs=True, stream=True
    )
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])
    assert all(e.top_logprobs == [] for e in streamed)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=live.server.name, messages=messages, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"


def test_echo_prepends_the_prompt(live) -> None:
    plain = _complete(live, max_tokens=4).choices[0].text
    assert _complete(live, max_tokens=4, echo=True).choices[0].text == PROMPT + plain
    chunks = list(_complete(live, max_tokens=4, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + plain
    with pytest.raises(openai.BadRequestError) as err:
        _complete(live, echo=True, logprobs=1)
    assert err.value.body["param"] == "echo" and "not supported" in err.value.body["message"]


# -- n and prompt batches -------------------------------------------------------------------


def test_n_and_prompt_batches_give_one_choice_each(live, engine) -> None:
    prompts = ["first prompt", "a second one"]
    out = _complete(live, prompt=prompts, n=2, max_tokens=5)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        want = _reference(engine, _ids(live, p), 5, _eos(live))
        assert [c.token_ids for c in out.choices[2 * i : 2 * i + 2]] == [want, want]
    # vLLM's usage: each prompt counted once, every choice's tokens.
    assert out.usage.prompt_tokens == sum(len(_ids(live, p)) for p in prompts)
    assert out.usage.completion_tokens == 20
    ids_batch = _complete(live, prompt=[_ids(live, p) for p in prompts], max_tokens=5)
    assert [c.token_ids for c in ids_batch.choices] == [c.token_ids for c in out.choices[::2]]
    chunks = list(
        _complete(
            live,
            prompt=prompts,
            n=2,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = ["", "", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in out.choices]
    assert chunks[-1].usage.completion_tokens == 20
    with pytest.raises(openai.BadRequestError) as err:
        _complete(live, prompt=prompts * 20, n=2)
    assert err.value.body["param"] == "n"


# -- the context limit ------------------------------------------------------------------------


def test_max_model_len_refuses_long_prompts_and_clips_max_tokens(live, engine) -> None:
    long_prompt = [5] * (CONTEXT + 2)
    with pytest.raises(openai.BadRequestError) as err:
        _complete(live, prompt=long_prompt, max_tokens=1)
    message = err.value.body["message"]
    assert err.value.body["param"] == "prompt" and str(CONTEXT) in message
    assert str(CONTEXT + 2) in message
    with pytest.raises(openai.BadRequestError) as err:
        _complete(live, prompt=[5] * CONTEXT, max_tokens=1)
    assert err.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as err:
        _complete(live, max_tokens=CONTEXT + 1)
    assert err.value.body["param"] == "max_tokens" and str(CONTEXT) in err.value.body["message"]
    near = [5] * (CONTEXT - 4)
    clipped = _complete(live, prompt=near, max_tokens=20, extra_body={"ignore_eos": True})
    assert clipped.usage.completion_tokens == 4 and clipped.choices[0].finish_reason == "length"
    assert clipped.choices[0].token_ids == _reference(engine, near, 4)


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 5),
        ("temperature", -1),
        ("temperature", "hot"),
        ("top_p", 2),
        ("top_k", -3),
        ("min_p", 2),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("logit_bias", {"99999999": 1}),
        ("logprobs", 30),
        ("seed", "x"),
        ("seed", 2**64),
        ("n", 0),
        ("min_tokens", 99),
        ("min_tokens", -1),
        ("stream_options", {"include_usage": True}),
        ("suffix", "tail"),
        ("guided_json", {"type": "object"}),
        ("structured_outputs", {"regex": "a+"}),
    ],
)
def test_completions_400_names_the_parameter(live, field: str, value: object) -> None:
    body = {"model": live.server.name, "prompt": "hi", field: value}
    status, answer = _post(live, "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == field, answer
    assert field in answer["error"]["message"]


@pytest.mark.parametrize(
    "field,value",
    [
        ("tools", "x"),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
        ("top_logprobs", 21),
    ],
)
def test_chat_400_names_the_parameter(live, field: str, value: object) -> None:
    body = {"model": live.server.name, "messages": [{"role": "user", "content": "hi"}]}
    body |= {field: value, "logprobs": True}
    status, answer = _post(live, "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == field, answer
    message = answer["error"]["message"]
    assert field in message
    if field in ("tools", "response_format") and value != "x":
        assert "not supported" in message


def _post(live, path: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        live.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# -- the docs' table ------------------------------------------------------------------------


def test_the_docs_table_lists_every_parameter_and_this_module_exercises_it() -> None:
    """docs/server.md's parameter table has one row per request field of PARAMETERS, its
    status agrees with the code (refused unless neutral vs implemented), and every
    implemented sampling/stopping/log-probability field is sent by a test here."""
    page = (ROOT / "docs" / "server.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| ([a-z ]+?) \|", page, re.M))
    assert set(rows) == set(PARAMETERS), set(rows) ^ set(PARAMETERS)
    refused = set(unsupported_names())
    for name, status in rows.items():
        assert (status == "refused") == (name in refused), (name, status)
    source = Path(__file__).read_text()
    handled_elsewhere = {"model", "prompt", "messages", "user", "stream", "max_tokens"}
    handled_elsewhere |= {"max_completion_tokens", "return_token_ids", "stop"}
    for name in set(PARAMETERS) - refused - handled_elsewhere:
        assert re.search(rf"\b{name}\b", source.split("# -- the docs' table")[0]), name
