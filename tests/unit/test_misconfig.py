"""Loud misconfiguration in runtime.serve: warnings at start-up,
exit code 2 for a requested L3 that cannot start, the summary's L3 and uncached lines,
the per-user L3 root, and a CLI that explains itself. ``serve.main`` runs in process
on the tests' one-rank group."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from mesh_hicache.cache import HiCache
from mesh_hicache.storage.file import FileStorage
from runtime.serve import checks as startup_checks
from runtime.serve import flags as serve_flags
from runtime.serve import main as serve
from runtime.serve.checks import fit_warnings
from runtime.workloads.generate import Turn

TINY = ["--model", "tiny", "--sessions", "2", "--turns", "2", "--max-new-tokens", "2"]
TINY += ["--first-prompt-len", "40", "--append-len", "8", "--threads", "1"]


def _main(tmp_path: Path, *extra: str) -> tuple[int, dict | None]:
    out = tmp_path / "run.json"
    code = serve.main([*TINY, "--json", str(out), *extra])
    return code, json.loads(out.read_text()) if out.exists() else None


def test_fit_warning_names_the_flag_that_sized_l1() -> None:
    trace = [Turn(request_id=0, session=0, turn=0, user_tokens=tuple(range(40)))]
    by_pages = fit_warnings(trace, 2, 16, 2)
    by_bytes = fit_warnings(trace, 2, 16, 2, "--device-bytes")
    assert "raise --device-pages until L1 holds at least 3 pages" in by_pages[0]
    assert "raise --device-bytes until L1 holds at least 3 pages" in by_bytes[0]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_l1_too_small_warns_once_and_counts_uncached(tmp_path, caplog, single_rank_group):
    with caplog.at_level(logging.INFO):
        code, run = _main(tmp_path, "--cache", "host", "--device-pages", "2")
    assert code == 0 and run is not None
    warned = [w for w in _warnings(caplog) if "L1 holds 2 pages" in w]
    assert len(warned) == 1, _warnings(caplog)
    # 40 + 2 tokens need 3 pages of 16; the second turns need more.
    assert "raise --device-pages until L1 holds at least" in warned[0]
    assert "4 of 4 requests" in warned[0]
    assert run["summary"]["requests_uncached_l1"] == 4
    assert run["summary"]["hit_rate"] == 0.0
    assert run["summary"]["l3"] == "off"


def test_prompts_shorter_than_a_page_warn(tmp_path, caplog, single_rank_group):
    with caplog.at_level(logging.INFO):
        code, run = _main(tmp_path, "--cache", "device", "--page-size", "64")
    assert code == 0 and run is not None
    assert any("shorter than one page (--page-size 64)" in w for w in _warnings(caplog))


def test_a_cache_that_fits_does_not_warn(tmp_path, caplog, single_rank_group):
    with caplog.at_level(logging.INFO):
        code, run = _main(tmp_path, "--cache", "host")
    assert code == 0 and run is not None
    assert not [w for w in _warnings(caplog) if "L1 holds" in w or "shorter than" in w]
    assert run["summary"]["requests_uncached_l1"] == 0
    # Progress lines are INFO (no terminal under pytest), not warnings.
    assert any(
        r.levelno == logging.INFO and "[4/4] hit rate" in r.getMessage() for r in caplog.records
    )


def test_storage_root_that_is_a_file_is_an_error(tmp_path, capsys):
    root = tmp_path / "l3-file"
    root.write_text("x")
    code, run = _main(tmp_path, "--storage-root", str(root))
    err = capsys.readouterr().err
    assert code == 2 and run is None
    assert str(root) in err and "is not a directory" in err and "--cache host" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_storage_root_not_writable_is_an_error(tmp_path, capsys):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        code, _ = _main(tmp_path, "--storage-root", str(root))
    finally:
        root.chmod(0o700)
    err = capsys.readouterr().err
    assert code == 2 and str(root) in err and "not writable" in err


def test_mooncake_missing_package_is_an_error(tmp_path, capsys, monkeypatch):
    real = startup_checks.importlib.util.find_spec
    monkeypatch.setattr(
        startup_checks.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "mooncake" else real(name, *a),
    )
    code, _ = _main(tmp_path, "--storage", "mooncake")
    err = capsys.readouterr().err
    assert code == 2 and "mooncake package is not installed" in err and ".[mooncake]" in err


def test_mooncake_master_unreachable_is_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(startup_checks.importlib.util, "find_spec", lambda name, *a: object())
    with socket.socket() as s:  # a port nobody listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        code, _ = _main(tmp_path, "--storage", "mooncake", "--mooncake-master", f"127.0.0.1:{port}")
    err = capsys.readouterr().err
    assert code == 2 and f"127.0.0.1:{port}" in err and "unreachable" in err


def test_backend_failing_later_degrades_and_the_summary_says_when_and_why(
    tmp_path, monkeypatch, single_rank_group
):
    calls = {"n": 0}
    real_put = FileStorage.put

    def failing_put(self, keys, src):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(28, "No space left on device (injected)")
        return real_put(self, keys, src)

    monkeypatch.setattr(FileStorage, "put", failing_put)
    code, run = _main(tmp_path, "--storage-root", str(tmp_path / "l3"), "--storage-retry-s", "1000")
    assert code == 0 and run is not None
    l3 = run["summary"]["l3"]
    assert l3.startswith("degraded since request "), l3
    assert "No space left on device (injected)" in l3


def test_backend_failing_only_in_the_final_flush_is_reported(
    tmp_path, monkeypatch, single_rank_group
):
    # The writes the flush after the last request waits for fail: no request's
    # progress call saw L3 degraded, the summary still says why.
    flushing = threading.Event()
    real_put, real_flush = FileStorage.put, HiCache.flush
    calls = {"n": 0}

    def put(self, keys, src):
        calls["n"] += 1
        if calls["n"] <= 2:
            return real_put(self, keys, src)
        assert flushing.wait(60), "the flush never started"
        raise OSError(28, "No space left on device (injected)")

    def flush(self):
        flushing.set()
        return real_flush(self)

    monkeypatch.setattr(FileStorage, "put", put)
    monkeypatch.setattr(HiCache, "flush", flush)
    code, run = _main(tmp_path, "--storage-root", str(tmp_path / "l3"), "--storage-retry-s", "1000")
    assert code == 0 and run is not None and calls["n"] > 2
    l3 = run["summary"]["l3"]
    n = len(run["requests"])
    assert l3.startswith(f"degraded since request {n} "), l3
    assert "No space left on device (injected)" in l3


def test_default_l3_root_is_per_user(tmp_path):
    root = startup_checks.default_storage_root({"XDG_CACHE_HOME": str(tmp_path)})
    assert root == str(tmp_path / "mesh_hicache" / "l3")
    home = startup_checks.default_storage_root({})
    assert home == os.path.join(os.path.expanduser("~"), ".cache", "mesh_hicache", "l3")
    assert serve_flags.DEFAULT_STORAGE_ROOT == startup_checks.default_storage_root()


def test_summary_says_how_warm_l3_was(tmp_path, capsys, single_rank_group):
    root = str(tmp_path / "l3")
    _, first = _main(tmp_path, "--storage-root", root)
    _, second = _main(tmp_path, "--storage-root", root)
    assert first is not None and second is not None
    assert first["summary"]["l3_start_objects"] == 0
    objects, size = startup_checks.l3_warmth(root)
    assert second["summary"]["l3_start_objects"] == objects > 0
    assert second["summary"]["l3_start_bytes"] == size > 0
    assert f"{objects} objects, {serve.human_bytes(size)}" in capsys.readouterr().out


def test_help_shows_every_flag_with_help_and_defaults(capsys):
    parser = serve.build_parser()
    missing = [a.dest for a in parser._actions if not a.help]
    assert missing == []
    text = parser.format_help()
    assert "(default: 64)" in text and "(default: INFO)" in text
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--version"])
    assert exit_.value.code == 0
    from mesh_hicache import __version__

    assert __version__ in capsys.readouterr().out


def test_rank_labels_and_one_message_per_mesh(monkeypatch):
    handler = logging.Handler()
    records: list[logging.LogRecord] = []
    handler.emit = records.append  # type: ignore[method-assign]
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # only this handler (pytest's keep theirs)
    root.addHandler(handler)
    try:
        for coords in ((0, 0, 0), (0, 1, 1)):
            handler.filters.clear()
            startup_checks.label_rank_logs(SimpleNamespace(num_ranks=4, coords=coords))
            logger = logging.getLogger(f"test.rank{coords[1]}")
            logger.warning("storage refused")
            logger.error("lost")
    finally:
        root.removeHandler(handler)
    lines = [handler.format(r) for r in records]
    assert lines == [
        "[rank (pp, cp, tp) = (0, 0, 0)] storage refused",
        "[rank (pp, cp, tp) = (0, 0, 0)] lost",
        "[rank (pp, cp, tp) = (0, 1, 1)] lost",
    ]
