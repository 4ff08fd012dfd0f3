"""The content identity of a checkpoint, and the cache keyed by it.

Two tiny Granite-4.0-H-style checkpoints saved by transformers from one config with
different weight seeds, each in a folder of the same name: byte-identical
``config.json``, equal file sizes, other weights. Their identities differ; one storage
root never serves one model's objects to the other (its L3 tokens are 0 until it wrote
its own, its logits equal its own run alone within the cached == recompute bar, 1e-4).
Each test points ``XDG_CACHE_HOME`` at its own folder, so the digest index starts empty
and the counters of ``mesh_hicache.identity`` show what was hashed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (test extra)")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")

from mesh_hicache import identity  # noqa: E402
from mesh_hicache.cache import HiCache  # noqa: E402
from mesh_hicache.config import HiCacheConfig  # noqa: E402
from mesh_hicache.identity import checkpoint_model_id, hash_counts  # noqa: E402
from mesh_hicache.spec import KVSpec, StateSpec  # noqa: E402
from runtime.checkpoints import choose_model, load_checkpoint  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.model import HybridModel  # noqa: E402
from tests.checkpoint_cases import build, prompt_ids  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-4
PAGE = 16


@pytest.fixture(autouse=True)
def _own_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> tuple[Path, Path]:
    """Same config, same sizes, other weights; both folders are named ``granite_moe``."""
    root = tmp_path_factory.mktemp("twins")
    one = build("granite_moe", root / "one", seed=0)
    two = build("granite_moe", root / "two", seed=1)
    return one, two


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def test_twins_share_config_and_sizes_but_not_identity(twins) -> None:
    one, two = twins
    a, b = _files(one), _files(two)
    assert a["config.json"] == b["config.json"]
    assert {k: len(v) for k, v in a.items()} == {k: len(v) for k, v in b.items()}
    assert a["model.safetensors"] != b["model.safetensors"]
    id_one, id_two = checkpoint_model_id(one), checkpoint_model_id(two)
    assert id_one != id_two
    assert id_one.startswith(identity.ID_PREFIX) and len(id_one) == len(identity.ID_PREFIX) + 64
    # The runtime's model ids (what goes into the storage namespace) differ too.
    assert load_checkpoint(one).config.model_id != load_checkpoint(two).config.model_id


def test_one_changed_tensor_is_another_identity(twins, tmp_path: Path) -> None:
    one, _ = twins
    copy = tmp_path / "edited"
    shutil.copytree(one, copy)
    path = copy / "model.safetensors"
    tensors = safetensors_torch.load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1e-3
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})
    assert checkpoint_model_id(copy) != checkpoint_model_id(one)


def test_a_copy_and_a_symlink_keep_the_identity(twins, tmp_path: Path) -> None:
    one, _ = twins
    want = checkpoint_model_id(one)
    copy = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(one, copy)
    assert checkpoint_model_id(copy) == want
    link = tmp_path / "link"
    link.symlink_to(one, target_is_directory=True)
    before = hash_counts()
    assert checkpoint_model_id(link) == want
    assert hash_counts().files_hashed == before.files_hashed  # the real path is indexed


def test_a_restart_does_not_rehash(twins, tmp_path: Path) -> None:
    one, _ = twins
    before = hash_counts()
    want = checkpoint_model_id(one)
    hashed = hash_counts()
    assert hashed.files_hashed - before.files_hashed == 2  # config.json, model.safetensors
    files = _files(one)
    assert hashed.bytes_hashed - before.bytes_hashed == sum(
        len(files[name]) for name in ("config.json", "model.safetensors")
    )
    # A new process with the same per-user index: nothing hashed, the same id.
    code = (
        "import json, sys; from mesh_hicache import identity as i; "
        "mid = i.checkpoint_model_id(sys.argv[1]); c = i.hash_counts(); "
        "print(json.dumps([mid, c.files_hashed, c.bytes_hashed, c.index_hits]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code, str(one)], env=env, capture_output=True, text=True, check=True
    )
    mid, files, nbytes, hits = json.loads(out.stdout)
    assert (mid, files, nbytes, hits) == (want, 0, 0, 2)


def test_a_touched_file_is_rehashed_and_a_corrupt_index_ignored(twins, tmp_path: Path) -> None:
    one, _ = twins
    copy = tmp_path / "c"
    shutil.copytree(one, copy)
    want = checkpoint_model_id(copy)
    before = hash_counts()
    os.utime(copy / "config.json", ns=(1, 1))
    assert checkpoint_model_id(copy) == want
    assert hash_counts().files_hashed == before.files_hashed + 1
    identity.default_index_path().write_text("{not json")
    assert checkpoint_model_id(copy) == want
    assert hash_counts().files_hashed == before.files_hashed + 3
    assert json.loads(identity.default_index_path().read_text())["format"] == 1


def test_extra_items_and_numbers_files_count(twins, tmp_path: Path) -> None:
    one, _ = twins
    base = checkpoint_model_id(one)
    assert checkpoint_model_id(one, extra={"dtype": "bfloat16"}) != base
    assert checkpoint_model_id(one, extra={"dtype": "bfloat16"}) == checkpoint_model_id(
        one, extra={"dtype": "bfloat16"}
    )
    copy = tmp_path / "gen"
    shutil.copytree(one, copy)
    (copy / "generation_config.json").write_text('{"temperature": 0.1}')
    (copy / "tokenizer.json").write_text("{}")
    assert checkpoint_model_id(copy) == base  # sampling and text files: same numbers
    with pytest.raises(ValueError, match="no weight file"):
        checkpoint_model_id(tmp_path / "xdg")
    with pytest.raises(TypeError, match="str to str"):
        checkpoint_model_id(one, extra={"dtype": torch.float32})  # type: ignore[dict-item]


def test_progress_lines_for_a_large_checkpoint(twins, monkeypatch: pytest.MonkeyPatch) -> None:
    one, _ = twins
    monkeypatch.setattr(identity, "PROGRESS_BYTES", 1)
    lines: list[str] = []
    checkpoint_model_id(one, progress=lines.append)
    assert lines[0].startswith("hashing checkpoint") and lines[-1].endswith("100%")


def test_state_spec_without_model_id_names_the_helper() -> None:
    kv = KVSpec(layer_ids=(0,), num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match=r"model_id is required.*checkpoint_model_id"):
        StateSpec(page_size=4, kv=kv)
    with pytest.raises(ValueError, match="checkpoint_model_id"):
        StateSpec(page_size=4, kv=kv, model_id="")


def test_explicit_model_id_is_the_users_and_presets_keep_theirs(twins, tmp_path) -> None:
    one, two = twins
    a = choose_model(str(one), torch.float32, model_id="org/granite@rev1").config.model_id
    b = choose_model(str(two), torch.float32, model_id="org/granite@rev1").config.model_id
    assert a == b and a.startswith("user-org/granite@rev1-")  # the user vouches for it
    assert a != load_checkpoint(one).config.model_id
    with pytest.raises(ValueError, match="--model-id is for checkpoint directories"):
        choose_model("tiny", torch.float32, model_id="x")
    seeded = [choose_model("tiny", torch.float32, seed=s).config.model_id for s in (0, 1)]
    assert (
        seeded[0] != seeded[1] and seeded[0] == choose_model("tiny", torch.float32).config.model_id
    )


# -- one storage root, two models ---------------------------------------------------------------


def _serve(directory: Path, topology, root: Path | None, prompts) -> list:
    ckpt = load_checkpoint(directory)
    model = HybridModel(ckpt.config, topology, page_size=PAGE, weights=ckpt.weights)
    cache = None
    if root is not None:
        cfg = HiCacheConfig(
            device_pages=64,
            host_pages=256,
            storage="file",
            storage_options={"root": str(root)},
            prefetch_threshold=1,
        )
        cache = HiCache(topology, ckpt.config.state_spec(PAGE), cfg)
    engine = Engine(model, cache, max_new_tokens=2, keep_logits=True)
    try:
        return [engine.serve(p) for p in prompts]
    finally:
        if cache is not None:
            cache.flush()
            cache.close()


def _max_diff(a, b) -> float:
    return max(
        float((torch.tensor(x.last_logits) - torch.tensor(y.last_logits)).abs().max())
        for x, y in zip(a, b, strict=True)
    )


def test_two_checkpoints_on_one_storage_root_never_share(twins, one_rank_topology, tmp_path):
    one, two = twins
    root = tmp_path / "l3"
    base = prompt_ids(60, seed=4).tolist()
    prompts = [base, base + prompt_ids(20, seed=5).tolist()]
    first = _serve(one, one_rank_topology, root, prompts)
    assert sum(r.cached_storage for r in first) == 0
    stored = sorted(p for p in root.rglob("*") if p.is_file())
    assert stored
    alone = _serve(two, one_rank_topology, None, prompts)
    second = _serve(two, one_rank_topology, root, prompts)
    assert [r.cached_storage for r in second] == [0, 0]
    assert _max_diff(second, alone) < ATOL
    # The first model's objects are still there (a miss never deletes) ...
    assert all(p.exists() for p in stored)
    # ... and once the second model wrote its own, it reads them.
    third = _serve(two, one_rank_topology, root, prompts)
    assert third[0].cached_storage > 0
    assert _max_diff(third, alone) < ATOL
    # The first model still reads its own.
    again = _serve(one, one_rank_topology, root, prompts)
    assert again[0].cached_storage > 0 and _max_diff(again, first) < ATOL


def test_objects_under_the_old_size_based_id_are_a_miss(twins, one_rank_topology, tmp_path):
    # Before content identity, a checkpoint's id was model_type + a digest of config.json
    # and the weight files' names and sizes: the twins had the same one. Objects stored
    # under it are never read under the new id, and reading does not delete them.
    import dataclasses
    import hashlib

    one, two = twins

    def old_style_id(directory: Path) -> str:
        h = hashlib.sha256((directory / "config.json").read_bytes())
        for path in sorted(directory.glob("*.safetensors")):
            h.update(f"{path.name}:{path.stat().st_size}".encode())
        return f"granitemoehybrid-{h.hexdigest()[:16]}-float32"

    old_id = old_style_id(one)
    assert old_style_id(two) == old_id  # the flaw: the twins shared it
    ckpt = load_checkpoint(one)
    assert ckpt.config.model_id != old_id
    root = tmp_path / "l3"
    prompt = prompt_ids(60, seed=4).tolist()
    cfg = HiCacheConfig(
        device_pages=64, storage="file", storage_options={"root": str(root)}, prefetch_threshold=1
    )
    old_spec = dataclasses.replace(ckpt.config.state_spec(PAGE), model_id=old_id)
    model = HybridModel(ckpt.config, one_rank_topology, page_size=PAGE, weights=ckpt.weights)
    cache = HiCache(one_rank_topology, old_spec, cfg)
    Engine(model, cache, max_new_tokens=2).serve(prompt)
    cache.flush()
    cache.close()
    stored = sorted(p for p in root.rglob("*") if p.is_file())
    for directory in (one, two):
        result = _serve(directory, one_rank_topology, root, [prompt])[0]
        assert result.cached_storage == 0
    assert all(p.exists() for p in stored)
