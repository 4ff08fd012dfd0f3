"""torchrun entry point: process group and mesh from ``--pp/--cp/--tp``.

This is the only module that reads the environment (torchrun's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``; ``MESH_HICACHE_STORAGE_SECRET_FILE``,
``MESH_HICACHE_API_KEY``); everything below it
gets its identity from the ``MeshTopology`` built here.

Bounded stalls: every process group of the job (the world, the device mesh's sub-groups,
the cache's agreement groups) fails a collective whose peer is dead or frozen within
``--collective-timeout-s`` (default 60 s), so every other rank fails within that bound;
``mesh_failure`` turns the resulting error into one line naming the cause.

Clean exit: the entry points (``runtime.serve``, ``runtime.server``, this module) end
through ``exit_process`` once they have closed what they own (see its docstring).

    torchrun --nproc-per-node 8 -m runtime.launch --pp 2 --cp 2 --tp 2
    python -m runtime.launch            # one rank, no torchrun needed
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import init_device_mesh

from mesh_hicache.topology import AXIS_ORDER, MeshTopology
from runtime.mesh_config import first_difference

DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 300.0
"""How far apart the ranks of one launch may arrive (imports are slow on a loaded
machine); the collectives after that keep ``--collective-timeout-s``."""
"""Seconds a collective may wait for a peer before the rank gives up (torch: 30 min)."""
API_KEY_ENV = "MESH_HICACHE_API_KEY"
"""Environment variable holding ``runtime.server``'s API key (``--api-key``)."""
SECRET_FILE_ENV = "MESH_HICACHE_STORAGE_SECRET_FILE"
"""Environment variable naming the storage secret file (``--storage-secret-file``)."""

_MESH_ERROR_MARKERS = (
    "timed out",
    "application timeout",
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "gloo",
    "nccl",
)


class LaunchError(ValueError):
    """The launch configuration cannot work (printed without a traceback).

    ``everywhere``: every rank raises this same error (a wrong process count, ranks that
    disagree), so rank 0 alone prints it."""

    def __init__(self, message: str, everywhere: bool = False) -> None:
        super().__init__(message)
        self.everywhere = everywhere


def speaks(err: BaseException) -> bool:
    """Whether this rank prints ``err``: one line per cause, not one per rank. Rank 0
    prints an error every rank has; otherwise the first rank of each node (torchrun's
    ``LOCAL_RANK`` 0), whose ranks share the command line and so its flag errors."""
    if isinstance(err, LaunchError) and err.everywhere:
        return launch_rank() == 0
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


QUIET_RANK_WAIT_S = 20.0
"""How long a rank that leaves a launch error to another rank waits before exiting."""


def report_launch_error(prog: str, err: BaseException) -> int:
    """Print ``err`` as ``prog: error: ...`` on the rank that speaks for it (``speaks``)
    and return exit code 2. Under torchrun a quiet rank first waits up to
    ``QUIET_RANK_WAIT_S``: torchrun stops every rank once one exits, so a quiet rank
    leaving first could stop the speaking one before it printed (the launch would then
    fail with no message at all)."""
    if speaks(err):
        print(f"{prog}: error: {err}", file=sys.stderr)
    elif launch_world_size() > 1:
        sys.stderr.flush()
        time.sleep(QUIET_RANK_WAIT_S)
    return 2


def quiet_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser``, silenced on every rank of a node but its first (usage, errors and
    ``--help`` are printed once per node, not once per rank; the exit codes stay)."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        parser._print_message = lambda message, file=None: None  # type: ignore[method-assign]
    return parser


def add_mesh_args(parser: argparse.ArgumentParser) -> None:
    """``--pp/--cp/--tp`` and ``--collective-timeout-s``."""
    for axis in AXIS_ORDER:
        parser.add_argument(
            f"--{axis.value}",
            type=int,
            default=1,
            metavar="N",
            help=f"mesh size of the {axis.value} axis",
        )
    parser.add_argument(
        "--collective-timeout-s",
        type=float,
        default=DEFAULT_COLLECTIVE_TIMEOUT_S,
        metavar="S",
        help="a collective waiting longer than this for a peer (dead or frozen rank) fails "
        "the rank",
    )


def env_storage_secret_file() -> str | None:
    """The storage secret file named by ``MESH_HICACHE_STORAGE_SECRET_FILE`` (None if unset)."""
    return os.environ.get(SECRET_FILE_ENV) or None


def env_api_key() -> str | None:
    """The server's API key from ``MESH_HICACHE_API_KEY`` (None if unset or empty)."""
    return os.environ.get(API_KEY_ENV) or None


def check_collective_timeout(timeout_s: float) -> None:
    """``LaunchError`` unless ``timeout_s`` is a positive, finite number of seconds."""
    if not (isinstance(timeout_s, int | float) and 0 < timeout_s < float("inf")):
        raise LaunchError(f"--collective-timeout-s must be > 0 seconds, got {timeout_s!r}")


def mesh_failure(err: BaseException) -> str | None:
    """One line naming the cause if ``err`` is a lost peer (timeout, closed connection).

    None for any other error (a bug, a bad input), which should keep its traceback.
    """
    text = str(err).strip()
    distributed = isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError)
        and any(marker in text.lower() for marker in _MESH_ERROR_MARKERS)
    )
    if not distributed:
        return None
    first = text.splitlines()[0] if text else type(err).__name__
    if len(first) > 240:
        first = first[:237] + "..."
    return f"a peer rank is dead or frozen (collective failed: {first})"


