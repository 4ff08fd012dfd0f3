"""cProfile of ``runtime.server`` under ``scripts/bench_vllm.py``'s workload.

The server runs in a child process (this script with ``--child``) that wraps the engine
thread (``BatchWorker.run`` / ``EngineWorker.run``) and the HTTP thread (``main``) each in
its own ``cProfile.Profile``; the parent sends the multi-turn chat (warm-up, then the
rounds, the same client as the benchmark) and stops the server, whose profiles are then
written to ``OUT.engine.prof`` / ``OUT.http.prof`` and summarized (top functions by own
and cumulative time, and each thread's CPU seconds)::

    PYTHONPATH=$PWD python scripts/profile_server.py bench_results/vllm_checkpoints/llama \\
        /tmp/prof --cpus 1 -- --cache host --device-bytes 8388608
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import bench_vllm_servers as servers
from bench_server_client import ROOT, run_clients
from bench_vllm import GREEDY, conversations_from_workload, run_rounds


def child(out: str, argv: list[str]) -> int:
    """Serve ``argv`` with both threads profiled; write the profiles at exit."""
    from runtime.server import batch, main, worker

    profiles: dict[str, cProfile.Profile] = {}
    cpu: dict[str, float] = {}

    def wrap(cls: type) -> None:
        run = cls.run

        def profiled(self: object) -> None:
            prof = profiles["engine"] = cProfile.Profile()
            t0 = time.thread_time()
            prof.enable()
            try:
                run(self)
            finally:
                prof.disable()
                cpu["engine"] = time.thread_time() - t0

        cls.run = profiled  # type: ignore[method-assign]

    wrap(batch.BatchWorker)
    wrap(worker.EngineWorker)
    prof = profiles["http"] = cProfile.Profile()
    t0 = time.thread_time()
    prof.enable()
    try:
        code = main.main(argv)
    finally:
        prof.disable()
        cpu["http"] = time.thread_time() - t0
    for name, p in profiles.items():
        p.dump_stats(f"{out}.{name}.prof")
    Path(f"{out}.cpu").write_text(" ".join(f"{k}={v:.3f}" for k, v in cpu.items()))
    return code


def summary(path: str, top: int) -> str:
    buf = io.StringIO()
    stats = pstats.Stats(path, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("out", help="prefix of the .prof files")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--first-len", type=int, default=512)
    p.add_argument("--append-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--cpus", default="0")
    p.add_argument("--top", type=int, default=35)
    args = sys.argv[1:]
    extra = args[args.index("--") + 1 :] if "--" in args else []
    a = p.parse_args(args[: len(args) - len(extra) - (1 if extra else 0)])
    import json

    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    convs = conversations_from_workload(a.sessions, a.turns, vocab, a.first_len, a.append_len, 0)
    warm = conversations_from_workload(2, 1, vocab, a.first_len, a.append_len, 1)
    argv = ["--model", str(Path(a.model).resolve()), "--host", "127.0.0.1", "--port", "0"]
    argv += ["--served-model-name", servers.SERVED_NAME, "--log-level", "WARNING"]
    argv += ["--threads", "1", "--concurrency", str(a.clients)]
    argv += ["--max-new-tokens", str(a.max_tokens), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "scripts")])
    cmd = [sys.executable, __file__, "--child", a.out, *argv]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if a.cpus:
        os.sched_setaffinity(proc.pid, {int(c) for c in a.cpus.split(",")})
    url = ""
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if " on http://" in line:
            url = line.split(" on ")[1].strip().removesuffix("/v1")
            break
    if not url:
        print("".join(lines), file=sys.stderr)
        return 1
    rest = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    rest.start()
    run_clients(url, servers.SERVED_NAME, warm, 1, a.max_tokens, GREEDY)
    t0 = time.perf_counter()
    records, wall = run_rounds(url, convs, a.clients, a.max_tokens)
    elapsed = time.perf_counter() - t0
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    rest.join(10)
    print("".join(lines[-5:]))
    print(
        f"{len(records)} requests in {wall:.2f} s ({len(records) / wall:.2f} req/s), {elapsed:.2f}"
    )
    print("thread CPU s:", Path(f"{a.out}.cpu").read_text())
    for name in ("engine", "http"):
        print(f"==== {name} ====")
        print(summary(f"{a.out}.{name}.prof", a.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
