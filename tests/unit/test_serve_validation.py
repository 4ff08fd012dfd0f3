"""runtime.serve rejects every bad flag before any work starts (no process group, no model)."""

from __future__ import annotations

import pytest

import runtime.serve.main as serve
from runtime.launch import SECRET_FILE_ENV


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if serving got as far as creating a process group or a model."""

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the flags were checked")

    monkeypatch.setattr(serve, "init_mesh", forbidden)
    monkeypatch.setattr(serve, "build_model", forbidden)


def _error(capsys, *argv: str) -> str:
    assert serve.main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("runtime.serve: error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--log-every", "0"], "--log-every must be >= 1"),
        (["--log-every", "-3"], "--log-every must be >= 1"),
        (["--storage-retry-s", "-1"], "--storage-retry-s must be >= 0"),
        (["--storage-retry-s", "nan"], "--storage-retry-s must be >= 0"),
        (["--storage-retry-s", "inf"], "--storage-retry-s must be >= 0"),
        (["--storage-root", ""], "--storage-root must not be empty"),
        (["--storage-max-bytes", "0"], "--storage-max-bytes must be >= 1"),
        (["--collective-timeout-s", "0"], "--collective-timeout-s must be > 0"),
        (["--collective-timeout-s", "nan"], "--collective-timeout-s must be > 0"),
        (["--threads", "-1"], "--threads must be >= 0"),
        (["--host-pages", "-1"], "host_pages must be >= 0"),
        (["--device-bytes", "-1"], "device_bytes must be >= 0"),
        (["--device-bytes", "1000"], "a budget of 1000 bytes holds"),
        (["--device-bytes", "100000000", "--host-bytes", "1000"], "a budget of 1000 bytes"),
        (["--device-bytes", "100000000", "--host-bytes", "-2"], "host_bytes must be >= 0"),
        (["--mooncake-buffer-bytes", "-5"], "--mooncake-buffer-bytes must be >= 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),
        (["--token-budget", "-4"], "--token-budget must be >= 1, got -4"),
        (["--request-rate", "0"], "--request-rate must be > 0 requests per second, got 0.0"),
        (["--request-rate", "nan"], "--request-rate must be > 0 requests per second, got nan"),
        (["--request-rate", "inf"], "--request-rate must be > 0 requests per second, got inf"),
        (["--request-rate", "1", "--think-s", "-1"], "--think-s must be >= 0 seconds, got -1.0"),
        (["--think-s", "2"], "--think-s 2.0 needs --request-rate"),
    ],
)
def test_bad_flag_is_refused_before_any_work(no_work, capsys, argv, message):
    assert message in _error(capsys, *argv)


def test_json_directory_must_exist_and_path_must_be_a_file(no_work, capsys, tmp_path):
    missing = tmp_path / "nope" / "out.json"
    assert "does not exist" in _error(capsys, "--json", str(missing))
    assert "is a directory" in _error(capsys, "--json", str(tmp_path))
    assert not missing.parent.exists()


def test_secret_file_is_checked(no_work, capsys, tmp_path):
    assert "cannot read" in _error(capsys, "--storage-secret-file", str(tmp_path / "none"))
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    assert "at least 16 bytes" in _error(capsys, "--storage-secret-file", str(short))


def test_secret_file_default_comes_from_the_environment(monkeypatch, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"k" * 32)
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret))
    args = serve.build_parser().parse_args([])
    assert args.storage_secret_file == str(secret)
    options = serve.cache_config(args).storage_options  # type: ignore[union-attr]
    assert options["secret_file"] == str(secret)
    monkeypatch.delenv(SECRET_FILE_ENV)
    assert serve.build_parser().parse_args([]).storage_secret_file is None


def test_good_flags_pass_and_reach_the_storage_options(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"k" * 32 + b"\n")
    argv = ["--storage-max-bytes", "4096", "--storage-secret-file", str(secret)]
    argv += ["--json", str(tmp_path / "out.json"), "--log-every", "1", "--storage-retry-s", "0"]
    args = serve.build_parser().parse_args(argv)
    serve.check_args(args)
    options = serve.cache_config(args).storage_options  # type: ignore[union-attr]
    assert options["max_bytes"] == 4096 and options["secret_file"] == str(secret)
    assert options["retry_interval_s"] == 0.0
    assert list(tmp_path.iterdir()) == [secret]  # the writability probe left nothing


def test_request_rate_conflicts_with_times_in_the_prompts_file(no_work, capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2], "arrival_s": 3}\n')
    err = _error(capsys, "--prompts", str(prompts), "--request-rate", "2")
    assert "--request-rate: the --prompts file already gives arrival_s" in err
    prompts.write_text('{"input_ids": [1, 2], "arrival_s": -3}\n')
    assert "p.jsonl:1: arrival_s must be a finite" in _error(capsys, "--prompts", str(prompts))


def test_a_bad_prompts_line_stops_serve_before_any_work(no_work, capsys, tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2]}\n{"input_ids": [3, false]}\n')
    assert "p.jsonl:2: 'input_ids' must be a list of ints, not False" in _error(
        capsys, "--prompts", str(prompts)
    )
    prompts.write_text('{"input_ids": [1, 2], "max_new_tokens": true}\n')
    assert "p.jsonl:1: max_new_tokens must be an int >= 1, got True" in _error(
        capsys, "--prompts", str(prompts)
    )
