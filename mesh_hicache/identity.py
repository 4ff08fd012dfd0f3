"""The content identity of a checkpoint: what a cache's ``StateSpec.model_id`` must name.

A cached KV page or recurrent state is a function of the exact weights, the config that
shapes the computation, the dtype it ran in and the numerics of the code that ran it.
Two fine-tunes of one base saved by the same tools share ``config.json`` and every file
size, so any identity built from names, paths or sizes lets one model read the other's
state and answer wrongly without an error. :func:`checkpoint_model_id` hashes the bytes.

What the digest covers (``IDENTITY_VERSION`` 1):

- every regular file directly in the directory whose name ends in one of
  ``WEIGHT_SUFFIXES`` (``*.safetensors``, ``*.bin``, ``*.pt``, ...): all the formats a
  loader may read, each by its exact bytes and its name;
- the files of ``NUMERIC_FILES`` present (``config.json``, quantization configs): they
  change the numbers. ``generation_config.json`` and tokenizer files are left out: they
  change sampling and text, not the state cached for a token sequence;
- ``extra``: what the serving engine adds (dtype, quantization mode, its own numerics
  version); the engine passes its own, as strings.

Subfolders are not read (a loader reads the top level; an ``original/`` copy in another
format would only cost hashing time).

Hashing streams each file once at disk speed (BLAKE2b-256, which releases the GIL) and
remembers the result in a small per-user index (``$XDG_CACHE_HOME/mesh_hicache/
file_digests.json``, else ``~/.cache/...``) keyed by the file's real path, size,
``mtime_ns``, ``ctime_ns``, inode and device: a restart, a symlink to the same folder or
a second engine on the same checkpoint does not rehash. A copy in another folder is
hashed once more and gets the same identity. Writes to the index are atomic (temp file +
rename); an unreadable or corrupt index is ignored (everything is rehashed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

IDENTITY_VERSION = 1
"""Bumped whenever what the digest covers or how it is computed changes (a new version
never equals an old identity)."""

ID_PREFIX = f"weights-v{IDENTITY_VERSION}-"
"""Every derived identity starts with it (old size-based ids never did)."""

WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz",
)  # fmt: skip
"""File name endings of weight files (matched case-insensitively)."""

NUMERIC_FILES = ("config.json", "quantize_config.json", "quant_config.json", "params.json")
"""Small files that change the computation, hashed when present."""

PROGRESS_BYTES = 1 << 30
"""Checkpoints with at least this many bytes still to hash report progress."""

_CHUNK = 8 << 20
_INDEX_NAME = "file_digests.json"
_INDEX_FORMAT = 1

log = logging.getLogger(__name__)


@dataclass(slots=True)
class HashCounts:
    """How much hashing this process did (the tests read it: a restart hashes nothing)."""

    files_hashed: int = 0
    bytes_hashed: int = 0
    index_hits: int = 0


_counts = HashCounts()
_counts_lock = threading.Lock()


def hash_counts() -> HashCounts:
    """A snapshot of this process's counters (files and bytes hashed, index hits)."""
    with _counts_lock:
        return HashCounts(_counts.files_hashed, _counts.bytes_hashed, _counts.index_hits)


