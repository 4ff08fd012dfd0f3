"""torchrun entry point: process group and mesh from ``--pp/--cp/--tp``.

This is the only module that reads the launcher's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``); everything below it gets its identity from the
``MeshTopology`` built here.

    torchrun --nproc-per-node 8 -m runtime.launch --pp 2 --cp 2 --tp 2
    python -m runtime.launch            # one rank, no torchrun needed
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mesh_hicache.topology import AXIS_ORDER, MeshTopology


class LaunchError(ValueError):
    """The launch configuration cannot work (printed without a traceback)."""


def add_mesh_args(parser: argparse.ArgumentParser) -> None:
    for axis in AXIS_ORDER:
        parser.add_argument(
            f"--{axis.value}",
            type=int,
            default=1,
            metavar="N",
            help=f"mesh size of the {axis.value} axis",
        )


def launch_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_mesh(pp: int, cp: int, tp: int, timeout_s: float = 300.0) -> MeshTopology:
    """Initialize the process group (NCCL on CUDA, else gloo) and return the topology.

    Without torchrun's environment this starts a one-rank group in memory. Raises
    ``LaunchError`` when ``pp * cp * tp`` differs from the number of launched ranks.
    """
    for name, value in (("pp", pp), ("cp", cp), ("tp", tp)):
        if value < 1:
            raise LaunchError(f"--{name} must be >= 1, got {value}")
    world = launch_world_size()
    if pp * cp * tp != world:
        raise LaunchError(
            f"--pp {pp} x --cp {cp} x --tp {tp} = {pp * cp * tp} ranks, but {world} were "
            f"launched; use torchrun --nproc-per-node {pp * cp * tp}"
        )
    use_cuda = torch.cuda.is_available()
    device_type = "cuda" if use_cuda else "cpu"
    # On CUDA, CPU tensors (host-pool DTensors, background agreements) still need gloo.
    backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    names = tuple(a.value for a in AXIS_ORDER)
    mesh = init_device_mesh(device_type, (pp, cp, tp), mesh_dim_names=names)
    return MeshTopology.from_mesh(mesh)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runtime.launch", description=__doc__.splitlines()[0])
    add_mesh_args(parser)
    args = parser.parse_args(argv)
    try:
        topo = init_mesh(args.pp, args.cp, args.tp)
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
    sys.exit(main())
