"""The transfer engine interface and its contract (docs/DESIGN.md section 6).

An operation copies a set of pages, window pages and Mamba slots between this rank's L1
device pools and L2 host pools: ``backup`` device -> host, ``load`` host -> device. Each
is a pair of equal-length index lists, one per index kind
(:class:`~mesh_hicache.transfer.segments.IndexKind`):

- ``kv_pages`` ``(device_pages, host_pages)``: page ``device_pages[i]`` corresponds to
  ``host_pages[i]`` in ``kv`` and ``indexer``;
- ``window_pages`` ``(device_pages, host_window_ids)``: the sliding-window layers' K/V
  (region ``kv_window``), which the host pool indexes by window ids of their own (L2
  holds only the windowed pages a resume needs) while the device pool indexes it by page;
- ``mamba_slots`` ``(device_slots, host_slots)``: ``mamba_conv`` and ``mamba_ssm``.

Bad indices (unequal lengths, out of range of the device pages/slots or the host pages,
window ids or slots) raise ``ValueError`` at submission, before anything is queued.

Contract:

- Operations run in submission order on one worker thread; copies go layer by layer in
  increasing global layer id. Pointers and strides of every (layer, part) are computed
  once at construction (:mod:`mesh_hicache.transfer.segments`); an operation's row
  addresses are computed in bulk and its rows copied in as few native calls as the
  index pattern allows (never per token). The worker takes every queued operation at
  each wake-up and runs them back to back; it wakes at most ``wake_grace`` after a
  submission (``waker.py``), not at once. A thread that calls ``wait``/``wait_layer``
  while no one is copying runs the queued copies itself (in the same order, up to what
  it waits for) instead of waiting for the worker to be scheduled: one copying thread at
  a time, so the order and every guarantee below are the same whoever copies.
- ``handle.wait_layer(layer_id)`` (a global layer id held by this rank) blocks until that
  layer's data of the operation is in place and returns True; it returns False (never
  hangs) once the operation failed before finishing that layer. ``handle.wait()`` blocks
  until the operation finished and returns ``ok``.
- Every operation completes exactly once, on success or failure: its handle finishes
  once and then carries the ack (``handle.ack``, a :class:`TransferAck`). A failing
  operation (an exception while copying) acks ``ok=False`` with the error text; the
  engine keeps serving later operations. The handle is the only completion record: the
  engine keeps nothing of a finished operation, so nothing grows when no one looks.
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
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mesh_hicache.pools.device import DevicePools
from mesh_hicache.pools.host import HostPools
from mesh_hicache.spec import Family
from mesh_hicache.transfer.indices import NO_INDICES, IndexPair, check_indices
from mesh_hicache.transfer.segments import IndexArray, SegmentTable, build_segments
from mesh_hicache.transfer.waker import CondWaker, TimerWaker, make_waker

#: The default of every index pair: nothing of that kind. Without windowed layers no
#: window pair is passed; testing for this object skips its checks (no cost then).
NO_PAIR: IndexPair = ((), ())


class TransferKind(str, enum.Enum):
    BACKUP = "backup"
    """device -> host"""
    LOAD = "load"
    """host -> device"""


@dataclass(frozen=True, slots=True)
class TransferAck:
    """The completion record of one operation (``handle.ack`` once it finished)."""

    op_id: int
    kind: TransferKind
    ok: bool
    error: str | None = None


class TransferHandle:
    """Completion and per-layer readiness of one operation. Thread-safe."""

    def __init__(
        self,
        op_id: int,
        kind: TransferKind,
        layer_ids: tuple[int, ...],
        engine: TransferEngine | None = None,
    ) -> None:
        self.op_id = op_id
        self.kind = kind
        self.layer_ids = layer_ids
        self._engine = engine  # runs queued copies on the waiting thread when idle
        self._cond = threading.Condition()
        # Layers [0, _layers_done) of layer_ids are in place. The worker publishes a layer
        # with a plain store and takes the lock only when someone waits for a layer
        # (_layer_waiters > 0): a waiter registers under the lock BEFORE testing, the
        # worker stores BEFORE reading the count, so one of them always sees the other.
        # wait() does not register there, so it is woken once, at the finish.
        self._layers_done = 0
        self._layer_waiters = 0
        self._finished = False
        self._ok = False
        self._ack: TransferAck | None = None

    # copier side (the store of _layers_done itself is in TransferEngine._layer_ready)
    def _notify_layers(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _finish(self, ok: bool, error: str | None) -> TransferAck:
        with self._cond:
            assert not self._finished, "an operation finished twice"
            if ok:
                self._layers_done = len(self.layer_ids)
            self._ok = ok
            self._ack = TransferAck(self.op_id, self.kind, ok, error)
            self._finished = True  # last: readers without the lock test it first
            self._cond.notify_all()
        return self._ack

    def _wait_layer(self, pos: int, timeout: float | None) -> None:
        with self._cond:
            self._layer_waiters += 1
            try:
                self._cond.wait_for(lambda: self._layers_done > pos or self._finished, timeout)
            finally:
                self._layer_waiters -= 1

    # consumer side
    def wait_layer(self, layer_id: int, timeout: float | None = None) -> bool:
        """Block until ``layer_id``'s data is in place (True) or the op failed first (False).

        ``ValueError`` if this rank holds no state of ``layer_id``. ``timeout`` seconds
        elapsed without either also returns False. When no one is copying, the calling
        thread copies the queued work up to this layer itself first (``timeout`` then
        bounds only the wait that may follow).
        """
        try:
            pos = self.layer_ids.index(layer_id)
        except ValueError:
            raise ValueError(
                f"layer {layer_id} is not one of this rank's layers {self.layer_ids}"
            ) from None
        if self._layers_done <= pos and not self._finished:
            if self._engine is not None:
                self._engine._help(self, pos)
            if self._layers_done <= pos and not self._finished:
                self._wait_layer(pos, timeout)
        return self._layers_done > pos

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation finished; return ``ok`` (False on timeout).

        Like :meth:`wait_layer`, copies the queued work itself when no one is copying.
        """
        if not self._finished and self._engine is not None:
            self._engine._help(self, len(self.layer_ids))
        if not self._finished:
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

    @property
    def ack(self) -> TransferAck | None:
        """The operation's ack once it finished (exactly one per operation), else None."""
        return self._ack if self._finished else None

    @property
    def error(self) -> str | None:
        """The failure text of a failed operation, else None."""
        ack = self.ack
        return None if ack is None else ack.error

    def __repr__(self) -> str:
        state = "running" if not self._finished else ("ok" if self._ok else "failed")
        return f"TransferHandle(op={self.op_id}, {self.kind.value}, {state})"


