"""runtime.serve end to end under storage faults: a hostile file root, forged objects
(with and without a secret) and backends raising any exception type. Each must leave the
outputs identical to ``--cache off`` (the forged run without a secret shows the attack)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import runtime.serve.main as serve
from mesh_hicache.storage import FileStorage
from mesh_hicache.storage.keys import KEY_PATTERN, PLAIN_CODEC, ObjectCodec
from tests.serve_cases import SMALL, run_serve

SECRET = b"reliability-test-secret-0123456789"


def _serve(out_dir, name: str, *extra: str, nproc: int = 1) -> tuple[dict, str]:
    drop = ("MESH_HICACHE_STORAGE_SECRET_FILE",)
    run, proc = run_serve(out_dir, name, *extra, nproc=nproc, drop_env=drop)
    return run, proc.stderr


def _outputs(run: dict) -> list[list[int]]:
    return [r["output_ids"] for r in run["requests"]]


@pytest.fixture(scope="module")
def off(tmp_path_factory) -> list[list[int]]:
    run, _ = _serve(tmp_path_factory.mktemp("off"), "off", "--cache", "off")
    return _outputs(run)


def _objects(root) -> list:
    """The object files under ``root`` (before anything is planted)."""
    found = [p for p in root.rglob("*") if p.is_file()]
    return sorted(p for p in found if KEY_PATTERN.fullmatch(str(p.relative_to(root))))


def test_planted_symlinks_leave_outputs_unchanged_and_delete_nothing(tmp_path, off):
    root, outside = tmp_path / "l3", tmp_path / "outside"
    outside.mkdir()
    _serve(tmp_path, "fill", "--storage-root", str(root))
    objects = _objects(root)
    assert len(objects) >= 6
    targets = objects[::3]  # stay regular files
    kept = {p: p.read_bytes() for p in targets}
    links = [p for p in objects if p not in kept]
    for i, p in enumerate(links):
        if i % 2:
            p.unlink()
            p.symlink_to(targets[i % len(targets)])  # key -> another key's object
        else:
            copy = outside / f"copy{i}"
            shutil.copyfile(p, copy)  # a valid-looking object outside the root
            p.unlink()
            p.symlink_to(copy)
    outside_before = {p: p.read_bytes() for p in outside.iterdir()}
    again, stderr = _serve(tmp_path, "again", "--storage-root", str(root))
    assert _outputs(again) == off
    assert stderr.count("refused symlink") == 1
    assert all(p.is_file() and not p.is_symlink() and p.read_bytes() == b for p, b in kept.items())
    assert all(p.is_symlink() for p in links)
    assert {p: p.read_bytes() for p in outside.iterdir()} == outside_before


def test_symlinked_root_directory_is_never_followed(tmp_path, off):
    root, outside = tmp_path / "l3", tmp_path / "outside"
    outside.mkdir()
    root.mkdir()
    (root / "v1").symlink_to(outside, target_is_directory=True)
    run, stderr = _serve(
        tmp_path, "linked", "--storage-root", str(root), "--storage-max-bytes", str(1 << 20)
    )
    assert _outputs(run) == off
    assert list(outside.iterdir()) == [] and (root / "v1").is_symlink()
    assert stderr.count("refused symlink") == 1
    assert run["cache_stats"]["storage_put_dropped"] > 0


def test_symlinked_root_on_four_ranks(tmp_path, off):
    # The original crash: two ranks raised on the path check, the others died on
    # "connection closed". Now every rank refuses the link and serves on.
    root, outside = tmp_path / "l3", tmp_path / "outside"
    outside.mkdir()
    root.mkdir()
    (root / "v1").symlink_to(outside, target_is_directory=True)
    mesh = ["--cp", "2", "--tp", "2", "--cp-kv", "shard", "--storage-root", str(root)]
    run, stderr = _serve(tmp_path, "mesh", *mesh, nproc=4)
    assert _outputs(run) == off
    assert list(outside.iterdir()) == [] and (root / "v1").is_symlink()
    # One warning for the mesh: rank 0's, labelled with its coordinates.
    assert stderr.count("refused symlink") == 1
    assert "[rank (pp, cp, tp) = (0, 0, 0)] " in stderr


def _forge(root, codec: ObjectCodec) -> int:
    """Overwrite every object with a well-formed one holding other (plausible) values, as
    anyone able to write the store can."""
    objects = _objects(root)
    g = torch.Generator().manual_seed(7)
    for p in objects:
        nbytes = int.from_bytes(p.read_bytes()[40:48], "little")  # the header's length
        fake = torch.randn(nbytes // 4, generator=g).numpy().tobytes()
        p.write_bytes(codec.encode_object(str(p.relative_to(root)), fake))
    return len(objects)


def test_forged_objects_with_a_secret_are_misses(tmp_path, off):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    flags = ["--storage-secret-file", str(secret)]
    sealed, plain = tmp_path / "sealed", tmp_path / "plain"
    _serve(tmp_path, "fill-sealed", "--storage-root", str(sealed), *flags)
    _serve(tmp_path, "fill-plain", "--storage-root", str(plain))
    # Forgers without the secret: CRC-valid objects, and objects sealed under a guess.
    assert _forge(sealed, PLAIN_CODEC) > 0 and _forge(plain, PLAIN_CODEC) > 0
    run, stderr = _serve(tmp_path, "sealed", "--storage-root", str(sealed), *flags)
    assert _outputs(run) == off and run["summary"]["cached_storage"] == 0
    assert "unsealed" in stderr
    _forge(sealed, ObjectCodec(b"a guessed secret, not the real one"))
    run, stderr = _serve(tmp_path, "sealed2", "--storage-root", str(sealed), *flags)
    assert _outputs(run) == off and run["summary"]["cached_storage"] == 0
    assert "mac" in stderr
    # Without a secret the same forgery is served: the attack the secret stops.
    attacked, _ = _serve(tmp_path, "plain", "--storage-root", str(plain))
    assert attacked["summary"]["cached_storage"] > 0 and _outputs(attacked) != off


ERRORS = [ValueError, TypeError, KeyError, AssertionError, RuntimeError, OSError, MemoryError]


def test_any_backend_exception_leaves_outputs_unchanged_and_is_counted(tmp_path, off, monkeypatch):
    raised: list[str] = []

    def failing(self, *args, **kwargs):
        error = ERRORS[len(raised) % len(ERRORS)]
        raised.append(error.__name__)
        raise error("injected backend failure")

    for method in ("exists", "get", "put"):
        monkeypatch.setattr(FileStorage, method, failing)
    out = tmp_path / "raising.json"
    argv = [*SMALL, "--storage-root", str(tmp_path / "l3"), "--storage-retry-s", "0"]
    assert serve.main([*argv, "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    assert _outputs(run) == off
    assert set(raised) == {e.__name__ for e in ERRORS}  # every kind was hit
    assert run["cache_stats"]["storage_errors"] == len(raised)
