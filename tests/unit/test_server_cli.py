"""``python -m runtime.server`` as a user starts it: one rank, and rank 0 of a 2-rank
torchrun mesh broadcasting every request (and the abort of a disconnected client).

A preset has no tokenizer, so the prompt is a list of token ids and the answer's ids
come back in ``choices[0].token_ids``; they must equal an engine without a cache.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="needs the openai client (test extra)")
pytest.importorskip("aiohttp", reason="needs aiohttp (server extra)")

from runtime.engine import Engine  # noqa: E402
from runtime.serve import main as serve  # noqa: E402

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]
PROMPT = [(7 * i + 3) % 200 for i in range(40)]


class Process:
    """A server subprocess; its URL is read from the line it prints when it listens."""

    def __init__(
        self, command: list[str], tmp_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.api_key = (env or {}).get("MESH_HICACHE_API_KEY", "none")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._url: list[str] = []
        self._seen = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._seen.wait(120):
            self.kill()
            pytest.fail("the server never listened:\n" + "".join(self.lines))
        if not self._url:
            pytest.fail("the server exited:\n" + "".join(self.lines))
        self.url = self._url[0]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            if found:
                self._url.append(found.group(1))
                self._seen.set()
        self._seen.set()

    def client(self):  # -> openai.OpenAI
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=self.api_key, timeout=60, max_retries=0
        )

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def reference(one_rank_topology) -> Iterator:
    args = serve.build_parser().parse_args(["--model", "tiny"])
    engine = Engine(serve.build_model(args, one_rank_topology), None)
    yield lambda ids, n: engine.serve(ids, max_new_tokens=n).output_ids


def _counter(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_one_rank_cli_token_ids_and_sigterm(tmp_path: Path, reference) -> None:
    server = Process(
        [sys.executable, "-m", "runtime.server", "--model", "tiny", "--cache", "host"]
        + ["--port", "0", "--max-new-tokens", "3"],
        tmp_path,
    )
    try:
        client = server.client()
        out = client.completions.create(model="tiny", prompt=PROMPT)
        assert out.choices[0].token_ids == reference(PROMPT, 3)
        assert out.choices[0].text == ""  # no tokenizer: the answer is token_ids
        assert out.choices[0].finish_reason == "length"
        # A stop token id ends the answer before it (finish "stop"); stop strings need text.
        ids = out.choices[0].token_ids
        cut = client.completions.create(
            model="tiny", prompt=PROMPT, extra_body={"stop_token_ids": [ids[1]]}
        )
        assert cut.choices[0].token_ids == ids[: ids.index(ids[1])]
        assert cut.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
            client.completions.create(model="tiny", prompt=PROMPT, stop=["x"])
        with pytest.raises(openai.BadRequestError, match="list of token ids"):
            client.completions.create(model="tiny", prompt="text needs a tokenizer")
        with pytest.raises(openai.BadRequestError, match="chat needs a checkpoint"):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}]
            )
        again = client.completions.create(model="tiny", prompt=PROMPT)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert again.choices[0].token_ids == out.choices[0].token_ids
    finally:
        code = server.stop()
    assert code == 0, "".join(server.lines)
    assert "3 requests served (1 uncached)" in "".join(server.lines)
    # No size flag: the budgets come from the machine, in bytes and tokens, in one line.
    budgets = [x for x in server.lines if "cache budgets per rank" in x]
    assert len(budgets) == 1 and "L1 the CPU default" in budgets[0], server.lines
    assert re.search(r"L1 \d+ bytes \(.* GiB, \d+ tokens\), L2 \d+ bytes", budgets[0])


def test_two_rank_mesh_broadcasts_requests_and_aborts(tmp_path: Path, reference) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip(f"needs torchrun beside {sys.executable}")
    server = Process(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "runtime.server"]
        + ["--model", "tiny", "--tp", "2", "--cache", "host", "--port", "0"]
        + ["--max-new-tokens", "4", "--collective-timeout-s", "20"],
        tmp_path,
    )
    try:
        client = server.client()
        out = client.completions.create(model="tiny", prompt=PROMPT)
        assert out.choices[0].token_ids == reference(PROMPT, 4)
        # Idle longer than a heartbeat: the waiting rank must not time out.
        time.sleep(6)
        stream = client.completions.create(
            model="tiny", prompt=PROMPT[:20], max_tokens=400, stream=True
        )
        chunks = iter(stream)
        next(chunks)
        stream.close()
        deadline = time.monotonic() + 60
        while _counter(server.metrics(), "mesh_hicache_server_aborted_total") < 1:
            assert time.monotonic() < deadline, "the abort never happened"
            time.sleep(0.1)
        later = client.completions.create(model="tiny", prompt=PROMPT[::-1])
        assert later.choices[0].token_ids == reference(PROMPT[::-1], 4)
        text = server.metrics()
        assert _counter(text, "mesh_hicache_server_integrity_errors_total") == 0
    finally:
        server.stop()  # torchrun's own exit code after SIGTERM is its signal's
    log = "".join(server.lines)
    assert "2 requests served (2 uncached), 1 aborted" in log, log


def test_two_rank_mesh_batches_concurrent_requests_in_lockstep(tmp_path: Path, reference) -> None:
    """tp 2 with --concurrency 4: concurrent clients (different prompts and lengths, one
    that goes away mid-stream) get the one-rank sequential answers."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip(f"needs torchrun beside {sys.executable}")
    server = Process(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "runtime.server"]
        + ["--model", "tiny", "--tp", "2", "--cache", "host", "--port", "0"]
        + ["--concurrency", "4", "--token-budget", "16", "--collective-timeout-s", "20"],
        tmp_path,
    )
    asks = [(PROMPT, 5), (PROMPT[::-1], 3), (PROMPT[5:30], 7), (PROMPT[:12] * 2, 4)]
    asks += [(PROMPT[3:], 6), (PROMPT[::2], 2)]
    try:
        stream = server.client().completions.create(
            model="tiny", prompt=PROMPT[:20], max_tokens=400, stream=True
        )

        def ask(item: tuple[list[int], int]) -> list[int]:
            ids, n = item
            out = server.client().completions.create(model="tiny", prompt=ids, max_tokens=n)
            return out.choices[0].token_ids

        with ThreadPoolExecutor(len(asks)) as pool:
            futures = [pool.submit(ask, item) for item in asks]
            next(iter(stream))
            stream.close()
            answers = [f.result() for f in futures]
        assert answers == [reference(ids, n) for ids, n in asks]
        deadline = time.monotonic() + 60
        while _counter(server.metrics(), "mesh_hicache_server_aborted_total") < 1:
            assert time.monotonic() < deadline, "the abort never happened"
            time.sleep(0.1)
        assert _counter(server.metrics(), "mesh_hicache_server_integrity_errors_total") == 0
    finally:
        server.stop()
    log = "".join(server.lines)
    assert f"{len(asks)} requests served" in log and "1 aborted" in log, log


