"""Loopback-only Mooncake services for tests: a private network namespace, master, client.

``MooncakeServices.start()`` creates a network namespace (a small holder process that
called ``unshare(CLONE_NEWNET)`` and brought ``lo`` up), starts ``mooncake_master`` and
one ``mooncake_client`` (the process that holds the store's memory) inside it with
``nsenter``, and waits, bounded, until the master logs the client's segment mount.
``stop()`` kills every process it started, by PID. Nothing listens outside the
namespace: some Mooncake listeners bind 0.0.0.0 whatever the flags say, and inside a
private namespace 0.0.0.0 is only the namespace's own loopback.

Code that talks to the store must run in the same namespace: ``NetnsWorker`` is a
spawned Python process that joins the namespace (``setns``) before it imports Mooncake
and then runs module-level functions sent to it, with a timeout on every call.

Needs root (CAP_SYS_ADMIN) and the Mooncake package; ``unavailable_reason()`` says which
one is missing so that tests can skip naming it.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

CLONE_NEWNET = 0x40000000
MASTER_PORT = 50051
CLIENT_PORT = 50052
MASTER_ADDRESS = f"127.0.0.1:{MASTER_PORT}"
NO_EVICTION = ("--eviction_high_watermark_ratio=1.0", "--eviction_ratio=0.0")
"""Master flags that keep a full store full: by default the master evicts 5% of the
objects once usage passes 90% or a put finds no space, which makes "full" transient."""

# Runs in the holder: its own network namespace, loopback up (SIOCSIFFLAGS |= IFF_UP),
# then it waits for its stdin to close, so it also ends if the test process dies.
_HOLDER = r"""
import ctypes, fcntl, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x40000000) != 0:
    sys.stdout.write("unshare failed: errno %d\n" % ctypes.get_errno()); sys.stdout.flush()
    sys.exit(1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
req = struct.pack("16sH", b"lo", 0)
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, req)[:18])[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.read()
"""


def _bin(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    return shutil.which(name)


def unavailable_reason() -> str | None:
    """None when the services can run here, else why not (for ``pytest.skip``)."""
    try:
        import mooncake.store  # noqa: F401
    except Exception as exc:  # ImportError, or OSError when libibverbs.so.1 is missing
        return (
            "needs the Mooncake store package (pip install mooncake-transfer-engine-non-cuda"
            f" and apt-get install libibverbs1): {exc}"
        )
    if _bin("mooncake_master") is None or _bin("mooncake_client") is None:
        return "needs the mooncake_master and mooncake_client executables on PATH"
    for tool in ("nsenter", "unshare"):  # unshare: scripts/mooncake_local.sh
        if shutil.which(tool) is None:
            return f"needs {tool} (util-linux) for the private network namespace"
    if os.geteuid() != 0:
        return "needs root to create a private network namespace (unshare -n); not root"
    probe = subprocess.run(
        [sys.executable, "-c", _HOLDER],
        input="",
        capture_output=True,
        text=True,
        timeout=30,
    )
    if "ready" not in probe.stdout:
        return f"private network namespaces are not permitted here: {probe.stdout.strip()}"
    return None


@dataclass
class MooncakeServices:
    """A master and one client in a private loopback-only network namespace.

    ``segment_bytes`` is the memory the client contributes to the store (the store's
    capacity). ``log_dir`` receives ``master.log`` and ``client.log``.
    """

    segment_bytes: int = 64 << 20
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mooncake-")))
    startup_timeout: float = 30.0
    master_flags: tuple[str, ...] = ()
    """Extra ``mooncake_master`` flags, e.g. ``NO_EVICTION``."""
    holder: subprocess.Popen[str] | None = None
    master: subprocess.Popen[bytes] | None = None
    client: subprocess.Popen[bytes] | None = None
    _master_starts: int = 0

    @property
    def netns_path(self) -> str:
        assert self.holder is not None, "services not started"
        return f"/proc/{self.holder.pid}/ns/net"

    @property
    def master_address(self) -> str:
        return MASTER_ADDRESS

    def _nsenter(self, argv: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / log_name, "ab")
        try:
            # setpriv and nsenter exec the program, so the PID we hold is the service's own.
            # setpriv: the service gets SIGKILL if this process dies without stop().
            guard = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
            return subprocess.Popen(
                [*guard, "nsenter", f"--net={self.netns_path}", "--", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()

    def start(self) -> MooncakeServices:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.holder = subprocess.Popen(
            [sys.executable, "-c", _HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.holder.stdout is not None
        line = self.holder.stdout.readline()
        if "ready" not in line:
            self.stop()
            raise RuntimeError(f"could not create a network namespace: {line.strip()!r}")
        try:
            self.start_master()
            self.client = self._nsenter(
                [
                    str(_bin("mooncake_client")),
                    "--host=127.0.0.1",
                    f"--port={CLIENT_PORT}",
                    f"--master_server_address={MASTER_ADDRESS}",
                    "--metadata_server=P2PHANDSHAKE",
                    f"--global_segment_size={self.segment_bytes}",
                    "--protocol=tcp",
                    "--logtostderr",
                ],
                "client.log",
            )
            self.wait_mounted(1)
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> None:
        """Start (or restart) the master; an old one must be stopped first."""
        assert self.master is None or self.master.poll() is not None, "master still running"
        self._master_starts += 1
        self.master = self._nsenter(
            [
                str(_bin("mooncake_master")),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={MASTER_PORT}",
                "--metrics_host=127.0.0.1",
                "--enable_metric_reporting=false",
                "--logtostderr",
                *self.master_flags,
            ],
            "master.log",
        )

    def mounts_logged(self) -> int:
        """How many segment mounts the master has logged since its first start."""
        path = self.log_dir / "master.log"
        if not path.exists():
            return 0
        return path.read_text(errors="replace").count("action=mount_segment")

    def wait_mounted(self, count: int) -> None:
        """Block until ``count`` segment mounts are logged; RuntimeError after the timeout."""
        deadline = time.monotonic() + self.startup_timeout
        while self.mounts_logged() < count:
            for name, proc in (("master", self.master), ("client", self.client)):
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(
                        f"mooncake {name} exited with {proc.returncode}; see {self.log_dir}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"client segment not mounted within {self.startup_timeout:.0f}s;"
                    f" see {self.log_dir}"
                )
            time.sleep(0.05)

    def kill_master(self) -> None:
        """SIGKILL the master (a crash, not a shutdown) and reap it."""
        assert self.master is not None
        self.master.send_signal(signal.SIGKILL)
        self.master.wait(timeout=10)

    def freeze_master(self, frozen: bool) -> None:
        """SIGSTOP (``frozen``) or SIGCONT the master: it keeps its port and accepts TCP
        connections, but answers nothing while stopped."""
        assert self.master is not None
        self.master.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)

    def stop(self) -> None:
        """Kill every process this object started, by PID, and reap them."""
        for proc in (self.client, self.master):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)
        if self.holder is not None and self.holder.poll() is None:
            assert self.holder.stdin is not None
            self.holder.stdin.close()
            try:
                self.holder.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()
        if self.holder is not None and self.holder.stdout is not None:
            self.holder.stdout.close()


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path}) failed")
    finally:
        os.close(fd)


def _worker_main(netns_path: str, conn: Connection) -> None:
    # Join the namespace first: Mooncake's threads are created later from this thread
    # and inherit it.
    _setns(netns_path)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class WorkerError(AssertionError):
    """A function run in a ``NetnsWorker`` raised, or the worker died or timed out."""


class NetnsWorker:
    """A spawned process inside the services' namespace that runs functions on request.

    ``call(fn, *args)`` pickles a module-level ``fn`` by name, runs it in the worker and
    returns its result; state that must live across calls (an open store) can be kept
    in the worker module's globals. A call that takes more than ``timeout`` seconds kills
    the worker and raises ``WorkerError``.
    """

    def __init__(self, services: MooncakeServices, timeout: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, args=(services.netns_path, child))
        self._proc.start()
        child.close()
        self.timeout = timeout

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._conn.send((fn, args, kwargs))
        if not self._conn.poll(self.timeout):
            self.close()
            raise WorkerError(f"{fn.__name__} did not return within {self.timeout:.0f}s")
        try:
            status, payload = self._conn.recv()
        except EOFError:
            code = self._proc.exitcode
            self.close()
            raise WorkerError(f"worker died in {fn.__name__} (exit code {code})") from None
        if status != "ok":
            raise WorkerError(f"{fn.__name__} raised in the worker:\n{payload}")
        return payload

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
