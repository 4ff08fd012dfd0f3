"""Run a test body on N ranks of a mesh, without torchrun.

``run_on_mesh(shape, body, *args)`` forks one process per rank from a forkserver that
has torch preloaded (a 4-rank run costs well under a second after the first), joins
them into a gloo (CPU) or NCCL (CUDA) process group through a TCPStore that this
process hosts on 127.0.0.1 with a kernel-chosen port, builds the DeviceMesh with
``init_device_mesh`` and calls ``body(mesh, *args)`` on every rank. It returns the
bodies' return values in rank order.

Failure is loud and bounded: a rank that raises fails the call with its traceback and
mesh coordinates; a rank that dies fails it at once; a rank that hangs fails it
``timeout`` seconds after every rank was up (process group and mesh built; starting has
its own bound, ``start_timeout``, so a loaded machine's slow start is not read as a
hang); every rank process is killed before the call returns. ``body`` must be a module-level
function (it is pickled by name).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import pytest
import torch
import torch.distributed as dist

DEFAULT_NAMES = {1: ("tp",), 2: ("cp", "tp"), 3: ("pp", "cp", "tp")}
_UP = b"up"
"""A rank's first message once its process group and mesh exist (then its report)."""
_CTX: Any = None


class RankFailure(AssertionError):
    """A rank raised, died or timed out.

    ``after_up_s``: seconds from the first rank's report that it is up (its process
    group built, so every rank got that far) until the failure was raised; None when no
    rank came up. It bounds the harness's reaction without the start a loaded machine
    slows."""

    after_up_s: float | None = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", __name__])
    return _CTX


def preload(*modules: str) -> None:
    """Also import ``modules`` in the forkserver, so every rank starts with them loaded.

    Call before this process's first ``run_on_mesh`` (the forkserver starts then)."""
    _context().set_forkserver_preload(["torch", "torch.distributed", __name__, *modules])


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _rank_main(
    rank: int,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    backend: str,
    port: int,
    timeout: float,
    start_timeout: float,
    body: Callable[..., Any],
    args: tuple[Any, ...],
    conn: Connection,
) -> None:
    torch.set_num_threads(1)
    world = 1
    for s in shape:
        world *= s
    coords: Any = None
    try:
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            world,
            is_master=False,
            timeout=timedelta(seconds=max(timeout, start_timeout)),
        )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
        )
        device_type = "cuda" if backend == "nccl" else "cpu"
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        mesh = dist.init_device_mesh(device_type, shape, mesh_dim_names=names)
        coords = dict(zip(names, mesh.get_coordinate() or (), strict=False))
        conn.send_bytes(_UP)
        report = _encode(("ok", rank, coords, body(mesh, *args)))
    except BaseException:
        _report(conn, _encode(("error", rank, coords, traceback.format_exc())), timeout)
        # Peers may be blocked in a collective with us; do not wait for them.
        os._exit(1)
    _report(conn, report, timeout)
    dist.destroy_process_group()
    # No interpreter finalization: a gloo worker thread may still be dropping the last
    # collective's tensors, and that aborts a finalizing process (runtime.launch.exit_process).
    os._exit(0)


def _encode(report: tuple[Any, ...]) -> bytes:
    """Plain bytes: tensors are copied into the pickle (``pickle``, not torch's
    fd-sharing ``ForkingPickler``), so the parent can read a report after we exit."""
    return pickle.dumps(_to_plain(report), protocol=pickle.HIGHEST_PROTOCOL)


def _to_plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        # A view of a large (e.g. pool) storage would otherwise pickle the whole storage.
        return value.detach().to("cpu").clone()
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_to_plain(v) for v in value)
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _report(conn: Connection, payload: bytes, timeout: float) -> None:
    """Send ``payload`` and return only once the parent has acknowledged it (or is gone)."""
    try:
        conn.send_bytes(payload)
        if conn.poll(timeout):
            conn.recv_bytes()
    except (OSError, EOFError):
        pass  # the parent gave up on us; it reports the failure itself
    finally:
        conn.close()


