"""runtime.server driven by the official ``openai`` client (in process, 127.0.0.1).

The server runs the tiny random Granite checkpoint of ``runtime.make_checkpoint`` (built
by transformers) with its byte-level ``tokenizer.json`` and chat template, so text goes
in and out. Outputs are
checked against an engine without a cache on the same weights, the chat prompt against
transformers' own ``apply_chat_template``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="needs the openai client (test extra)")
pytest.importorskip("aiohttp", reason="needs aiohttp (server extra)")
pytest.importorskip("prometheus_client", reason="needs prometheus-client (test extra)")
tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers (test extra)")
pytest.importorskip("transformers", reason="needs transformers (test extra)")

from runtime.engine import Engine  # noqa: E402
from runtime.make_checkpoint import make_checkpoint  # noqa: E402
from runtime.serve import main as serve  # noqa: E402
from runtime.server.main import Server, build_parser, run_http  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def build_text_checkpoint(root: Path) -> Path:
    """The offline checkpoint of ``runtime.make_checkpoint``: a tiny random Granite hybrid
    with a byte-level tokenizer and a chat template (built once per directory)."""
    directory = root / "granite-tiny"
    if not (directory / "config.json").exists():
        make_checkpoint("granite-tiny", directory)
    return directory


class LiveServer:
    """A ``Server`` on a free 127.0.0.1 port, HTTP in a background thread."""

    def __init__(self, argv: list[str], topology) -> None:
        self.args = build_parser().parse_args(argv + ["--port", "0"])
        serve.check_args(self.args)
        self.server = Server(self.args, topology)
        self.server.start_worker()
        self._ready = threading.Event()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "the server did not start"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._stop = asyncio.Event()

            def ready(port: int) -> None:
                self.port = port
                self._ready.set()

            await run_http(self.server, self._stop, ready)

        self._loop.run_until_complete(main())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self):  # -> openai.OpenAI
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=60, max_retries=0)

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.status, r.read().decode()

    def metric(self, name: str, labels: str = "") -> float:
        _, text = self.get("/metrics")
        pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else r"(\{[^}]*\})?")
        found = re.finditer(f"^(?:{pattern}) (?P<value>\\S+)$", text, re.M)
        values = [float(m.group("value")) for m in found]
        assert values, f"{name} not in /metrics"
        return sum(values)

    def wait_idle(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while self.metric("mesh_hicache_server_running") or self.metric(
            "mesh_hicache_server_queued"
        ):
            assert time.monotonic() < deadline, "the engine did not become idle"
            time.sleep(0.05)

    def close(self) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self.server.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_text_checkpoint(tmp_path_factory.mktemp("server_ckpt"))


@pytest.fixture(scope="module")
def live(checkpoint, one_rank_topology, tmp_path_factory):
    root = tmp_path_factory.mktemp("server_l3")
    argv = ["--model", str(checkpoint), "--page-size", "4", "--device-pages", "256"]
    argv += ["--storage-root", str(root), "--max-new-tokens", "6", "--max-tokens-limit", "600"]
    server = LiveServer(argv, one_rank_topology)
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference(live, one_rank_topology):
    """Greedy ids of a prompt from an engine with no cache on the same weights."""
    engine = Engine(serve.build_model(live.args, one_rank_topology), None)

    def run(ids: list[int], max_new: int) -> list[int]:
        out = engine.serve(ids, max_new_tokens=max_new).output_ids
        cut = [i for i, t in enumerate(out) if t in live.server.codec.eos_token_ids]
        return out[: cut[0]] if cut else out

    return run


def _encode(checkpoint: Path, text: str) -> list[int]:
    return tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(text).ids


def test_models_health_metrics(live) -> None:
    models = live.client().models.list()
    assert [m.id for m in models.data] == [live.server.name]
    status, body = live.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert live.metric("mesh_hicache_hit_rate", 'cp="0",pp="0",tp="0"') >= 0


def test_completion_text_matches_the_engine(live, checkpoint, reference) -> None:
    prompt = "hello world the cache is warm"
    out = live.client().completions.create(model=live.server.name, prompt=prompt, max_tokens=5)
    ids = reference(_encode(checkpoint, prompt), 5)
    choice = out.choices[0]
    assert choice.token_ids == ids
    assert choice.text == live.server.codec.decode(ids)
    assert out.usage.prompt_tokens == len(_encode(checkpoint, prompt))
    assert out.usage.completion_tokens == len(ids)
    assert choice.finish_reason == ("length" if len(ids) == 5 else "stop")


def test_chat_uses_the_checkpoint_template(live, checkpoint, reference) -> None:
    transformers = pytest.importorskip("transformers")
    messages = [
        {"role": "system", "content": "the cache is warm"},
        {"role": "user", "content": "hello world"},
    ]
    expected_prompt = transformers.PreTrainedTokenizerFast.from_pretrained(
        str(checkpoint)
    ).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(expected_prompt, dict) or hasattr(expected_prompt, "input_ids"):
        expected_prompt = expected_prompt["input_ids"]
    out = live.client().chat.completions.create(
        model=live.server.name, messages=messages, max_tokens=4
    )
    assert out.usage.prompt_tokens == len(expected_prompt)
    ids = reference(list(expected_prompt), 4)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == live.server.codec.decode(ids)


def test_streaming_equals_the_whole_answer(live) -> None:
    client = live.client()
    messages = [{"role": "user", "content": "the world is warm"}]
    whole = client.chat.completions.create(model=live.server.name, messages=messages)
    stream = client.chat.completions.create(
        model=live.server.name,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    texts = [
        c.choices[0].text
        for c in client.completions.create(
            model=live.server.name, prompt="hello hello world", max_tokens=6, stream=True
        )
    ]
    plain = client.completions.create(model=live.server.name, prompt="hello hello world")
    assert "".join(texts) == plain.choices[0].text


def test_concurrent_clients_each_get_their_own_answer(live, checkpoint, reference) -> None:
    prompts = [f"hello {w} world {w} the cache" for w in ("w20", "w30", "w40", "w50", "w60")]

    def ask(prompt: str) -> list[int]:
        out = live.client().completions.create(model=live.server.name, prompt=prompt, max_tokens=4)
        return out.choices[0].token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == [reference(_encode(checkpoint, p), 4) for p in prompts]


def test_http_stays_responsive_and_a_disconnect_releases(live) -> None:
    client = live.client()
    live.wait_idle()
    aborted = live.metric("mesh_hicache_server_aborted_total")
    generated = live.metric("mesh_hicache_server_completion_tokens_total")
    stream = client.completions.create(
        model=live.server.name, prompt="the cache is", max_tokens=600, stream=True
    )
    iterator = iter(stream)
    next(iterator)
    next(iterator)
    # The engine is busy with a 600-token request: health and metrics still answer. The
    # order proves it, not a clock: /metrics, read after /health, still counts the request
    # as running, so neither answer waited for it to finish.
    assert live.get("/health")[0] == 200
    assert live.metric("mesh_hicache_server_running") == 1
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 60
    while live.metric("mesh_hicache_server_aborted_total") == aborted:
        assert time.monotonic() < deadline, "the request was never aborted"
        time.sleep(0.05)
    live.wait_idle()
    assert live.metric("mesh_hicache_server_integrity_errors_total") == 0
    assert live.server.cache is not None
    live.server.cache.check_integrity()  # engine idle: nothing leaked
    # An aborted request's tokens are not counted as served, and it stopped early.
    assert live.metric("mesh_hicache_server_completion_tokens_total") == generated
    out = client.completions.create(model=live.server.name, prompt="hello", max_tokens=2)
    assert len(out.choices[0].token_ids) <= 2


def test_later_chat_turns_hit_the_cache(live, checkpoint, reference) -> None:
    client = live.client()
    live.wait_idle()
    hits_before = live.metric("mesh_hicache_hit_tokens_total")
    messages = [{"role": "system", "content": "w70 w71 w72 w73 w74 w75 w76 w77 w78 w79"}]
    cached = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"hello w{90 + turn} world is warm"})
        out = client.chat.completions.create(model=live.server.name, messages=messages)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": out.choices[0].message.content})
        # Served from the cache, the answer is the one recompute gives.
        prompt = live.server.codec.encode_chat(messages[:-1])
        assert out.choices[0].message.content == live.server.codec.decode(reference(prompt, 6))
    assert cached[0] == 0
    assert all(c > 0 for c in cached[1:]), cached
    assert cached[2] > cached[1]  # the longer the shared history, the more is reused
    live.wait_idle()
    assert live.metric("mesh_hicache_hit_tokens_total") - hits_before == sum(cached)


def test_bad_requests_are_openai_errors(live) -> None:
    client = live.client()
    name = live.server.name
    with pytest.raises(openai.BadRequestError, match="'n' must be in"):
        client.completions.create(model=name, prompt="hello", n=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=name, prompt="hello", max_tokens=601)
    with pytest.raises(openai.BadRequestError, match="'ignore_eos' must be a boolean"):
        client.completions.create(model=name, prompt="hello", extra_body={"ignore_eos": 1})
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-nothing", prompt="hello")
    with pytest.raises(openai.BadRequestError, match="not in range"):
        client.completions.create(model=name, prompt=[1, 2, 100000])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=name, messages=[])


def test_a_request_l1_cannot_hold_is_served_uncached_with_one_warning(
    checkpoint, one_rank_topology, reference, caplog
) -> None:
    argv = ["--model", str(checkpoint), "--page-size", "4", "--device-pages", "4"]
    argv += ["--cache", "host", "--max-new-tokens", "3"]
    small = LiveServer(argv, one_rank_topology)
    try:
        prompt = " ".join(["hello world the cache"] * 5)  # 109 tokens + 3 > 4 pages of 4
        with caplog.at_level(logging.WARNING, logger="runtime.server"):
            for _ in range(2):
                out = small.client().completions.create(model=small.server.name, prompt=prompt)
                assert out.choices[0].token_ids == reference(_encode(checkpoint, prompt), 3)
                assert out.usage.prompt_tokens_details.cached_tokens == 0
        warned = [r.getMessage() for r in caplog.records if "does not fit L1" in r.getMessage()]
        pages = -(-(len(_encode(checkpoint, prompt)) + 3) // 4)
        assert len(warned) == 1 and f"at least {pages}" in warned[0], warned
        assert small.metric("mesh_hicache_server_uncached_total") == 2
    finally:
        small.close()


def test_generation_stops_at_the_end_of_sequence_token(
    checkpoint, one_rank_topology, reference, tmp_path
) -> None:
    """A checkpoint whose end-of-sequence id is a token greedy decoding reaches early:
    the answer stops there and the engine spent no decode step after it. The ids come
    from ``generation_config.json`` (a list) before ``config.json`` (whose id, the
    first answer token, would stop at once), as transformers takes them; a request with
    ``ignore_eos`` runs to ``max_tokens``."""
    prompt = "hello world the cache is warm"
    ids = _encode(checkpoint, prompt)
    free = reference(ids, 12)
    # The first token that does not occur before it, at index 1 or later: made the eos.
    stop_at = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    # Without the early stop the engine would run 11 decode steps for max_tokens=12.
    assert stop_at < 11, free
    copy = tmp_path / "eos_ckpt"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    config["eos_token_id"] = free[0]
    (copy / "config.json").write_text(json.dumps(config))
    unused = next(t for t in range(config["vocab_size"]) if t not in free)
    generation = {"eos_token_id": [unused, free[stop_at]]}
    (copy / "generation_config.json").write_text(json.dumps(generation))
    argv = ["--model", str(copy), "--page-size", "4", "--device-pages", "64"]
    argv += ["--cache", "host", "--max-new-tokens", "12"]
    small = LiveServer(argv, one_rank_topology)
    try:
        model = small.server.engine.model
        decode, decode_batch = model.decode, model.decode_batch
        calls = []  # one entry per decoded token, one request at a time or batched

        def counting(token, state):
            calls.append(token)
            return decode(token, state)

        def counting_batch(tokens, states):
            calls.extend(tokens)
            return decode_batch(tokens, states)

        model.decode, model.decode_batch = counting, counting_batch
        client = small.client()
        out = client.completions.create(model=small.server.name, prompt=prompt, max_tokens=12)
        choice = out.choices[0]
        assert choice.token_ids == free[:stop_at]
        # usage counts the end-of-sequence token too, as vLLM's does.
        assert choice.finish_reason == "stop" and out.usage.completion_tokens == stop_at + 1
        assert len(calls) <= len(choice.token_ids)
        # Streaming stops at the same token.
        calls.clear()
        chunks = list(
            client.completions.create(
                model=small.server.name, prompt=prompt, max_tokens=12, stream=True
            )
        )
        streamed = [
            t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids", [])
        ]
        assert streamed == free[:stop_at]
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert len(calls) <= stop_at
        # ignore_eos (vLLM's extension): every token up to max_tokens.
        out = client.completions.create(
            model=small.server.name, prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True}
        )
        whole = out.choices[0].token_ids
        assert len(whole) == 12 and whole[: len(free)] == free
        assert out.choices[0].finish_reason == "length"
        small.wait_idle()
        assert small.server.cache is not None
        small.server.cache.check_integrity()
    finally:
        small.close()
