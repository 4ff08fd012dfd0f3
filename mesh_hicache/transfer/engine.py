"""The transfer engine interface and its contract (DESIGN.md section 6).

An operation copies a set of pages and Mamba slots between this rank's L1 device pools
and L2 host pools: ``backup`` device -> host, ``load`` host -> device. ``kv_pages`` is a
pair ``(device_pages, host_pages)`` of equal-length index lists; page ``device_pages[i]``
corresponds to ``host_pages[i]`` in every paged region (``kv`` and ``indexer``).
``mamba_slots`` is a pair ``(device_slots, host_slots)`` for ``mamba_conv`` and
``mamba_ssm``. Bad indices (unequal lengths, out of range) raise ``ValueError`` at
submission, before anything is queued.

Contract:

- Operations run in submission order, one at a time, on a worker; copies go layer by
  layer in increasing global layer id, and within a layer are batched per region (all of
  the operation's pages at once through a preallocated staging buffer; never per token).
- ``handle.wait_layer(layer_id)`` (a global layer id held by this rank) blocks until that
  layer's data of the operation is in place and returns True; it returns False (never
  hangs) once the operation failed before finishing that layer. ``handle.wait()`` blocks
  until the operation finished and returns ``ok``.
- Every operation completes exactly once: its ack (``TransferAck``) is returned by exactly
  one ``poll()``, in completion order, and its ``on_done`` callback (if any) is called
  exactly once, on the worker thread, before the ack becomes visible to ``poll``. A
  failing operation (an exception while copying) acks ``ok=False`` with the error text;
  the engine keeps serving later operations.
- The engine never allocates or frees the caller's pool indices: the controller reserved
  them and frees them after cross-rank agreement on the acks. Staging memory is the
  engine's own and preallocated.
- ``close()`` stops the worker: queued operations ack ``ok=False`` ("engine closed"), the
  one running finishes; later submissions raise ``RuntimeError``.
- ``fail_next(at_layer)`` (tests only) makes the next submitted operation raise before it
  copies ``at_layer`` (or its first layer when ``None``).
"""

from __future__ import annotations

import abc
import collections
import enum
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mesh_hicache.layout import RegionName
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools
from mesh_hicache.spec import Family

_log = logging.getLogger(__name__)

IndexList = Sequence[int] | torch.Tensor
IndexPair = tuple[IndexList, IndexList]


class TransferKind(str, enum.Enum):
    BACKUP = "backup"
    """device -> host"""
    LOAD = "load"
    """host -> device"""


@dataclass(frozen=True, slots=True)
class TransferAck:
    """The completion record of one operation (returned by exactly one ``poll``)."""

    op_id: int
    kind: TransferKind
    ok: bool
    error: str | None = None


class TransferHandle:
    """Completion and per-layer readiness of one operation. Thread-safe."""

    def __init__(self, op_id: int, kind: TransferKind, layer_ids: Sequence[int]) -> None:
        self.op_id = op_id
        self.kind = kind
        self.layer_ids = tuple(layer_ids)
        self._cond = threading.Condition()
        self._layers_done = 0  # layers [0, _layers_done) of layer_ids are in place
        self._finished = False
        self._ok = False
        self.error: str | None = None

    # worker side
    def _mark_layers(self, count: int) -> None:
        with self._cond:
            self._layers_done = max(self._layers_done, count)
            self._cond.notify_all()

    def _finish(self, ok: bool, error: str | None) -> None:
        with self._cond:
            assert not self._finished, "an operation finished twice"
            if ok:
                self._layers_done = len(self.layer_ids)
            self._ok, self.error, self._finished = ok, error, True
            self._cond.notify_all()

    # consumer side
    def wait_layer(self, layer_id: int, timeout: float | None = None) -> bool:
        """Block until ``layer_id``'s data is in place (True) or the op failed first (False).

        ``ValueError`` if this rank holds no state of ``layer_id``. ``timeout`` seconds
        elapsed without either also returns False.
        """
        try:
            pos = self.layer_ids.index(layer_id)
        except ValueError:
            raise ValueError(
                f"layer {layer_id} is not one of this rank's layers {self.layer_ids}"
            ) from None
        with self._cond:
            self._cond.wait_for(lambda: self._layers_done > pos or self._finished, timeout)
            return self._layers_done > pos

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation finished; return ``ok`` (False on timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished, timeout)
            return self._finished and self._ok

    @property
    def done(self) -> bool:
        return self._finished

    @property
    def ok(self) -> bool:
        """True once finished successfully; False while running or after a failure."""
        return self._finished and self._ok

    def __repr__(self) -> str:
        state = "running" if not self._finished else ("ok" if self._ok else "failed")
        return f"TransferHandle(op={self.op_id}, {self.kind.value}, {state})"


