"""``runtime.server`` refuses what it does not do and what would hurt it: ``stop`` with
OpenAI's semantics (streamed too), unimplemented fields, the API key, ``Host``/``Origin``
on a loopback bind, non-JSON posts, oversized and malformed bodies, over-long prompts.

One in-process server on the tiny text checkpoint of ``test_server`` (module scope).
"""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="needs the openai client (test extra)")
pytest.importorskip("aiohttp", reason="needs aiohttp (server extra)")
pytest.importorskip("tokenizers", reason="needs tokenizers (test extra)")

from runtime.engine import Engine  # noqa: E402
from runtime.serve import main as serve  # noqa: E402
from tests.unit.test_server import LiveServer, build_text_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(240)
KEY = "sk-test-0123456789"
PROMPT = "hello world the cache is warm"


class KeyedServer(LiveServer):
    def get(self, path: str) -> tuple[int, str]:
        request = urllib.request.Request(
            self.url + path, headers={"Authorization": f"Bearer {KEY}"}
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read().decode()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_text_checkpoint(tmp_path_factory.mktemp("limits_ckpt"))


@pytest.fixture(scope="module")
def live(checkpoint, one_rank_topology):
    argv = ["--model", str(checkpoint), "--page-size", "4", "--device-pages", "64"]
    argv += ["--cache", "host", "--max-new-tokens", "8", "--api-key", KEY]
    argv += ["--max-body-bytes", "4096", "--max-prompt-tokens", "64"]
    server = KeyedServer(argv, one_rank_topology)
    yield server
    server.close()


@pytest.fixture(scope="module")
def free_text(live, one_rank_topology):
    """The uncached greedy answer (ids, text) of ``prompt`` for ``n`` tokens."""
    engine = Engine(serve.build_model(live.args, one_rank_topology), None)
    codec = live.server.codec

    def run(prompt: str, n: int) -> tuple[list[int], str]:
        ids = engine.serve(codec.encode_prompt(prompt), max_new_tokens=n).output_ids
        cut = [i for i, t in enumerate(ids) if t in codec.eos_token_ids]
        ids = ids[: cut[0]] if cut else ids
        return ids, codec.decode(ids)

    return run


def _client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


def _post(live, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw else {}
    finally:
        conn.close()


def _json_headers(**extra: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **extra}


def _stop_inside(text: str) -> str:
    """A two-character stop string that first occurs in ``text`` after its first character
    and ends before its last (the byte-level model's text: no replacement character in
    it, it may span two tokens)."""
    for i in range(1, len(text) - 2):
        stop = text[i : i + 2]
        if "\ufffd" not in stop and text.index(stop) == i:
            return stop
    pytest.skip(f"no usable stop string in the tiny model's answer {text!r}")


def test_stop_string_cuts_the_answer_whole_and_streamed(live, free_text) -> None:
    ids, text = free_text(PROMPT, 8)
    stop = _stop_inside(text)
    expected = text[: text.index(stop)]
    client = _client(live)
    out = client.completions.create(model=live.server.name, prompt=PROMPT, stop=stop)
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 8  # the engine stopped generating there
    parts, finish = [], None
    for chunk in client.completions.create(
        model=live.server.name, prompt=PROMPT, stop=[stop, "never"], stream=True
    ):
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == expected and finish == "stop"
    chat = client.chat.completions.create(
        model=live.server.name, messages=[{"role": "user", "content": PROMPT}], stop="zzz"
    )
    assert chat.choices[0].finish_reason == "length"  # "zzz" is not a word it has


def test_stop_token_ids_end_at_the_token(live, free_text) -> None:
    ids, _ = free_text(PROMPT, 8)
    at = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), None)
    if at is None:
        pytest.skip(f"the tiny model repeats one token: {ids}")
    out = _client(live).completions.create(
        model=live.server.name, prompt=PROMPT, extra_body={"stop_token_ids": [ids[at]]}
    )
    assert out.choices[0].token_ids == ids[:at]
    assert out.choices[0].finish_reason == "stop"