def run_on_mesh(
    shape: Sequence[int],
    body: Callable[..., Any],
    *args: Any,
    names: Sequence[str] | None = None,
    backend: str = "gloo",
    timeout: float = 60.0,
    start_timeout: float = 300.0,
) -> list[Any]:
    """Run ``body(mesh, *args)`` on every rank of a mesh of ``shape``; return results by rank.

    ``timeout``: seconds from the moment every rank is up until every report is in (also
    each collective's bound); ``start_timeout``: seconds for every rank to come up.

    ``names`` defaults to the innermost axes (``tp``; ``cp, tp``; ``pp, cp, tp``).
    ``backend="nccl"`` needs one CUDA device per rank and skips the test otherwise.
    """
    shape = tuple(int(s) for s in shape)
    names = tuple(names) if names is not None else DEFAULT_NAMES[len(shape)]
    world = 1
    for s in shape:
        world *= s
    if backend == "nccl" and gpu_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs for NCCL; found {gpu_count()}")

    ctx = _context()
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world + 1,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )
    procs, conns = [], []
    for rank in range(world):
        reader, writer = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=_rank_main,
            args=(
                rank,
                shape,
                names,
                backend,
                store.port,
                timeout,
                start_timeout,
                body,
                args,
                writer,
            ),
            daemon=True,
        )
        proc.start()
        writer.close()
        procs.append(proc)
        conns.append(reader)

    results: dict[int, Any] = {}
    failures: list[str] = []
    up: set[int] = set()
    first_up: list[float] = []  # when each up report came, the first is the one used
    start_deadline = time.monotonic() + start_timeout
    deadline: float | None = None  # set once every rank is up
    pending = dict(enumerate(conns))

    def receive(wait_s: float) -> None:
        """Take every report that arrives within ``wait_s`` into results / failures."""
        for conn in wait(list(pending.values()), timeout=wait_s):
            rank = next(r for r, c in pending.items() if c is conn)
            try:
                message = conn.recv_bytes()
                if message == _UP:
                    up.add(rank)
                    first_up.append(time.monotonic())
                    continue
                del pending[rank]
                status, _, coords, payload = pickle.loads(message)
                conn.send_bytes(b"ack")  # the rank may exit now
            except (EOFError, OSError):
                pending.pop(rank, None)
                procs[rank].join(timeout=0.5)
                exitcode = procs[rank].exitcode
                failures.append(f"rank {rank} died (exit code {exitcode}) without a result")
                continue
            if status == "ok":
                results[rank] = payload
            else:
                failures.append(f"rank {rank} {coords} raised:\n{payload}")

    try:
        while pending and not failures:
            now = time.monotonic()
            if deadline is None and len(up) == world:
                deadline = now + timeout
            if deadline is None and now >= start_deadline:
                late = sorted(set(range(world)) - up)
                failures.append(f"ranks {late} did not start within {start_timeout:g}s")
                break
            if deadline is not None and now >= deadline:
                failures.append(
                    f"timeout after {timeout:.0f}s; ranks {sorted(pending)} did not finish"
                )
                break
            receive(min((deadline or start_deadline) - now, 1.0))
        # Collect what ranks failing at about the same time report: the first error seen
        # is often a peer's "connection reset", the cause another rank's death.
        grace = time.monotonic() + 1.0
        while failures and pending and time.monotonic() < grace:
            receive(0.2)
    finally:
        for proc in procs:
            proc.join(timeout=0.5 if not failures else 0.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()
        del store
    if failures:
        err = RankFailure(f"mesh {dict(zip(names, shape, strict=True))}: " + "\n".join(failures))
        err.after_up_s = time.monotonic() - first_up[0] if first_up else None
        raise err
    return [results[r] for r in range(world)]