class InjectedFailure(RuntimeError):
    """Raised inside an operation by :meth:`TransferEngine.fail_next`."""


@dataclass(slots=True)
class _Op:
    handle: TransferHandle
    pairs: tuple[
        tuple[IndexArray, IndexArray],
        tuple[IndexArray, IndexArray],
        tuple[IndexArray, IndexArray],
    ]
    """(device, host) indices of each ``IndexKind`` (pages, slots, windows), int64,
    validated: each pair views one block, device indices then host indices, at address
    ``addrs[kind]`` (0 when empty)."""
    addrs: tuple[int, int, int] = (0, 0, 0)
    """Addresses of the page, slot and window index blocks (for the native copy loop)."""
    load_bytes: int = 0
    """Bytes a load moves (``SegmentTable.op_bytes``, computed once at submission); 0
    for a backup."""
    fail_at: int | None = None
    inject: bool = False
    steps: Iterator[None] | None = None
    """The running copy (``TransferEngine._steps``); None until it starts."""
    after: Any = None
    """What the copy must wait for (the CUDA engine: an event on the submitter's stream)."""

    @property
    def backup(self) -> bool:
        return self.handle.kind is TransferKind.BACKUP


class TransferEngine(abc.ABC):
    """Moves pages and slots between ``device_pools`` and ``host_pools`` (see module doc).

    Subclasses implement :meth:`_run`; this class owns the queue, the worker thread, op
    ids, completion and failure injection.
    """

    kind: str = "abstract"
    #: A load of at most this many bytes submitted while the engine is idle (nothing
    #: queued, no one copying) is copied by the submitting thread before ``load`` returns:
    #: cheaper than handing it to the worker (a thread wake-up costs more than copying
    #: it), and its caller waits for it anyway. Backups always go to the worker (their
    #: callers poll them later and go on meanwhile). 0: never (the CUDA engine: its
    #: copies are queued on a stream anyway).
    inline_bytes: int = 0
    #: Seconds a submission may defer the worker's wake-up (``waker.py``): a caller that
    #: waits sooner copies the queued work itself, with no thread hand-off, and the
    #: worker wakes at most once per this period. 0: wake at once (the CUDA engine).
    wake_grace: float = 0.0

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
        self.segments = SegmentTable(
            build_segments(device_pools, host_pools, self.layer_ids), len(self.layer_ids)
        )
        #: Worker wake-ups that ran at least one operation (diagnostics: batching).
        self.num_batches = 0
        self._pending: collections.deque[_Op] = collections.deque()
        self._lock = threading.Condition()  # guards _pending, ids, flags; wakes the worker
        self._copying = False  # one thread copies at a time: the worker or a waiter
        self._next_id = 0
        self._fail_at: int | None = None
        self._fail_armed = False
        self._closed = False
        self._worker = threading.Thread(
            target=self._loop, name=f"transfer-{self.kind}", daemon=True
        )
        self._worker_started = False
        self._waker: TimerWaker | CondWaker | None = None  # made with the worker

    # -- public API -------------------------------------------------------------------------

    def backup(
        self,
        kv_pages: IndexPair = NO_PAIR,
        mamba_slots: IndexPair = NO_PAIR,
        window_pages: IndexPair = NO_PAIR,
    ) -> TransferHandle:
        """Queue device -> host copies of ``kv_pages``, ``mamba_slots`` and
        ``window_pages`` (device pages -> host window ids)."""
        return self._submit(TransferKind.BACKUP, kv_pages, mamba_slots, window_pages)

    def load(
        self,
        kv_pages: IndexPair = NO_PAIR,
        mamba_slots: IndexPair = NO_PAIR,
        window_pages: IndexPair = NO_PAIR,
    ) -> TransferHandle:
        """Queue host -> device copies, layer by layer (use ``handle.wait_layer``)."""
        return self._submit(TransferKind.LOAD, kv_pages, mamba_slots, window_pages)

    def fail_next(self, at_layer: int | None = None) -> None:
        """Tests only: the next submitted operation fails before copying ``at_layer``."""
        if at_layer is not None and at_layer not in self.layer_ids:
            raise ValueError(f"at_layer={at_layer} is not one of {self.layer_ids}")
        with self._lock:
            self._fail_at, self._fail_armed = at_layer, True

    def close(self) -> None:
        """Stop the worker; queued operations ack as failed. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._waker is not None:
                self._waker.wake(0.0)
        if self._worker_started:
            self._worker.join()
        if self._waker is not None:
            self._waker.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- subclass hooks ---------------------------------------------------------------------

    @abc.abstractmethod
    def _steps(self, op: _Op) -> Iterator[None]:
        """Copy ``op`` layer by layer, yielding once each layer is published; raise on error.

        Before each layer's copies call ``self._check_fault(op, position)``; once a layer
        is in place call ``self._layer_ready(op, position)`` (positions in ``layer_ids``),
        then yield. Resumed by whichever thread holds the copy role (never two at once).
        """

    def _submitted(self, op: _Op) -> Any:
        """Called on the submitting thread; the result becomes ``op.after``."""
        return None

    # -- internals --------------------------------------------------------------------------

    def _submit(
        self,
        kind: TransferKind,
        kv_pages: IndexPair,
        mamba_slots: IndexPair,
        window_pages: IndexPair,
    ) -> TransferHandle:
        dev, host = self.device_pools, self.host_pools
        pd, ph, pa = check_indices("kv_pages", kv_pages, dev.num_pages, host.num_pages)
        sd, sh, sa = check_indices("mamba_slots", mamba_slots, dev.num_slots, host.num_slots)
        if window_pages is NO_PAIR:
            wd, wh, wa = NO_INDICES, NO_INDICES, 0
        else:
            wd, wh, wa = check_indices(
                "window_pages", window_pages, dev.num_pages, host.num_window_pages
            )
        pairs = ((pd, ph), (sd, sh), (wd, wh))
        nbytes = self.segments.op_bytes(pairs) if kind is TransferKind.LOAD else 0
        inline = kind is TransferKind.LOAD and 0 < self.inline_bytes and nbytes <= self.inline_bytes
        with self._lock:
            if self._closed:
                raise RuntimeError("transfer engine is closed")
            handle = TransferHandle(self._next_id, kind, self.layer_ids, self)
            op = _Op(handle, pairs, (pa, sa, wa), nbytes)
            self._next_id += 1
            if self._fail_armed:
                op.inject, op.fail_at = True, self._fail_at
                self._fail_armed, self._fail_at = False, None
            op.after = self._submitted(op)
            if inline and not self._copying and not self._pending:
                self._copying = True  # this thread copies it now (see ``inline_bytes``)
            else:
                inline = False
                self._pending.append(op)
                if not self._copying:  # a copier drains the queue or wakes the worker
                    self._wake_worker(self.wake_grace)
        if inline:  # as ``_execute`` would, for this one op, first in line
            ok, error = True, None
            try:
                try:
                    op.steps = self._steps(op)
                    for _ in op.steps:
                        pass
                except Exception as exc:  # acked as failed, like any operation
                    ok, error = False, f"{type(exc).__name__}: {exc}"
                handle._finish(ok, error)  # before a later op can start: acks in order
            finally:
                self._release_copier()
        return handle

    def _wake_worker(self, grace: float = 0.0) -> None:
        """Start the worker, wake it in ``grace`` seconds (caller holds ``_lock``)."""
        if not self._worker_started:
            self._waker = make_waker(self._lock)  # no descriptors for an idle engine
            self._worker.start()
            self._worker_started = True
        assert self._waker is not None
        self._waker.wake(grace)

    def _check_fault(self, op: _Op, position: int) -> None:
        layer = self.layer_ids[position]
        if op.inject and (op.fail_at is None or op.fail_at == layer):
            raise InjectedFailure(f"injected failure before layer {layer} of op {op.handle.op_id}")

    def _layer_ready(self, op: _Op, position: int) -> None:
        """Layers ``[0, position]`` of ``self.layer_ids`` are in place for ``op``."""
        handle = op.handle  # inlined: this runs once per layer of every op
        handle._layers_done = position + 1
        if handle._layer_waiters:
            handle._notify_layers()

    def _loop(self) -> None:
        waker = self._waker
        assert waker is not None
        while True:
            # Sleep while there is nothing to do or a waiter is copying: the waiter wakes
            # us when it leaves work behind (no lock hand-off per operation).
            with self._lock:
                run = bool(self._pending) and not self._copying
                if run:
                    self._copying = True
                    self.num_batches += 1
                elif self._closed and not self._copying:
                    return  # closed and drained
                elif waker.holds_lock:
                    waker.sleep()
                    continue
            if not run:
                waker.sleep()
                continue
            try:
                self._execute(None, 0)
            finally:
                self._release_copier()

    def _help(self, handle: TransferHandle, pos: int) -> None:
        """A thread about to wait copies instead, if no one else is copying: no hand-off."""
        with self._lock:
            if self._copying or not self._pending:
                return
            self._copying = True
        try:
            self._execute(handle, pos)
        finally:
            self._release_copier()

    def _release_copier(self) -> None:
        with self._lock:
            self._copying = False
            if self._pending or (self._closed and self._worker_started):
                self._wake_worker()  # the worker takes over what is left (or exits)

    def _execute(self, until: TransferHandle | None, pos: int) -> None:
        """Run queued operations in order (caller set ``_copying``): all of them, or only
        until ``until`` has layer position ``pos`` in place (``len(layer_ids)``: finished)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                op = self._pending[0]
                if op.steps is None and self._closed:
                    # close() was called while this op waited: ack it failed, do not copy.
                    self._pending.popleft()
                    op.handle._finish(False, "engine closed")
                    continue
            if until is not None and (until._finished or until._layers_done > pos):
                return
            ok, error = True, None
            try:
                if op.steps is None:
                    op.steps = self._steps(op)
                for _ in op.steps:
                    if op.handle is until and until._layers_done > pos:
                        return  # the rest of this op continues on the next call
            except Exception as exc:  # an op failure must never kill the worker
                ok, error = False, f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._pending.popleft()
            op.handle._finish(ok, error)
