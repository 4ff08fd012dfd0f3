"""Loud misconfiguration for ``runtime.serve``: what is checked before and during a run.

- :func:`check_storage_start`: an explicitly requested L3 that cannot start is a
  ``ValueError`` naming the path or package and the fix (``runtime.serve`` exits 2).
- :func:`fit_warnings`: requests the L1 pool cannot hold (served uncached) and prompts
  too short for one page (nothing to cache), as one warning each on rank 0.
- :class:`StorageWatch`: when and why L3 went down during the run, for the summary.
- :func:`default_storage_root` and :func:`l3_warmth`: the per-user L3 root and how warm
  it was when the run started.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from mesh_hicache.topology import MeshTopology
from runtime.workloads.generate import Turn

STORAGE_FLAGS = ("--storage", "--storage-root", "--mooncake-master")


def default_storage_root(env: dict[str, str] | None = None) -> str:
    """``$XDG_CACHE_HOME/mesh_hicache/l3``, else ``~/.cache/mesh_hicache/l3`` (per user)."""
    env = dict(os.environ if env is None else env)
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mesh_hicache", "l3")


def storage_requested(argv: Sequence[str]) -> bool:
    """Whether the command line names a storage backend, root or master explicitly."""
    return any(a == f or a.startswith(f + "=") for a in argv for f in STORAGE_FLAGS)


def check_storage_start(
    storage: str, root: str, master: str, connect_timeout_s: float = 3.0
) -> None:
    """``ValueError`` naming the path or package and the fix when the requested backend
    cannot start: a file root that is not a writable directory (or cannot be created), a
    missing Mooncake package, a Mooncake master that does not accept connections."""
    if storage == "file":
        _check_root(root)
        return
    if importlib.util.find_spec("mooncake") is None:
        raise ValueError(
            "--storage mooncake: the mooncake package is not installed; install it with "
            "pip install -e '.[mooncake]' (CPU) or pip install mooncake-transfer-engine (CUDA)"
        )
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--mooncake-master {master!r}: expected HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=connect_timeout_s):
            pass
    except OSError as err:
        raise ValueError(
            f"--mooncake-master {master}: the Mooncake master is unreachable ({err}); start "
            "mooncake_master there (scripts/mooncake_local.sh runs one for a test) or point "
            "--mooncake-master at a running one"
        ) from None


def _check_root(root: str) -> None:
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"--storage-root {root!r} is not a directory; remove it or pass a directory "
            "(or --cache host to run without L3)"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"--storage-root {root!r} cannot be created ({err.strerror}); pass a directory "
            "you can write (or --cache host to run without L3)"
        ) from None
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ValueError(
            f"--storage-root {root!r} is not writable ({err.strerror}); fix its permissions "
            "or pass another directory (or --cache host to run without L3)"
        ) from None


def request_lengths(trace: Sequence[Turn], max_new_tokens: int) -> list[tuple[int, int]]:
    """``(prompt tokens, prompt + generated tokens)`` of every request of ``trace``, the
    prompt being the session's history (previous prompt and answer) plus the turn."""
    history: dict[int, int] = {}
    out = []
    for turn in trace:
        new = turn.max_new_tokens or max_new_tokens
        prompt = history.get(turn.session, 0) + len(turn.user_tokens)
        history[turn.session] = prompt + new
        out.append((prompt, prompt + new))
    return out


