# ruff: noqa: F811 - test_server.py's fixtures are imported, then named as arguments
"""runtime.server batching concurrent requests (``--concurrency N``, default 8), driven
by the official ``openai`` client on the tiny text checkpoint of ``test_server.py``.

Batching is shown without a clock: :class:`DecodeGate` holds the engine inside a
``decode_batch`` call until the test has seen what it needs (every request arrived, a
client gone), so which requests share a step is known. Answers are checked against an
engine without a cache on the same weights (sequential, one request at a time).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("openai", reason="needs the openai client (test extra)")
pytest.importorskip("aiohttp", reason="needs aiohttp (server extra)")
pytest.importorskip("prometheus_client", reason="needs prometheus-client (test extra)")
pytest.importorskip("tokenizers", reason="needs tokenizers (test extra)")

# The fixtures are test_server.py's; each module gets its own server.
from tests.unit.test_server import (  # noqa: E402, F401
    LiveServer,
    _encode,
    checkpoint,
    live,
    reference,
)

pytestmark = pytest.mark.timeout(240)


class DecodeGate:
    """Wraps ``model.decode_batch``: the first call for which the armed predicate (of
    the batch size) is true waits, inside the engine's step, until the test opens it. The
    test thus knows the engine's state at that point without reading a clock."""

    def __init__(self, model) -> None:
        self.model = model
        self.inner = model.decode_batch
        self.sizes: list[int] = []
        self._lock = threading.Lock()
        self._armed: tuple | None = None
        self._gos: list[threading.Event] = []
        model.decode_batch = self._call

    def arm(self, predicate) -> tuple[threading.Event, threading.Event]:
        """(held: set when a call waits, go: set it to let that call go on)."""
        held, go = threading.Event(), threading.Event()
        with self._lock:
            self._armed = (predicate, held, go)
            self._gos.append(go)
        return held, go

    def _call(self, tokens, states):
        self.sizes.append(len(tokens))
        with self._lock:
            armed = self._armed
            if armed is not None and armed[0](len(tokens)):
                self._armed = None
            else:
                armed = None
        if armed is not None:
            armed[1].set()
            if not armed[2].wait(120):
                raise TimeoutError("the test never opened the gate")
        return self.inner(tokens, states)

    def remove(self) -> None:
        """Unwrap; a call still waiting goes on (a failed test must not hang the engine)."""
        with self._lock:
            self._armed = None
            for go in self._gos:
                go.set()
        del self.model.decode_batch