def test_unusable_storage_root_is_an_error_before_listening(tmp_path: Path) -> None:
    root = tmp_path / "not-a-dir"
    root.write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.server", "--model", "tiny", "--port", "0"]
        + ["--storage-root", str(root)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert str(root) in proc.stderr and "is not a directory" in proc.stderr
    assert "serving" not in proc.stdout


def test_help_names_the_http_flags_with_defaults_and_hides_trace_flags() -> None:
    from runtime.server.main import build_parser

    parser = build_parser()
    text = parser.format_help()
    assert "--port" in text and "(default: 8000)" in text and "(default: 127.0.0.1)" in text
    assert "--workload" not in text and "--sessions" not in text and "--json" not in text
    assert "--request-rate" not in text and "--think-s" not in text
    concurrency = next(a for a in parser._actions if a.dest == "concurrency")
    assert concurrency.default == 8 and "one running batch" in (concurrency.help or "")
    assert "--token-budget" in text
    assert [a.dest for a in parser._actions if not a.help] == []
    assert parser.prog == "runtime.server"


def test_a_busy_port_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "runtime.server", "--model", "tiny", "--port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        f"runtime.server: error: 127.0.0.1:{port} is already in use; pick another "
        "--port (0: a free one)"
    ], proc.stderr[-2000:]