class InjectedFailure(RuntimeError):
    """Raised inside an operation by :meth:`TransferEngine.fail_next`."""


@dataclass(slots=True)
class _Op:
    handle: TransferHandle
    kv_pages: tuple[torch.Tensor, torch.Tensor]
    mamba_slots: tuple[torch.Tensor, torch.Tensor]
    on_done: Callable[[TransferAck], None] | None
    fail_at: int | None = None
    inject: bool = False


@dataclass(frozen=True, slots=True)
class CopyJob:
    """Copy rows ``src[src_idx[i]] -> dst[dst_idx[i]]`` (dim 0 indexed; rows contiguous)."""

    src: torch.Tensor
    src_idx: torch.Tensor
    dst: torch.Tensor
    dst_idx: torch.Tensor


class TransferEngine(abc.ABC):
    """Moves pages and slots between ``device_pools`` and ``host_pools`` (see module doc).

    Subclasses implement :meth:`_run_layers`; this class owns the queue, the worker
    thread, op ids, acks, callbacks and failure injection.
    """

    kind: str = "abstract"

    def __init__(self, device_pools: DevicePools, host_pools: HostPools) -> None:
        if device_pools.layout is not host_pools.layout:
            dl, hl = device_pools.layout, host_pools.layout
            if (dl.spec, dl.shape, dl.coords, dl.cp_kv) != (hl.spec, hl.shape, hl.coords, hl.cp_kv):
                raise ValueError("device and host pools were built from different layouts")
        self.device_pools = device_pools
        self.host_pools = host_pools
        layout = device_pools.layout
        ids: set[int] = set()
        for fam in (Family.KV, Family.MAMBA):
            ids.update(layout.family_layers(fam))
        #: This rank's layers in copy order (every family, increasing global id).
        self.layer_ids: tuple[int, ...] = tuple(sorted(ids))
        self._queue: queue.Queue[_Op | None] = queue.Queue()
        self._acks: collections.deque[TransferAck] = collections.deque()
        self._acks_lock = threading.Lock()
        self._next_id = 0
        self._submit_lock = threading.Lock()
        self._fail_at: int | None = None
        self._fail_armed = False
        self._closed = False
        self._worker = threading.Thread(
            target=self._loop, name=f"transfer-{self.kind}", daemon=True
        )
        self._worker_started = False

    # -- public API -------------------------------------------------------------------------

    def backup(
        self,
        kv_pages: IndexPair = ((), ()),
        mamba_slots: IndexPair = ((), ()),
        on_done: Callable[[TransferAck], None] | None = None,
    ) -> TransferHandle:
        """Queue device -> host copies of ``kv_pages`` and ``mamba_slots``."""
        return self._submit(TransferKind.BACKUP, kv_pages, mamba_slots, on_done)

    def load(
        self,
        kv_pages: IndexPair = ((), ()),
        mamba_slots: IndexPair = ((), ()),
        on_done: Callable[[TransferAck], None] | None = None,
    ) -> TransferHandle:
        """Queue host -> device copies, layer by layer (use ``handle.wait_layer``)."""
        return self._submit(TransferKind.LOAD, kv_pages, mamba_slots, on_done)

    def poll(self) -> list[TransferAck]:
        """Acks of operations finished since the last poll, in completion order."""
        with self._acks_lock:
            out = list(self._acks)
            self._acks.clear()
        return out

    def fail_next(self, at_layer: int | None = None) -> None:
        """Tests only: the next submitted operation fails before copying ``at_layer``."""
        if at_layer is not None and at_layer not in self.layer_ids:
            raise ValueError(f"at_layer={at_layer} is not one of {self.layer_ids}")
        with self._submit_lock:
            self._fail_at, self._fail_armed = at_layer, True

    def close(self) -> None:
        """Stop the worker; queued operations ack as failed. Idempotent."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        if self._worker_started:
            self._worker.join()
        else:
            self._drain_closed()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- subclass hooks ---------------------------------------------------------------------

    @abc.abstractmethod
    def _run_layers(
        self, kind: TransferKind, plan: list[tuple[int, list[CopyJob]]], op: _Op
    ) -> None:
        """Run ``plan`` (per layer, its copy jobs) in order; call ``_layer_ready`` per layer.

        Call ``self._check_fault(op, layer_id)`` before each layer's copies. Raise on error.
        """

    def _index_device(self) -> torch.device:
        return self.device_pools.device

    # -- internals --------------------------------------------------------------------------

    def _submit(
        self,
        kind: TransferKind,
        kv_pages: IndexPair,
        mamba_slots: IndexPair,
        on_done: Callable[[TransferAck], None] | None,
    ) -> TransferHandle:
        dev, host = self.device_pools, self.host_pools
        kv = self._indices("kv_pages", kv_pages, dev.num_pages, host.num_pages)
        mb = self._indices("mamba_slots", mamba_slots, dev.num_slots, host.num_slots)
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("transfer engine is closed")
            handle = TransferHandle(self._next_id, kind, self.layer_ids)
            self._next_id += 1
            op = _Op(handle, kv, mb, on_done)
            if self._fail_armed:
                op.inject, op.fail_at = True, self._fail_at
                self._fail_armed, self._fail_at = False, None
            if not self._worker_started:
                self._worker.start()
                self._worker_started = True
            self._queue.put(op)
        return handle

    def _indices(
        self, what: str, pair: IndexPair, dev_count: int, host_count: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(pair) != 2:
            raise ValueError(f"{what} must be a pair (device indices, host indices)")
        d = torch.as_tensor(pair[0], dtype=torch.int64).flatten().cpu()
        h = torch.as_tensor(pair[1], dtype=torch.int64).flatten().cpu()
        if d.numel() != h.numel():
            raise ValueError(f"{what}: {d.numel()} device vs {h.numel()} host indices")
        for name, idx, count in (("device", d, dev_count), ("host", h, host_count)):
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= count):
                raise ValueError(f"{what}: {name} index out of range [0, {count}): {idx.tolist()}")
        return d.to(self._index_device()), h

    def _plan(self, op: _Op) -> list[tuple[int, list[CopyJob]]]:
        """Per layer (copy order), the copy jobs of ``op`` in its direction."""
        dev, host, layout = self.device_pools, self.host_pools, self.device_pools.layout
        (kd, kh), (md, mh) = op.kv_pages, op.mamba_slots
        backup = op.handle.kind is TransferKind.BACKUP
        plan: list[tuple[int, list[CopyJob]]] = []
        for layer in self.layer_ids:
            pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
            family = layout.spec.layer_family(layer)
            if family is Family.KV and kd.numel():
                kv = host.local(RegionName.KV)[:, host.region(RegionName.KV).layer_row(layer)]
                pairs.append((dev.k(layer), kd, kv[:, 0], kh))
                pairs.append((dev.v(layer), kd, kv[:, 1], kh))
                if layer in dev.layers(Family.INDEXER):
                    row = host.region(RegionName.INDEXER).layer_row(layer)
                    pairs.append(
                        (dev.indexer(layer), kd, host.local(RegionName.INDEXER)[:, row], kh)
                    )
            if family is Family.MAMBA and md.numel():
                row = host.region(RegionName.MAMBA_CONV).layer_row(layer)
                pairs.append((dev.conv(layer), md, host.local(RegionName.MAMBA_CONV)[:, row], mh))
                pairs.append((dev.ssm(layer), md, host.local(RegionName.MAMBA_SSM)[:, row], mh))
            jobs = [
                CopyJob(d, di, h, hi) if backup else CopyJob(h, hi, d, di) for d, di, h, hi in pairs
            ]
            plan.append((layer, jobs))
        return plan

    def _check_fault(self, op: _Op, layer: int) -> None:
        if op.inject and (op.fail_at is None or op.fail_at == layer):
            raise InjectedFailure(f"injected failure before layer {layer} of op {op.handle.op_id}")

    def _layer_ready(self, op: _Op, position: int) -> None:
        """Layers ``[0, position]`` of ``self.layer_ids`` are in place for ``op``."""
        op.handle._mark_layers(position + 1)

    def _loop(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                self._drain_closed()
                return
            if self._closed:
                # close() was called while this op waited: ack it failed, do not copy.
                self._complete(op, False, "engine closed")
            else:
                self._execute(op)

    def _drain_closed(self) -> None:
        while True:
            try:
                op = self._queue.get_nowait()
            except queue.Empty:
                return
            if op is not None:
                self._complete(op, False, "engine closed")

    def _execute(self, op: _Op) -> None:
        try:
            self._run_layers(op.handle.kind, self._plan(op), op)
        except Exception as exc:  # an op failure must never kill the worker
            self._complete(op, False, f"{type(exc).__name__}: {exc}")
        else:
            self._complete(op, True, None)

    def _complete(self, op: _Op, ok: bool, error: str | None) -> None:
        ack = TransferAck(op.handle.op_id, op.handle.kind, ok, error)
        op.handle._finish(ok, error)
        if op.on_done is not None:
            try:
                op.on_done(ack)
            except Exception:  # a bad callback must not break the ack stream
                _log.exception("on_done callback of transfer op %d raised", op.handle.op_id)
        with self._acks_lock:
            self._acks.append(ack)