def _wait_for(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _in_server(live) -> int:
    """Jobs queued or taken by the engine thread (not yet finished)."""
    return len(live.server.queue) + len(live.server.worker.jobs)


def _wait(event: threading.Event, what: str) -> None:
    assert event.wait(120), what


def test_concurrent_requests_are_decoded_in_one_batch(live, checkpoint, reference) -> None:
    """Requests that arrive while one is running join its batch: one decode_batch of all
    of them (and /metrics shows them running at once), with the sequential answers."""
    live.wait_idle()
    prompts = [f"the {w} cache {w} is warm" for w in ("w21", "w31", "w41", "w51")]
    gate = DecodeGate(live.server.engine.model)
    pool = ThreadPoolExecutor(len(prompts))

    def ask(prompt: str) -> list[int]:
        out = live.client().completions.create(model=live.server.name, prompt=prompt, max_tokens=6)
        return out.choices[0].token_ids

    try:
        first, go_first = gate.arm(lambda n: True)
        futures = [pool.submit(ask, p) for p in prompts]
        _wait(first, "no request reached a decode")
        # The engine waits in the first decode; every request reaches the server.
        _wait_for(lambda: _in_server(live) == len(prompts), "the requests never arrived")
        together, go_together = gate.arm(lambda n: n == len(prompts))
        go_first.set()
        _wait(together, "the requests were never decoded in one batch")
        assert live.metric("mesh_hicache_server_running") == len(prompts)
        go_together.set()
        answers = [f.result() for f in futures]
    finally:
        gate.remove()
        pool.shutdown()
    # Counted after the step that admitted them (which the gate held above).
    assert live.metric("mesh_hicache_server_peak_running") >= len(prompts)
    assert answers == [reference(_encode(checkpoint, p), 6) for p in prompts]
    assert max(gate.sizes) == len(prompts)
    live.wait_idle()
    assert live.server.cache is not None
    live.server.cache.check_integrity()


def test_an_abort_mid_batch_leaves_the_others_right(live, checkpoint, reference) -> None:
    """A stream whose client goes away while it runs in a batch of three is aborted at the
    next step and released; the two others go on in the batch and get their answers."""
    live.wait_idle()
    client = live.client()
    aborted = live.metric("mesh_hicache_server_aborted_total")
    generated = live.metric("mesh_hicache_server_completion_tokens_total")
    prompts = ["hello w22 world w23 the cache", "warm w32 is w33 hello"]
    gate = DecodeGate(live.server.engine.model)
    pool = ThreadPoolExecutor(len(prompts))

    def ask(prompt: str) -> list[int]:
        out = live.client().completions.create(model=live.server.name, prompt=prompt, max_tokens=8)
        return out.choices[0].token_ids

    try:
        first, go_first = gate.arm(lambda n: True)
        stream = client.completions.create(
            model=live.server.name, prompt="the cache w42 is", max_tokens=600, stream=True
        )
        futures = [pool.submit(ask, p) for p in prompts]
        _wait(first, "no request reached a decode")
        _wait_for(lambda: _in_server(live) == 3, "the requests never arrived")
        together, go_together = gate.arm(lambda n: n == 3)
        go_first.set()
        _wait(together, "the three were never decoded in one batch")
        iterator = iter(stream)
        next(iterator)  # its first token was streamed before this decode
        stream.close()  # the client goes away while the engine is mid-step
        jobs = live.server.worker.jobs
        _wait_for(
            lambda: any(j.cancelled.is_set() for j in list(jobs.values())),
            "the server never saw the disconnect",
        )
        held_at = len(gate.sizes)
        go_together.set()
        answers = [f.result() for f in futures]
    finally:
        gate.remove()
        pool.shutdown()
    assert answers == [reference(_encode(checkpoint, p), 8) for p in prompts]
    # The next step ran without the aborted request, the other two still in the batch.
    assert gate.sizes[held_at] == 2, gate.sizes
    _wait_for(
        lambda: live.metric("mesh_hicache_server_aborted_total") == aborted + 1,
        "the request was never aborted",
    )
    live.wait_idle()
    assert live.metric("mesh_hicache_server_integrity_errors_total") == 0
    assert live.server.cache is not None
    live.server.cache.check_integrity()
    served = sum(len(a) for a in answers)
    assert live.metric("mesh_hicache_server_completion_tokens_total") == generated + served


def test_concurrency_one_serves_one_at_a_time(checkpoint, one_rank_topology, reference) -> None:
    argv = ["--model", str(checkpoint), "--page-size", "4", "--device-pages", "64"]
    argv += ["--cache", "host", "--max-new-tokens", "4", "--concurrency", "1"]
    small = LiveServer(argv, one_rank_topology)
    try:
        prompts = [f"hello {w} world {w}" for w in ("w24", "w34", "w44")]

        def ask(prompt: str) -> list[int]:
            out = small.client().completions.create(model=small.server.name, prompt=prompt)
            return out.choices[0].token_ids

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, prompts))
        assert answers == [reference(_encode(checkpoint, p), 4) for p in prompts]
        assert small.metric("mesh_hicache_server_peak_running") == 1
    finally:
        small.close()