def default_index_path() -> Path:
    """``$XDG_CACHE_HOME/mesh_hicache/file_digests.json`` (``~/.cache`` when unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "mesh_hicache" / _INDEX_NAME


def _stat_key(path: Path) -> str:
    real = os.path.realpath(path)
    st = os.stat(real)
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{real}"


class DigestIndex:
    """The per-user map from a file's (device, inode, size, mtime, ctime, real path) to
    its content digest. Entries whose file changed or vanished are dropped on save."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries = self._read()

    def _read(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            return {}
        if not isinstance(data, dict) or data.get("format") != _INDEX_FORMAT:
            return {}
        entries = data.get("digests")
        if not isinstance(entries, dict):
            return {}
        return {
            k: v
            for k, v in entries.items()
            if isinstance(k, str) and isinstance(v, str) and len(v) == 64
        }

    def get(self, key: str) -> str | None:
        return self.entries.get(key)

    def save(self, new: Mapping[str, str]) -> None:
        """Merge ``new`` into the index on disk (re-read first: another process may have
        added entries) and replace the file atomically. Failures are logged, not raised:
        the index only saves time."""
        merged = {**self._read(), **self.entries, **new}
        live = {k: v for k, v in merged.items() if _still_valid(k)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(prefix=".digests-", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": _INDEX_FORMAT, "digests": live}, f)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as err:
            log.warning("checkpoint digest index %s not written: %s", self.path, err)
            return
        self.entries = live


def _still_valid(key: str) -> bool:
    real = key.split(":", 5)[-1]
    try:
        return _stat_key(Path(real)) == key
    except OSError:
        return False


def _identity_files(directory: Path) -> list[Path]:
    files = []
    for path in sorted(directory.iterdir(), key=lambda p: p.name):
        name = path.name
        if not path.is_file():
            continue
        if name in NUMERIC_FILES or name.lower().endswith(WEIGHT_SUFFIXES):
            files.append(path)
    return files


def _hash_file(path: Path, report: Callable[[int], None]) -> str:
    h = hashlib.blake2b(digest_size=32)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            total += n
            report(n)
    with _counts_lock:
        _counts.files_hashed += 1
        _counts.bytes_hashed += total
    return h.hexdigest()


class _Progress:
    """Emits a line at each tenth of the bytes to hash (by bytes, not by time)."""

    def __init__(self, sink: Callable[[str], None] | None, total: int, where: Path) -> None:
        self.sink = sink if sink is not None else log.info
        self.total, self.done, self.next_tenth = total, 0, 1
        self.active = total >= PROGRESS_BYTES
        if self.active:
            self.sink(f"hashing checkpoint {where}: {total / 2**30:.1f} GiB (once per file)")

    def __call__(self, n: int) -> None:
        self.done += n
        if self.active and self.done * 10 >= self.next_tenth * self.total:
            while self.done * 10 >= self.next_tenth * self.total:
                self.next_tenth += 1
            self.sink(f"hashing checkpoint: {100 * self.done // self.total}%")


def checkpoint_model_id(
    model_dir: str | os.PathLike[str],
    *,
    extra: Mapping[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> str:
    """The content identity of the checkpoint in ``model_dir``, for ``StateSpec.model_id``.

    ``"weights-v1-"`` + 64 hex chars: BLAKE2b-256 over the names and digests of the
    weight and config files (module docstring) and the ``extra`` items (the engine's
    dtype, quantization, numerics version: ``str -> str``). Equal bytes give equal ids
    wherever the folder lies (a copy, a symlink); one changed byte gives another id.

    ``progress``: called with a line of text at the start and at each tenth of a hash
    of at least ``PROGRESS_BYTES`` (default: this module's logger at INFO).
    ``ValueError`` when ``model_dir`` is not a directory or holds no weight file.
    """
    directory = Path(model_dir)
    if not directory.is_dir():
        raise ValueError(f"checkpoint_model_id: {str(model_dir)!r} is not a directory")
    extra = dict(extra or {})
    for k, v in extra.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"checkpoint_model_id: extra must map str to str, got {k!r}: {v!r}")
    files = _identity_files(directory)
    if not any(p.name.lower().endswith(WEIGHT_SUFFIXES) for p in files):
        raise ValueError(
            f"checkpoint_model_id: no weight file ({', '.join(WEIGHT_SUFFIXES)}) in {directory}"
        )
    index = DigestIndex(default_index_path())
    keys = {p: _stat_key(p) for p in files}
    known = {p: index.get(k) for p, k in keys.items()}
    todo = [p for p, d in known.items() if d is None]
    with _counts_lock:
        _counts.index_hits += len(files) - len(todo)
    report = _Progress(progress, sum(os.stat(p).st_size for p in todo), directory)
    fresh = {p: _hash_file(p, report) for p in todo}
    if fresh:
        index.save({keys[p]: d for p, d in fresh.items()})
    digests = {p: known[p] or fresh[p] for p in files}

    h = hashlib.blake2b(digest_size=32, person=b"mhc-model-id")
    _put(h, f"identity-v{IDENTITY_VERSION}")
    for p in files:
        _put(h, "file", p.name, digests[p])
    for k in sorted(extra):
        _put(h, "extra", k, extra[k])
    return ID_PREFIX + h.hexdigest()


def _put(h: hashlib.blake2b, *parts: str) -> None:
    # Length-prefixed, so no two different item lists serialize to the same bytes.
    for part in parts:
        data = part.encode("utf-8")
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
