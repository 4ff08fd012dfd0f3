"""The ``mooncake`` backend: L3 objects in a Mooncake distributed store (docs/DESIGN.md section 8).

Objects have the byte format of every backend (``objects.py``, format version 2: header,
chunk table, payload; version 1 objects of older writers are still read). They are moved
with Mooncake's scatter/gather batch calls, ``batch_put_from_multi_buffers`` and
``batch_get_into_multi_buffers``: each object is two parts, its header and chunk table in
a small registered header arena owned by this backend and its payload directly in the
caller's host-pool row. So the header travels inside the same object as the payload (one
key, one atomic object, the same bytes a file backend would hold) while the page bytes
are never copied in this process. ``get_ranges`` reads only the chunks holding the asked
bytes through get sessions (``mooncake_ranges.py``). Why not a separate header object per
key: two objects can be evicted or overwritten independently, doubling lookups and
leaving payloads without their checksum. Why not a header region in front of each pool
row: that would change the host-pool layout (and its DTensor view) for one backend.

Rows inside a buffer passed to ``register_buffer`` take the zero-copy path; any other
tensor is staged through a registered scratch buffer of this backend (one copy).

Failure policy (the serving path must never fail or stall because of L3):
- a full store (-200), a lease conflict (-706) or any other per-object put error drops
  that backup: ``put`` answers False and counts it in ``stats.dropped``
  (``dropped_by_code`` splits it by Mooncake error code);
- a missing object (-704) or a failed transfer is a miss; a wrong-sized object is a
  "length" miss; a bad header or checksum is a corrupt miss (warned once per kind);
- a lost master (RPC failure, -900) raises ``MooncakeUnavailable``, which
  ``GuardedStorage`` turns into degraded mode (L1 + L2 only). While the master is
  unreachable each call first probes its TCP port and raises at once, instead of
  waiting seconds inside the Mooncake client; once the port answers, calls go through
  again and the Mooncake client reconnects by itself;
- a master that accepts connections but does not answer (stopped, overloaded): every
  call into the client has a deadline (``call_timeout_s``, ``deadline.py``); past it
  the call raises ``StoreTimeout`` and ``GuardedStorage`` degrades as for a lost
  master, then retries.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence
from typing import Any

import torch

from mesh_hicache.storage.base import StorageBackend, check_batch, load_secret
from mesh_hicache.storage.deadline import Deadline
from mesh_hicache.storage.keys import StorageKey
from mesh_hicache.storage.mooncake_ranges import RangedGets, table_region
from mesh_hicache.storage.objects import (
    HEADER_SIZE,
    PLAIN_FORMAT_VERSION,
    ObjectError,
    chunk_bytes_for,
    tensor_bytes,
)

logger = logging.getLogger(__name__)

# Mooncake error codes this backend distinguishes (mooncake-store ErrorCode).
NO_AVAILABLE_HANDLE = -200
"""The store has no space for the object (full)."""
INVALID_PARAMS = -600
"""Reported by a get whose destination is smaller than the object."""
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
"""The object is leased (being read or just written); a conflicting write is refused."""
TRANSFER_FAIL = -800
RPC_FAIL = -900
"""The master could not be reached."""


class MooncakeUnavailable(ConnectionError):
    """The Mooncake master is unreachable; ``GuardedStorage`` degrades on it."""


def _chunk_of(t: torch.Tensor) -> int:
    return chunk_bytes_for(t.shape, t.element_size())


def _parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"master_address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


class _Arena:
    """A registered, growable scratch buffer (uint8, CPU) of one backend."""

    def __init__(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)

    def ensure(self, store: Any, nbytes: int) -> torch.Tensor:
        """At least ``nbytes`` of registered memory; regrows (and re-registers) when short."""
        if self.tensor.numel() < nbytes:
            if self.tensor.numel():
                store.unregister_buffer(self.tensor.data_ptr())
            size = 1 << max(12, (nbytes - 1).bit_length())
            self.tensor = torch.empty(size, dtype=torch.uint8)
            rc = store.register_buffer(self.tensor.data_ptr(), size)
            if rc != 0:
                raise MooncakeUnavailable(f"Mooncake register_buffer failed with {rc}")
        return self.tensor

    def reset(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)


class MooncakeStorage(RangedGets, StorageBackend):
    """L3 objects in a Mooncake store reached through its master (see module docstring).

    ``master_address`` is the master's ``host:port``. ``metadata_server`` is
    ``"P2PHANDSHAKE"`` (no metadata service) or a metadata server URL; ``protocol`` is
    ``"tcp"`` or ``"rdma"`` (then ``rdma_devices`` names the NICs). ``local_hostname``
    is the address this process's transfer engine announces to peers.
    ``global_segment_size`` is the memory (bytes) this process contributes to the store:
    0 (the default) contributes none, so objects live in dedicated ``mooncake_client``
    processes and survive this process; objects placed in a contributed segment vanish
    when this process exits. ``local_buffer_size`` is Mooncake's own staging buffer
    (bytes), used only by its non-zero-copy calls. ``probe_timeout_s`` bounds the TCP
    probe of the master while it is unreachable; ``call_timeout_s`` bounds every call into
    the Mooncake client (set-up included). ``secret`` / ``secret_file`` seal
    objects with a keyed MAC (``base.load_secret``), as in every backend.

    Raises ``MooncakeUnavailable`` when the store cannot be set up (master down) and
    ImportError when the ``mooncake`` package is missing.
    """

    def __init__(
        self,
        master_address: str,
        *,
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        local_hostname: str = "127.0.0.1",
        global_segment_size: int = 0,
        local_buffer_size: int = 16 << 20,
        rdma_devices: str = "",
        probe_timeout_s: float = 0.5,
        call_timeout_s: float = 30.0,
        secret: bytes | str | None = None,
        secret_file: str | None = None,
    ) -> None:
        super().__init__(secret=load_secret(secret, secret_file))
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"MooncakeStorage protocol must be 'tcp' or 'rdma', got {protocol!r}")
        for name, value in (
            ("global_segment_size", global_segment_size),
            ("local_buffer_size", local_buffer_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MooncakeStorage {name} must be an int >= 0, got {value!r}")
        if not probe_timeout_s > 0:
            raise ValueError(f"MooncakeStorage probe_timeout_s must be > 0, got {probe_timeout_s}")
        self._deadline = Deadline(call_timeout_s, f"Mooncake master {master_address}")
        self._master = _parse_address(master_address)
        self._master_address = master_address
        self._probe_timeout_s = float(probe_timeout_s)
        self._lock = threading.Lock()  # one batch at a time: the arenas are shared
        self._headers = _Arena()
        self._staging = _Arena()
        self._buffers: list[tuple[int, int, torch.Tensor]] = []  # (start, end, keep-alive)
        self._dropped_by_code: dict[int, int] = {}
        self._warned_codes: set[int] = set()
        self._connected = True
        self._closed = False

        from mooncake.store import MooncakeDistributedStore

        # setup() against a dead master retries for a long time: fail fast instead.
        self._probe_master()
        self._store: Any = MooncakeDistributedStore()
        rc = self._deadline.run(
            "setup",
            self._store.setup,
            local_hostname,
            metadata_server,
            global_segment_size,
            local_buffer_size,
            protocol,
            rdma_devices,
            master_address,
        )
        if rc != 0:
            raise MooncakeUnavailable(
                f"Mooncake store setup against master {master_address} failed with {rc}"
            )

    @property
    def master_address(self) -> str:
        """The master's ``host:port``."""
        return self._master_address

    @property
    def dropped_by_code(self) -> dict[int, int]:
        """``stats.dropped`` split by Mooncake error code (e.g. -200 full, -706 leased)."""
        with self._stats_lock:
            return dict(self._dropped_by_code)

    def is_registered(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor``'s bytes lie inside one buffer given to ``register_buffer``."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return any(lo <= start and end <= hi for lo, hi, _ in self._buffers)

    # -- interface -------------------------------------------------------------------------

    def register_buffer(self, buffer: torch.Tensor) -> None:
        tensor_bytes(buffer)  # validates: CPU, contiguous
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes == 0 or self.is_registered(buffer):
            return
        with self._lock:
            self._check_open()
            rc = self._deadline.run(
                "register_buffer", self._store.register_buffer, buffer.data_ptr(), nbytes
            )
            if rc != 0:
                raise MooncakeUnavailable(f"Mooncake register_buffer failed with {rc}")
            # Keep the tensor alive: the store holds its address.
            self._buffers.append((buffer.data_ptr(), buffer.data_ptr() + nbytes, buffer))

    def exists(self, keys: Sequence[StorageKey]) -> int:
        flags = self.exists_each(keys)
        return flags.index(False) if False in flags else len(flags)

    def exists_each(self, keys: Sequence[StorageKey]) -> list[bool]:
        if not keys:
            return []
        names = [self.key_str(k) for k in keys]
        with self._lock:
            codes = self._call("batch_is_exist", names)
        self._raise_if_disconnected(codes)
        return [code == 1 for code in codes]

    def get(self, keys: Sequence[StorageKey], dst: Sequence[torch.Tensor]) -> list[bool]:
        check_batch(keys, dst, "MooncakeStorage.get")
        if not keys:
            return []
        names = [self.key_str(k) for k in keys]
        views = [tensor_bytes(t) for t in dst]
        with self._lock:
            hits = self._get_locked(names, dst, views)
        self._count(gets=len(keys))
        return hits

    def put(self, keys: Sequence[StorageKey], src: Sequence[torch.Tensor]) -> list[bool]:
        check_batch(keys, src, "MooncakeStorage.put")
        if not keys:
            return []
        names = [self.key_str(k) for k in keys]
        views = [tensor_bytes(t) for t in src]
        with self._lock:
            return self._put_locked(names, src, views)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._deadline.run("close", self._store.close)
            finally:
                self._buffers.clear()
                self._headers.reset()
                self._staging.reset()

    # -- batches ---------------------------------------------------------------------------

    def _put_locked(
        self, names: list[str], src: Sequence[torch.Tensor], views: list[memoryview]
    ) -> list[bool]:
        # Ask first: an existing object is not rewritten (and is counted as present).
        codes = self._call("batch_is_exist", names)
        self._raise_if_disconnected(codes)
        ok = [code == 1 for code in codes]
        todo = [i for i, present in enumerate(ok) if not present]
        self._count(already_present=len(names) - len(todo))
        if not todo:
            return ok
        regions = [table_region(src[i], self.codec.keyed) for i in todo]
        offsets = [sum(regions[:j]) for j in range(len(todo))]
        headers = self._headers.ensure(self._store, sum(regions))
        staged = [i for i in todo if views[i].nbytes and not self.is_registered(src[i])]
        staging = self._staging.ensure(self._store, sum(views[i].nbytes for i in staged))
        hdr_base = headers.data_ptr()
        header_bytes = tensor_bytes(headers)
        stage_offset = 0
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        for j, i in enumerate(todo):
            # Header and chunk table (format version 2) in front of the payload.
            if regions[j] > HEADER_SIZE:  # one pass for header + table (objects.py)
                hdr, table = self.codec.encode_chunked(names[i], views[i], _chunk_of(src[i]))
                head = hdr + table
            else:
                head = self.codec.encode_header(names[i], views[i])
            header_bytes[offsets[j] : offsets[j] + regions[j]] = head
            nbytes = views[i].nbytes
            if nbytes == 0:
                ptrs.append([hdr_base + offsets[j]])
                sizes.append([regions[j]])
                continue
            if i in staged:
                row = staging[stage_offset : stage_offset + nbytes]
                row.copy_(src[i].reshape(-1).view(torch.uint8))
                payload_ptr = row.data_ptr()
                stage_offset += nbytes
            else:
                payload_ptr = src[i].data_ptr()
            ptrs.append([hdr_base + offsets[j], payload_ptr])
            sizes.append([regions[j], nbytes])
        results = self._call("batch_put_from_multi_buffers", [names[i] for i in todo], ptrs, sizes)
        self._raise_if_disconnected(results)
        for i, code in zip(todo, results, strict=True):
            if code == 0 or code == OBJECT_ALREADY_EXISTS:
                ok[i] = True
                self._count(puts=1, put_bytes=views[i].nbytes)
            else:
                self._drop(names[i], code)
        return ok

    def _get_locked(
        self,
        names: list[str],
        dst: Sequence[torch.Tensor],
        views: list[memoryview],
        legacy: bool = False,
    ) -> list[bool]:
        """Whole reads: header (+ chunk table) into the header arena, payload into ``dst``
        (or staging). ``legacy``: format version 1 objects (no table), retried as such
        when an object has exactly the size of one."""
        n = len(names)
        regions = [HEADER_SIZE if legacy else table_region(t, self.codec.keyed) for t in dst]
        offsets = [sum(regions[:i]) for i in range(n)]
        headers = self._headers.ensure(self._store, sum(regions))
        staged = [i for i in range(n) if views[i].nbytes and not self.is_registered(dst[i])]
        staging = self._staging.ensure(self._store, sum(views[i].nbytes for i in staged))
        hdr_base = headers.data_ptr()
        stage_at: dict[int, torch.Tensor] = {}
        stage_offset = 0
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        for i in range(n):
            nbytes = views[i].nbytes
            if nbytes == 0:
                ptrs.append([hdr_base + offsets[i]])
                sizes.append([regions[i]])
                continue
            if i in staged:
                stage_at[i] = staging[stage_offset : stage_offset + nbytes]
                stage_offset += nbytes
                payload_ptr = stage_at[i].data_ptr()
            else:
                payload_ptr = dst[i].data_ptr()
            ptrs.append([hdr_base + offsets[i], payload_ptr])
            sizes.append([regions[i], nbytes])
        results = self._call("batch_get_into_multi_buffers", names, ptrs, sizes)
        self._raise_if_disconnected(results)
        header_bytes = tensor_bytes(headers)
        hits = [False] * n
        retry: list[int] = []
        for i, code in enumerate(results):
            expected = regions[i] + views[i].nbytes
            if code != expected:
                if self._get_failed(names[i], code, expected, HEADER_SIZE + views[i].nbytes):
                    retry.append(i)
                continue
            payload = tensor_bytes(stage_at[i]) if i in stage_at else views[i]
            head = header_bytes[offsets[i] : offsets[i] + regions[i]]
            try:
                decoded = self.codec.decode_header(names[i], head[:HEADER_SIZE])
                if decoded.nbytes != views[i].nbytes:
                    raise ObjectError(
                        "length", f"header says {decoded.nbytes}, dst {views[i].nbytes}"
                    )
                table = None
                if decoded.version != PLAIN_FORMAT_VERSION:
                    table = self.codec.decode_table(decoded, head[HEADER_SIZE:])
                self.codec.check_payload(decoded, payload, table)
            except ObjectError as err:
                self._record_corrupt(err.kind, names[i], str(err))
                continue
            if i in stage_at:
                dst[i].reshape(-1).view(torch.uint8).copy_(stage_at[i])
            hits[i] = True
            self._count(get_hits=1, get_bytes=views[i].nbytes)
        if retry and not legacy:
            again = self._get_locked(
                [names[i] for i in retry], [dst[i] for i in retry], [views[i] for i in retry], True
            )
            for i, ok in zip(retry, again, strict=True):
                hits[i] = ok
        return hits

    def _get_failed(self, name: str, code: int, expected: int, legacy: int) -> bool:
        """Count a failed read; True when the object has the size ``legacy`` of a format
        version 1 object instead (to be read again as one)."""
        if code == OBJECT_NOT_FOUND:
            self._count(get_misses=1)
            return False
        # A size mismatch fails the transfer (-600 when the object is larger than the
        # destination, -800 when smaller); tell it from a vanished holder by its size.
        size = self._deadline.run("get_size", self._store.get_size, name)
        if size == legacy and legacy != expected:
            return True
        if size > 0 and size != expected:
            self._record_corrupt("length", name, f"object of {size} bytes, expected {expected}")
        else:
            self._count(get_misses=1)
        return False

    # -- connection ------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> list[int]:
        """Run one batch call of the store; raises MooncakeUnavailable if the master is down."""
        self._check_open()
        if not self._connected:
            self._probe_master()
        return list(self._deadline.run(method, getattr(self._store, method), *args))

    def _probe_master(self) -> None:
        try:
            with socket.create_connection(self._master, timeout=self._probe_timeout_s):
                pass
        except OSError as err:
            raise MooncakeUnavailable(
                f"Mooncake master {self._master_address} unreachable: {err}"
            ) from err
        if not self._connected:
            self._connected = True
            logger.info("Mooncake master %s reachable again", self._master_address)

    def _raise_if_disconnected(self, codes: Sequence[int]) -> None:
        if RPC_FAIL in codes:
            self._connected = False
            raise MooncakeUnavailable(
                f"Mooncake master {self._master_address} unreachable (RPC failure {RPC_FAIL})"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MooncakeStorage is closed")

    def _drop(self, name: str, code: int) -> None:
        with self._stats_lock:
            self._stats.dropped += 1
            self._dropped_by_code[code] = self._dropped_by_code.get(code, 0) + 1
            first = code not in self._warned_codes
            self._warned_codes.add(code)
        if first:
            why = {NO_AVAILABLE_HANDLE: "store full", OBJECT_HAS_LEASE: "object leased"}
            logger.warning(
                "MooncakeStorage: put of %s dropped (%s, code %d); further drops with this "
                "code are only counted in stats",
                name,
                why.get(code, "error"),
                code,
            )