def test_unimplemented_fields_are_400_naming_them(live) -> None:
    client = _client(live)
    name = live.server.name
    asks = [
        ("logprobs", lambda: client.completions.create(model=name, prompt="hi", logprobs=21)),
        ("suffix", lambda: client.completions.create(model=name, prompt="hi", suffix="x")),
        ("echo", lambda: client.completions.create(model=name, prompt="hi", echo=1)),
        ("temperature", lambda: client.completions.create(model=name, prompt="hi", temperature=3)),
        (
            "tools",
            lambda: client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": "hi"}],
                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            ),
        ),
        (
            "response_format",
            lambda: client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": "hi"}],
                response_format={"type": "json_object"},
            ),
        ),
    ]
    for field, ask in asks:
        with pytest.raises(openai.BadRequestError) as err:
            ask()
        assert err.value.body["param"] == field and field in err.value.body["message"]


def test_the_api_key_is_required_but_health_is_open(live) -> None:
    wrong = openai.OpenAI(base_url=live.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=live.server.name, prompt="hi")
    assert [m.id for m in _client(live).models.list().data] == [live.server.name]
    with urllib.request.urlopen(live.url + "/health", timeout=10) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(live.url + "/metrics", timeout=10)
    status, body = _post(live, "/v1/completions", b"{}", {"Content-Type": "application/json"})
    assert status == 401 and body["error"]["type"] == "authentication_error"


def test_foreign_host_origin_and_form_posts_are_refused(live) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    status, err = _post(live, "/v1/completions", body, _json_headers(Host="evil.example:80"))
    assert status == 403 and "Host" in err["error"]["message"]
    status, _ = _post(live, "/v1/completions", body, _json_headers(Origin="http://evil.example"))
    assert status == 403
    form = dict(_json_headers(), **{"Content-Type": "text/plain"})
    assert _post(live, "/v1/completions", body, form)[0] == 415
    ok = _json_headers(Host=f"localhost:{live.port}", Origin=f"http://127.0.0.1:{live.port}")
    assert _post(live, "/v1/completions", body, ok)[0] == 200


def test_oversized_and_malformed_bodies_are_4xx_without_a_traceback(live, caplog) -> None:
    big = json.dumps({"prompt": "hello " * 2000}).encode()
    deep = b"[" * 50_000 + b"]" * 50_000
    cases = [
        (big, _json_headers(), 413),
        (deep[:4000], _json_headers(), 400),  # not closed: not JSON
        (b'{"prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}", _json_headers(), 400),
        (
            b'{"prompt": "hi"}',
            _json_headers(**{"Content-Type": "application/json; charset=bogus"}),
            400,
        ),
        (b"\x1f\x8b not gzip at all", _json_headers(**{"Content-Encoding": "gzip"}), 400),
        (b'{"prompt": "\xff\xfe"}', _json_headers(), 400),
        (b'{"prompt": NaN}', _json_headers(), 400),
        (b'["a list"]', _json_headers(), 400),
        (b'{"prompt": "hi", "max_tokens": "7"}', _json_headers(), 400),
        (b'{"prompt": "hi", "model": 5}', _json_headers(), 400),
        (b'{"prompt": {"x": 1}}', _json_headers(), 400),
    ]
    with caplog.at_level(logging.DEBUG):
        for body, headers, status in cases:
            got, answer = _post(live, "/v1/completions", body, headers)
            assert got == status, (body[:40], headers, answer)
            assert set(answer["error"]) >= {"message", "type", "param", "code"}
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    # A chunked body (no Content-Length) is cut off once it passes the limit.
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    try:
        chunks = (
            b'{"prompt": "' if i == 0 else b"hello " * 100 for i in range(100)
        )  # fits the socket buffers
        conn.request("POST", "/v1/completions", body=chunks, headers=_json_headers())
        assert conn.getresponse().status == 413
    finally:
        conn.close()
    # gzip that is well formed is read.
    packed = gzip.compress(json.dumps({"prompt": "hi", "max_tokens": 1}).encode())
    assert (
        _post(live, "/v1/completions", packed, _json_headers(**{"Content-Encoding": "gzip"}))[0]
        == 200
    )


def test_a_prompt_over_the_limit_is_400_before_any_work(live) -> None:
    live.wait_idle()
    before = live.metric("mesh_hicache_server_prompt_tokens_total")
    client = _client(live)
    with pytest.raises(openai.BadRequestError, match="max-prompt-tokens") as err:
        client.completions.create(model=live.server.name, prompt=" ".join(["hello"] * 41))
    assert err.value.body["param"] == "prompt"
    assert live.metric("mesh_hicache_server_prompt_tokens_total") == before
    assert client.completions.create(model=live.server.name, prompt="hello", max_tokens=1)
