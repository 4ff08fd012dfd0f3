"""The client side of ``scripts/bench_server.py``: a ``runtime.server`` subprocess, and
client threads (the official ``openai`` client) that stream a set of conversations to it.

A conversation's later turn is its previous prompt, the answer and the turn's new tokens,
so two servers that answer alike get the same requests."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Conversation:
    """One client conversation: the first turn's prompt, then each later turn's new tokens."""

    index: int
    first_prompt: tuple[int, ...]
    appends: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one client saw of one streamed request."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output_ids: tuple[int, ...]
    ttft_s: float
    latency_s: float


class ServerProcess:
    """``python -m runtime.server`` in its own session; the URL comes from its ready line.

    ``stop`` sends SIGTERM and waits, then kills the process group: no server outlives
    the benchmark."""

    def __init__(self, argv: Sequence[str], timeout_s: float = 180.0) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        # This tree's runtime/ first (a venv's editable install may point elsewhere).
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.server", *argv],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.url = ""
        self._seen = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._seen.wait(timeout_s) or not self.url:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-30:]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            found = re.search(r"on (http://[^/\s]+)/v1", line)
            if found and not self.url:
                self.url = found.group(1)
                self._seen.set()
        self._seen.set()

    def peak_running(self) -> int | None:
        """The server's ``mesh_hicache_server_peak_running`` gauge (None if unreadable)."""
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return None
        found = re.search(r"^mesh_hicache_server_peak_running (\S+)$", text, re.M)
        return int(float(found.group(1))) if found else None

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL of the whole group after ``timeout_s``; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._reader.join(10)  # its last lines are in self.lines; then the pipe can close
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()
        return self.proc.returncode


def stream_one(
    client: Any,
    model: str,
    conversation: int,
    turn: int,
    prompt: Sequence[int],
    max_tokens: int,
    extra_body: Mapping[str, Any] | None = None,
) -> RequestRecord:
    """One streamed completion of token ids, timed on the client.

    ``extra_body``: request fields beyond the OpenAI ones (vLLM needs
    ``return_token_ids`` to stream ids, ``temperature`` 0 for greedy). TTFT is from
    sending the request to the first chunk carrying a token; latency runs
    to the end of the stream (after the usage chunk). ``RuntimeError`` without usage."""
    start = time.perf_counter()
    ttft = 0.0
    output: list[int] = []
    usage = None
    stream = client.completions.create(
        model=model,
        prompt=list(prompt),
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=dict(extra_body) if extra_body else None,
    )
    for chunk in stream:
        if chunk.choices:
            ids = getattr(chunk.choices[0], "token_ids", None) or []
            if ids and not output:
                ttft = time.perf_counter() - start
            output.extend(ids)
        if chunk.usage is not None:
            usage = chunk.usage
    latency = time.perf_counter() - start
    if usage is None:
        raise RuntimeError("the stream carried no usage chunk")
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return RequestRecord(
        conversation, turn, usage.prompt_tokens, cached, tuple(output), ttft or latency, latency
    )


def run_clients(
    url: str,
    model: str,
    conversations: Sequence[Conversation],
    clients: int,
    max_tokens: int,
    extra_body: Mapping[str, Any] | None = None,
) -> tuple[list[RequestRecord], float]:
    """``clients`` threads take conversations in order and run each to its last turn.

    Returns every request's record and the wall time from the first request to the last
    answer. The first client error is raised after every thread has stopped."""
    import openai

    todo: queue.Queue[Conversation] = queue.Queue()
    for conv in conversations:
        todo.put(conv)
    records: list[RequestRecord] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def work() -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
        start.wait()
        try:
            while not errors:
                try:
                    conv = todo.get_nowait()
                except queue.Empty:
                    return
                prompt = list(conv.first_prompt)
                for turn in range(len(conv.appends) + 1):
                    if turn:
                        prompt += list(conv.appends[turn - 1])
                    rec = stream_one(
                        client, model, conv.index, turn, prompt, max_tokens, extra_body
                    )
                    with lock:
                        records.append(rec)
                    prompt += rec.output_ids
        except BaseException as err:  # noqa: BLE001 - re-raised by the caller
            with lock:
                errors.append(err)
        finally:
            client.close()

    threads = [threading.Thread(target=work, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return records, wall
