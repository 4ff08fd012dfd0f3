"""What ``runtime.serve`` and ``runtime.server`` tell a user is true and names the flag:
no uncached-request rows with the cache off, bytes a reader can read, flag errors in
flag words, ``--help`` stating each default once."""

from __future__ import annotations

import re

import pytest

from runtime.serve import main as serve
from runtime.serve.flags import build_parser
from tests.serve_cases import run_serve


def test_cache_off_reports_no_requests_too_long_for_l1(tmp_path) -> None:
    run, proc = run_serve(tmp_path, "off", "--cache", "off")
    assert "requests_uncached_l1" not in run["summary"]
    assert "requests_no_hit" not in run["summary"]
    assert "too long for L1" not in proc.stdout and "no cache hit" not in proc.stdout
    assert "prompt tokens" in proc.stdout  # the summary itself is there
    full, proc = run_serve(tmp_path, "full", "--storage-root", str(tmp_path / "l3"))
    assert full["summary"]["requests_uncached_l1"] == 0
    assert "requests too long for L1 (uncached)" in proc.stdout


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (5 << 20, "5.0 MiB")]
    + [(3 << 30, "3.0 GiB"), (2 << 50, "2048.0 TiB")],
)
def test_human_bytes(n, text) -> None:
    assert serve.human_bytes(n) == text


def test_summary_shows_l3_warmth_in_readable_bytes() -> None:
    summary = serve.summarize([], 1.0)
    summary.update(l3_start_objects=12, l3_start_bytes=3 * 1024 * 1024 + 1, l3="on")
    text = serve.format_summary(summary)
    assert re.search(r"L3 at start\s+12 objects, 3\.0 MiB$", text, re.M), text
    assert "3145729" not in text


def test_reshard_row_is_labelled_as_a_part_of_the_l3_tokens_served() -> None:
    summary = serve.summarize([], 1.0)
    summary["storage_resharded_tokens"] = 0
    lines = serve.format_summary(summary).splitlines()
    names = [line.strip().rsplit("  ", 1)[0].strip() for line in lines]
    at = names.index("served from storage (L3)")
    assert names[at + 1] == "served from L3, resharded"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--device-pages", "0"], "--device-pages"),
        (["--device-pages", "-2"], "--device-pages"),
        (["--page-size", "0"], "--page-size"),
        (["--page-size", "-1", "--cache", "off"], "--page-size"),
    ],
)
def test_size_flag_errors_name_the_flag(argv, flag) -> None:
    args = build_parser().parse_args(argv)
    with pytest.raises(ValueError) as err:
        serve.check_args(args)
    message = str(err.value)
    assert message.startswith(flag), message
    assert "HiCacheConfig" not in message and "StateSpec" not in message


def test_device_pages_zero_is_fine_with_a_byte_budget_or_no_cache() -> None:
    for argv in (["--device-pages", "0", "--device-bytes", "1048576"], ["--cache", "off"]):
        serve.check_args(build_parser().parse_args(["--device-pages", "0", *argv]))


def test_size_flag_error_exits_2_with_one_line(capsys) -> None:
    assert serve.main(["--page-size", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "runtime.serve: error: --page-size must be >= 1 (tokens per page), got 0\n"


def _parsers():
    yield "runtime.serve", build_parser()
    server = pytest.importorskip("runtime.server.flags", reason="needs aiohttp (server extra)")
    yield "runtime.server", server.build_parser()


def test_help_states_each_default_once() -> None:
    for name, parser in _parsers():
        text = parser.format_help()
        assert "(default: None)" not in text, name
        for action in parser._actions:
            if not action.help or action.help == "==SUPPRESS==":
                continue
            rendered = parser._get_formatter()._expand_help(action)
            assert rendered.lower().count("default") <= 1, (name, rendered)
            default = action.default
            if (
                default not in (None, False, "==SUPPRESS==")
                and "default" not in action.help.lower()
            ):
                assert f"(default: {action.default})" in rendered, (name, rendered)
