"""MeshTopology: the only source of rank identity (docs/DESIGN.md section 3).

Every component below ``runtime/launch.py`` learns who it is from a ``MeshTopology``:
coordinates on named axes, axis sizes, sub-meshes and process groups. No component
reads ``RANK``/``WORLD_SIZE`` or asks the default group for its rank.

The topology always holds a full 3D mesh named ``("pp", "cp", "tp")``. A 1D or 2D input
mesh is re-shaped into it with the missing axes of size 1, so that every axis can be
asked for without special cases. Building the 3D mesh (and any process group) is a
collective: every rank of the job must construct the topology in the same order.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


class MeshAxis(str, enum.Enum):
    """Names of the mesh axes, outermost first."""

    PP = "pp"
    CP = "cp"
    TP = "tp"


AXIS_ORDER: tuple[MeshAxis, ...] = (MeshAxis.PP, MeshAxis.CP, MeshAxis.TP)
#: Axes of the cache group: the ranks of one pp stage, which hold the same tree and slots.
CACHE_AXES: tuple[MeshAxis, ...] = (MeshAxis.CP, MeshAxis.TP)

AxisLike = MeshAxis | str


def as_axis(axis: AxisLike) -> MeshAxis:
    """Return ``axis`` as a :class:`MeshAxis`; ``ValueError`` for an unknown name."""
    try:
        return MeshAxis(axis)
    except ValueError:
        valid = [a.value for a in AXIS_ORDER]
        raise ValueError(f"unknown mesh axis {axis!r}; valid axes are {valid}") from None


def _check_dim_names(names: Sequence[str] | None, mesh: DeviceMesh) -> tuple[MeshAxis, ...]:
    valid = [a.value for a in AXIS_ORDER]
    if not names:
        raise ValueError(f"mesh {mesh} has no mesh_dim_names; name its dims from {valid}")
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(
            f"mesh dim names {tuple(names)} contain unknown {unknown}; allowed {valid}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"mesh dim names {tuple(names)} contain duplicates; allowed {valid}")
    order = [valid.index(n) for n in names]
    if order != sorted(order):
        raise ValueError(
            f"mesh dim names {tuple(names)} are out of order; they must follow {tuple(valid)}"
        )
    return tuple(MeshAxis(n) for n in names)


class MeshTopology:
    """A ``pp x cp x tp`` view of a DeviceMesh.

    Construct with :meth:`from_mesh`. Collective: all ranks of the job call it together.
    Attributes never change after construction; sub-meshes and groups are created once
    and cached, so ``topo.submesh("cp", "tp") is topo.submesh("cp", "tp")``.
    """

    def __init__(self, mesh3d: DeviceMesh, source: DeviceMesh) -> None:
        assert mesh3d.mesh_dim_names == tuple(a.value for a in AXIS_ORDER)
        self._mesh = mesh3d
        self._source = source
        coordinate = mesh3d.get_coordinate()
        assert coordinate is not None, "this rank is not part of the mesh"
        self._coord = dict(zip(AXIS_ORDER, coordinate, strict=True))
        self._size = dict(zip(AXIS_ORDER, mesh3d.shape, strict=True))
        self._submeshes: dict[tuple[MeshAxis, ...], DeviceMesh] = {}
        self._groups: dict[tuple[tuple[MeshAxis, ...], str | None], dist.ProcessGroup] = {}

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, group: dist.ProcessGroup | None = None) -> MeshTopology:
        """Build the topology of ``mesh`` (1D, 2D or 3D, dims an ordered subset of pp/cp/tp).

        ``group`` is the process group the mesh must cover exactly (default: the world).
        Raises ``ValueError`` naming the mesh for unknown, duplicate or misordered dim
        names, or a mesh whose size differs from the group's.
        """
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"expected a torch DeviceMesh, got {type(mesh).__name__}")
        if not 1 <= mesh.ndim <= 3:
            raise ValueError(f"mesh {mesh} has {mesh.ndim} dims; expected 1 to 3")
        axes = _check_dim_names(mesh.mesh_dim_names, mesh)
        group_size = dist.get_world_size(group if group is not None else dist.group.WORLD)
        if mesh.size() != group_size:
            raise ValueError(
                f"mesh {mesh} has {mesh.size()} ranks but the process group has {group_size}"
            )
        sizes = dict(zip(axes, mesh.shape, strict=True))
        shape = tuple(sizes.get(a, 1) for a in AXIS_ORDER)
        names = tuple(a.value for a in AXIS_ORDER)
        if axes == AXIS_ORDER:
            mesh3d = mesh
        else:
            mesh3d = DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape), mesh_dim_names=names)
        return cls(mesh3d, mesh)

    # -- identity ---------------------------------------------------------------------------

    @property
    def mesh(self) -> DeviceMesh:
        """The full 3D mesh named ``("pp", "cp", "tp")``."""
        return self._mesh

    @property
    def device_type(self) -> str:
        return self._mesh.device_type

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(pp, cp, tp)`` sizes."""
        pp, cp, tp = (self._size[a] for a in AXIS_ORDER)
        return pp, cp, tp

    @property
    def coords(self) -> tuple[int, int, int]:
        """This rank's ``(pp, cp, tp)`` coordinate."""
        pp, cp, tp = (self._coord[a] for a in AXIS_ORDER)
        return pp, cp, tp

    def coord(self, axis: AxisLike) -> int:
        """This rank's coordinate on ``axis`` (0 on an axis the input mesh lacked)."""
        return self._coord[as_axis(axis)]

    def size(self, axis: AxisLike) -> int:
        """Size of ``axis`` (1 for an axis the input mesh lacked)."""
        return self._size[as_axis(axis)]

    @property
    def num_ranks(self) -> int:
        return self._mesh.size()

    @property
    def is_cache_leader(self) -> bool:
        """True on the rank with coordinate 0 on cp and tp (one per pp stage)."""
        return all(self._coord[a] == 0 for a in CACHE_AXES)

    def describe(self) -> str:
        """A short human-readable coordinate, e.g. ``pp0/cp1/tp0``."""
        return "/".join(f"{a.value}{self._coord[a]}" for a in AXIS_ORDER)

    # -- sub-meshes and groups --------------------------------------------------------------

    def submesh(self, *axes: AxisLike) -> DeviceMesh:
        """The sub-mesh over ``axes`` (in pp/cp/tp order) that contains this rank. Cached."""
        key = self._normalize_axes(axes)
        if key not in self._submeshes:
            self._submeshes[key] = self._mesh[tuple(a.value for a in key)]
        return self._submeshes[key]

    def ranks_of(self, *axes: AxisLike) -> list[int]:
        """Global ranks of this rank's sub-mesh over ``axes``, in mesh order."""
        return self._all_subgroup_ranks(self._normalize_axes(axes))[self._subgroup_index(axes)]

    def group(self, *axes: AxisLike, backend: str | None = None) -> dist.ProcessGroup:
        """The process group of this rank's sub-mesh over ``axes``. Cached per (axes, backend).

        ``backend=None`` uses the job's backend (NCCL on CUDA, gloo on CPU). A cached
        group is shared by every caller, so a background thread needs its own from
        :meth:`new_group`. Collective on first use: every rank must ask for the same
        groups in the same order.
        """
        key = (self._normalize_axes(axes), backend)
        if key not in self._groups:
            self._groups[key] = self.new_group(*axes, backend=backend)
        return self._groups[key]

    def new_group(
        self, *axes: AxisLike, backend: str | None = None, timeout: timedelta | None = None
    ) -> dist.ProcessGroup:
        """Create a fresh, uncached process group over ``axes`` (collective on all ranks).

        Use one per background thread (``backend="gloo"``) so that its collectives never
        interleave with those of the main thread. ``timeout``: its collectives' bound
        (None: the process group default).
        """
        norm = self._normalize_axes(axes)
        all_ranks = self._all_subgroup_ranks(norm)
        mine, _ = dist.new_subgroups_by_enumeration(all_ranks, backend=backend, timeout=timeout)
        assert mine is not None
        return mine

    @property
    def cache_group(self) -> dist.ProcessGroup:
        """The ``cp x tp`` group of this pp stage: ranks that hold identical trees and slots."""
        return self.group(*CACHE_AXES)

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The group of this rank's pipeline (same cp and tp coordinates, every stage)."""
        return self.group(MeshAxis.PP)

    # -- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _normalize_axes(axes: Iterable[AxisLike]) -> tuple[MeshAxis, ...]:
        parsed = [as_axis(a) for a in axes]
        if not parsed:
            raise ValueError("expected at least one mesh axis")
        if len(set(parsed)) != len(parsed):
            raise ValueError(f"duplicate axes in {[a.value for a in parsed]}")
        return tuple(sorted(parsed, key=AXIS_ORDER.index))

    def _all_subgroup_ranks(self, axes: tuple[MeshAxis, ...]) -> list[list[int]]:
        """Every sub-mesh over ``axes`` as a list of global ranks, in a fixed order."""
        grid: torch.Tensor = self._mesh.mesh
        kept = [AXIS_ORDER.index(a) for a in axes]
        other = [i for i in range(3) if i not in kept]
        perm = grid.permute(*other, *kept).reshape(-1, *[grid.shape[i] for i in kept])
        return [block.flatten().tolist() for block in perm]

    def _subgroup_index(self, axes: Iterable[AxisLike]) -> int:
        norm = self._normalize_axes(axes)
        other = [a for a in AXIS_ORDER if a not in norm]
        sizes = [self._size[a] for a in other]
        coords = [self._coord[a] for a in other]
        index = 0
        for size, c in zip(sizes, coords, strict=True):
            index = index * size + c
        return index

    def __repr__(self) -> str:
        pp, cp, tp = self.shape
        return f"MeshTopology(pp={pp}, cp={cp}, tp={tp}, rank={self.describe()})"


def all_coordinates(shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Every coordinate of a mesh of ``shape`` in row-major (rank) order."""
    return list(itertools.product(*(range(s) for s in shape)))