def pages_needed(total_tokens: int, page_size: int) -> int:
    return -(-total_tokens // page_size)


def too_long_for_l1(total_tokens: int, page_size: int, device_pages: int) -> bool:
    """Whether a request of ``total_tokens`` (prompt + generated) cannot get its L1 pages
    (the engine then serves it uncached)."""
    return pages_needed(total_tokens, page_size) > device_pages


def fit_warnings(
    trace: Sequence[Turn],
    max_new_tokens: int,
    page_size: int,
    device_pages: int,
    budget_flag: str = "--device-pages",
) -> list[str]:
    """Warnings for a cached run: requests longer than L1, prompts shorter than a page.
    ``budget_flag``: the flag that sized L1 (``--device-pages`` or ``--device-bytes``),
    named in the fix."""
    lengths = request_lengths(trace, max_new_tokens)
    out = []
    too_long = [t for _, t in lengths if too_long_for_l1(t, page_size, device_pages)]
    if too_long:
        longest = max(too_long)
        out.append(
            f"L1 holds {device_pages} pages x {page_size} tokens = {device_pages * page_size} "
            f"tokens per request, but {len(too_long)} of {len(lengths)} requests need more "
            f"(the longest {longest} tokens): they are served uncached; raise {budget_flag} "
            f"until L1 holds at least {pages_needed(longest, page_size)} pages"
        )
    # A prompt is matched one token short and cached in whole pages.
    short = [p for p, _ in lengths if p - 1 < page_size]
    if short:
        out.append(
            f"{len(short)} of {len(lengths)} prompts are shorter than one page "
            f"(--page-size {page_size}) plus one token: nothing of them can be cached; "
            "lower --page-size"
        )
    return out


@dataclass(slots=True)
class StorageOutage:
    """When L3 went down during a run and the first error it gave."""

    after_requests: int
    after_s: float
    reason: str


class StorageWatch(logging.Handler):
    """Catches the first L3 failure warning (``mesh_hicache.storage``) of this rank and,
    with :meth:`observe` after every request, when the cache first reported L3 degraded."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reason: str | None = None
        self.outage: StorageOutage | None = None
        self._t0 = time.perf_counter()
        self._logger = logging.getLogger("mesh_hicache.storage")

    def __enter__(self) -> StorageWatch:
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if self.reason is None:
            self.reason = record.getMessage()

    def observe(self, degraded: bool, requests_done: int) -> None:
        if degraded and self.outage is None:
            reason = self.reason or "a storage error (see the warning above)"
            self.outage = StorageOutage(requests_done, time.perf_counter() - self._t0, reason)


def l3_warmth(root: str) -> tuple[int, int]:
    """``(objects, bytes)`` under a file backend root (0, 0 when it does not exist).
    Symlinks are not followed; temp files are counted too (they are short-lived)."""
    objects = total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(directory, name))
            except OSError:
                continue
            if os.path.isfile(os.path.join(directory, name)) and not os.path.islink(
                os.path.join(directory, name)
            ):
                objects += 1
                total += st.st_size
    return objects, total


class ProgressBar:
    """Rank 0's progress: a one-line bar redrawn in place when ``stream`` is a terminal,
    else an INFO line through ``log`` per update."""

    WIDTH = 24

    def __init__(self, log: logging.Logger, stream: TextIO) -> None:
        self.log = log
        self.stream = stream
        self.live = bool(getattr(stream, "isatty", lambda: False)())

    def update(self, done: int, total: int, text: str) -> None:
        if not self.live:
            self.log.info("[%d/%d] %s", done, total, text)
            return
        filled = self.WIDTH * done // max(total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        end = "\n" if done >= total else ""
        self.stream.write(f"\r[{bar}] {done}/{total} {text}{end}")
        self.stream.flush()


class _RankLabel(logging.Filter):
    def __init__(self, prefix: str, leader: bool) -> None:
        super().__init__()
        self.prefix = prefix
        self.leader = leader

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.leader and record.levelno < logging.ERROR:
            return False  # rank 0 says the same: decisions are agreed mesh-wide
        if not getattr(record, "rank_labelled", False):
            record.msg = self.prefix + str(record.msg)
            record.rank_labelled = True
        return True


def label_rank_logs(topology: MeshTopology) -> None:
    """On a mesh of several ranks: prefix every log line with the rank's ``(pp, cp, tp)``
    and let ranks other than 0 log errors only (their warnings would repeat rank 0's).
    Idempotent; one rank is left as is."""
    if topology.num_ranks == 1:
        return
    pp, cp, tp = topology.coords
    label = _RankLabel(f"[rank (pp, cp, tp) = ({pp}, {cp}, {tp})] ", topology.coords == (0, 0, 0))
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _RankLabel) for f in handler.filters):
            handler.addFilter(label)