def _stream_tokens(server: Process, max_tokens: int, started: threading.Event) -> dict:
    """Stream one request; returns its token count, finish reason and any error event."""
    out: dict = {"tokens": 0, "finish": None, "error": None}
    try:
        stream = server.client().completions.create(
            model="tiny", prompt=PROMPT, max_tokens=max_tokens, stream=True
        )
        for chunk in stream:
            started.set()
            choice = chunk.choices[0] if chunk.choices else None
            if choice is not None:
                out["tokens"] += len((choice.model_extra or {}).get("token_ids", []))
                out["finish"] = choice.finish_reason or out["finish"]
    except Exception as err:  # the error event of an aborted stream
        out["error"] = str(err)
    started.set()
    return out


@pytest.mark.parametrize("drain_s", [60, 0])
def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path: Path, drain_s: int) -> None:
    """SIGTERM: no new connection; the request in flight finishes (a long drain) or is
    aborted with an error event (no drain); the cache is clean; exit 0, promptly."""
    server = Process(
        [sys.executable, "-m", "runtime.server", "--model", "tiny", "--cache", "host"]
        + ["--port", "0", "--drain-s", str(drain_s), "--max-tokens-limit", "2000"],
        tmp_path,
        env={"MESH_HICACHE_API_KEY": f"key-{drain_s}"},  # the key from the environment
    )
    try:
        keyless = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            keyless.completions.create(model="tiny", prompt=PROMPT)
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(_stream_tokens, server, 150 if drain_s else 2000, started)
            assert started.wait(60)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(90)
            result = future.result(60)
        took = time.monotonic() - t0
    finally:
        server.kill()
    log = "".join(server.lines)
    assert code == 0, log
    assert "Traceback" not in log and "integrity" not in log, log
    if drain_s:
        assert result == {"tokens": 150, "finish": "length", "error": None}, result
        assert "1 requests served" in log, log
    else:
        assert result["error"] and result["tokens"] < 2000, result
        assert "1 aborted" in log and took < 30, (took, log)
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url + "/health", timeout=5)


def test_seeded_sampling_on_a_1x2x2_mesh_equals_one_rank(tmp_path: Path, one_rank_topology) -> None:
    """cp 2 x tp 2 (4 ranks, --concurrency 4): seeded sampled answers, with penalties,
    top-k/top-p and n > 1, requested concurrently, equal one rank's sampler on the same
    weights; every rank draws the same token (the ranks' caches stay consistent, so the
    later tokens still equal one rank's)."""
    from runtime.sampling import Sampler, SamplingParams

    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip(f"needs torchrun beside {sys.executable}")
    args = serve.build_parser().parse_args(["--model", "tiny"])
    engine = Engine(serve.build_model(args, one_rank_topology), None)
    asks = [
        (PROMPT, dict(temperature=1.0, seed=7)),
        (PROMPT[::-1], dict(temperature=0.8, top_p=0.9, seed=8)),
        (PROMPT[5:30], dict(temperature=1.2, top_k=20, frequency_penalty=0.5, seed=9)),
        (PROMPT[:12] * 2, dict(temperature=1.0, presence_penalty=1.0, seed=10)),
    ]

    def one_rank(ids: list[int], sampling: dict, seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(**{**sampling, "seed": seed}), ids)
        return engine.serve(ids, max_new_tokens=8, sampler=sampler).output_ids

    server = Process(
        [str(torchrun), "--standalone", "--nproc-per-node", "4", "-m", "runtime.server"]
        + ["--model", "tiny", "--cp", "2", "--tp", "2", "--cache", "host", "--port", "0"]
        + ["--concurrency", "4", "--token-budget", "16", "--collective-timeout-s", "30"],
        tmp_path,
    )
    try:

        def ask(item: tuple[list[int], dict]) -> list[list[int]]:
            ids, sampling = item
            extra = {"top_k": sampling.pop("top_k")} if "top_k" in sampling else {}
            out = server.client().completions.create(
                model="tiny", prompt=ids, max_tokens=8, n=2, extra_body=extra, **sampling
            )
            return [c.token_ids for c in out.choices]

        with ThreadPoolExecutor(len(asks)) as pool:
            answers = list(pool.map(ask, [(ids, dict(s)) for ids, s in asks]))
    finally:
        server.stop()
    for (ids, sampling), got in zip(asks, answers, strict=True):
        seed = sampling["seed"]
        assert got == [one_rank(ids, sampling, seed), one_rank(ids, sampling, seed + 1)]
    assert answers[0][0] != engine.serve(PROMPT, max_new_tokens=8).output_ids  # sampled