def exit_process(code: int) -> NoReturn:
    """End the process with ``code`` without interpreter finalization.

    A gloo worker thread drops the tensors of a finished collective after the caller has
    returned from it, and dropping a tensor that has a Python object takes the GIL. Once
    the interpreter is finalizing, a thread asking for the GIL is ended with
    ``pthread_exit``, whose unwind through gloo's C++ frames aborts the whole process
    (SIGABRT, "terminate called without an active exception"; seen on a 2-rank serve
    under load, core dump: ``ProcessGroupGloo::runLoop`` -> ``~AsyncWork`` ->
    ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``). ``destroy_process_group``
    does not join those threads. Call this only after everything the process owns is
    closed (cache, output files, process group): it flushes logging and the standard
    streams and leaves with ``os._exit``."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def interruptible(main: Callable[[], int], prog: str) -> int:
    """``main()``, with Ctrl-C as one line (rank 0) and exit code 130, no traceback."""
    try:
        return main()
    except KeyboardInterrupt:
        if launch_rank() == 0:
            print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def launch_rank() -> int:
    """This process's rank in a torchrun launch (0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


def launch_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_mesh(
    pp: int,
    cp: int,
    tp: int,
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    config: Mapping[str, str] | None = None,
) -> MeshTopology:
    """Initialize the process group (NCCL on CUDA, else gloo) and return the topology.

    Without torchrun's environment this starts a one-rank group in memory. Raises
    ``LaunchError`` when ``pp * cp * tp`` differs from the number of launched ranks,
    ``timeout_s`` is not positive, or the ranks' ``config`` (``runtime.mesh_config``'s
    flags and inputs that change the work) differ: that is compared through the
    launch's store before the process group exists, so no collective runs on a mesh
    whose ranks disagree. A collective of any group created afterwards in this process
    fails within ``timeout_s`` when a peer is dead or frozen (module docstring).
    """
    for name, value in (("pp", pp), ("cp", cp), ("tp", tp)):
        if value < 1:
            raise LaunchError(f"--{name} must be >= 1, got {value}")
    check_collective_timeout(timeout_s)
    world = launch_world_size()
    if pp * cp * tp != world:
        raise LaunchError(
            f"--pp {pp} x --cp {cp} x --tp {tp} = {pp * cp * tp} ranks, but {world} were "
            f"launched; use torchrun --nproc-per-node {pp * cp * tp}",
            everywhere=True,
        )
    use_cuda = torch.cuda.is_available()
    device_type = "cuda" if use_cuda else "cpu"
    # On CUDA, CPU tensors (host-pool DTensors, background agreements) still need gloo.
    backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # gloo notices a silent peer one or two of its timeouts after the wait began (measured
    # with a SIGSTOPped rank: 1.0x or 2.0x, never more), so 0.45 of the bound keeps every
    # rank within ``timeout_s``, with a tenth of it left for printing and exiting.
    timeout = timedelta(seconds=timeout_s * 0.45)
    # Groups created without an explicit timeout (device-mesh sub-groups, the cache's
    # agreement groups) take torch's module default, 30 min: bound them too. This is the
    # one place that sets process-wide distributed state.
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout
    if not dist.is_initialized():
        if "RANK" in os.environ:
            _join_world(backend, timeout, dict(config or {}))
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    names = tuple(a.value for a in AXIS_ORDER)
    mesh = init_device_mesh(device_type, (pp, cp, tp), mesh_dim_names=names)
    return MeshTopology.from_mesh(mesh)


def _join_world(backend: str, timeout: timedelta, config: dict[str, str]) -> None:
    """The default group of an env:// launch (torchrun), once every rank arrived and
    the ranks' ``config`` agree: each waits up to ``STARTUP_TIMEOUT_S`` for the others,
    then the group's collectives get ``timeout``. (Joining with ``timeout`` alone failed
    a rank whose peer was still importing on a loaded machine: gloo's connect waits that
    long for the peer.)"""
    startup = timedelta(seconds=STARTUP_TIMEOUT_S)
    store, rank, world = next(dist.rendezvous("env://", timeout=startup))
    store.set_timeout(startup)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"mesh_hicache/{attempt}"
    store.set(f"{prefix}/config/{rank}", json.dumps(config, sort_keys=True))
    keys = [f"{prefix}/arrived/{r}" for r in range(world)]
    store.set(keys[rank], "1")
    store.wait(keys)  # a DistStoreError naming the missing ranks after ``startup``
    configs = [json.loads(store.get(f"{prefix}/config/{r}")) for r in range(world)]
    # Every rank has read every config before any leaves (rank 0 may host the store),
    # and rank 0 leaves only once every rank is past that wait: a rank still waiting on a
    # store that closed fails with a connection error instead of the disagreement.
    checked = [f"{prefix}/checked/{r}" for r in range(world)]
    store.set(checked[rank], "1")
    store.wait(checked)
    passed = [f"{prefix}/passed/{r}" for r in range(world)]
    store.set(passed[rank], "1")
    if rank == 0:
        store.wait(passed)
    difference = first_difference(configs)
    if difference is not None:
        raise LaunchError(difference, everywhere=True)
    store.set_timeout(timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("default_pg", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runtime.launch", description=__doc__.splitlines()[0])
    add_mesh_args(parser)
    args = parser.parse_args(argv)
    try:
        topo = init_mesh(args.pp, args.cp, args.tp, args.collective_timeout_s)
    except LaunchError as err:
        print(f"runtime.launch: error: {err}", file=sys.stderr)
        return 2
    pp, cp, tp = topo.coords
    print(
        f"rank {dist.get_rank()}/{topo.num_ranks} device={topo.device_type} "
        f"(pp, cp, tp) = ({pp}, {cp}, {tp}) of {topo.shape}",
        flush=True,
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())