def test_a_job_beyond_concurrency_stays_queued_and_a_disconnect_drops_it(
    checkpoint, one_rank_topology, reference
) -> None:
    """--concurrency 2 with two running: a third request waits in the queue (/metrics
    queued 1); its client goes away, so it is dropped there, never served or aborted."""
    argv = ["--model", str(checkpoint), "--page-size", "4", "--device-pages", "64"]
    argv += ["--cache", "host", "--max-new-tokens", "6", "--concurrency", "2"]
    small = LiveServer(argv, one_rank_topology)
    try:
        _queued_then_dropped(small, checkpoint, reference)
    finally:
        small.close()


def _queued_then_dropped(small, checkpoint, reference) -> None:
    gate = DecodeGate(small.server.engine.model)
    pool = ThreadPoolExecutor(2)
    prompts = ["hello w25 world w26", "the w35 cache w36 is"]

    def ask(prompt: str) -> list[int]:
        out = small.client().completions.create(model=small.server.name, prompt=prompt)
        return out.choices[0].token_ids

    try:
        first, go_first = gate.arm(lambda n: True)
        futures = [pool.submit(ask, p) for p in prompts]
        _wait(first, "no request reached a decode")
        _wait_for(lambda: _in_server(small) == 2, "the requests never arrived")
        together, go_together = gate.arm(lambda n: n == 2)
        go_first.set()
        _wait(together, "the two were never decoded in one batch")
        stream = small.client().completions.create(
            model=small.server.name, prompt="warm w45 is", max_tokens=50, stream=True
        )
        # The engine is mid-step with two in flight: the third waits in the queue.
        assert small.metric("mesh_hicache_server_queued") == 1
        assert small.metric("mesh_hicache_server_running") == 2
        stream.close()
        queued = small.server.queue._items  # the test reads the queue's deque
        _wait_for(
            lambda: any(j is not None and j.cancelled.is_set() for j in list(queued)),
            "the server never saw the disconnect",
        )
        go_together.set()
        answers = [f.result() for f in futures]
    finally:
        gate.remove()
        pool.shutdown()
    assert answers == [reference(_encode(checkpoint, p), 6) for p in prompts]
    small.wait_idle()
    assert small.metric("mesh_hicache_server_requests_total") == 2
    assert small.metric("mesh_hicache_server_aborted_total") == 0
    served = sum(len(a) for a in answers)
    assert small.metric("mesh_hicache_server_completion_tokens_total") == served
    assert small.server.cache is not None
    small.server.cache.check_integrity()


def test_eight_clients_on_a_warm_storage_root(checkpoint, one_rank_topology, reference, tmp_path):
    """A server fills a storage root and closes; a fresh one on that root (empty L1 and
    L2) gets 8 concurrent clients whose prompts cut one long prefix at different pages:
    their prefetches and loads of the shared pages overlap. Every answer equals the
    engine without a cache, the cache passes check_integrity, and storage served hits."""
    argv = ["--model", str(checkpoint), "--page-size", "4", "--device-pages", "96"]
    argv += ["--storage-root", str(tmp_path / "l3"), "--max-new-tokens", "4"]
    argv += ["--prefetch-threshold", "4", "--concurrency", "8"]
    stem = [f"w{n}" for n in range(60, 60 + 40)]
    prompts = [" ".join(stem[: 8 + 4 * i] + [f"w{200 + i}"]) for i in range(8)]

    def ask(server: LiveServer, prompt: str) -> list[int]:
        out = server.client().completions.create(model=server.server.name, prompt=prompt)
        return out.choices[0].token_ids

    want = [reference(_encode(checkpoint, p), 4) for p in prompts]
    first = LiveServer(argv, one_rank_topology)
    try:
        assert [ask(first, p) for p in prompts] == want
    finally:
        first.close()  # flushes every backup to the root
    warm = LiveServer(argv, one_rank_topology)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: ask(warm, p), prompts))
        assert answers == want
        warm.wait_idle()
        assert warm.metric("mesh_hicache_server_integrity_errors_total") == 0
        assert warm.server.cache is not None
        warm.server.cache.flush()
        warm.server.cache.check_integrity()
        assert warm.server.cache.stats().hit_tokens_storage > 0
    finally:
        warm.close()
