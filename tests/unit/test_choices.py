"""The choice enums: one definition each, plain strings accepted, used by config and CLI."""

from __future__ import annotations

import json

import pytest

from mesh_hicache.choices import (
    CpKvMode,
    PrefetchPolicy,
    RegionName,
    StorageKind,
    TransferBackend,
    WritePolicy,
)
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.layout import StateLayout
from runtime.serve.flags import build_parser, cache_config


def test_members_behave_like_their_strings():
    assert WritePolicy.WRITE_BACK == "write_back" and "write_back" == WritePolicy.WRITE_BACK
    assert {"write_back": 1}[WritePolicy.WRITE_BACK] == 1
    assert str(PrefetchPolicy.TIMEOUT) == "timeout" and f"{CpKvMode.SHARD}" == "shard"
    assert json.dumps({"p": StorageKind.FILE}) == '{"p": "file"}'
    assert RegionName.MAMBA_SSM.value == "mamba_ssm"
    assert StorageKind.backends() == ("file", "mooncake")
    assert TransferBackend.values() == ("auto", "cpu", "cuda")


def test_parse_names_the_value_and_the_choices():
    assert WritePolicy.parse("write_through", "w") is WritePolicy.WRITE_THROUGH
    assert WritePolicy.parse(WritePolicy.WRITE_BACK, "w") is WritePolicy.WRITE_BACK
    with pytest.raises(ValueError, match=r"w='nope'; choose from \('write_through', "):
        WritePolicy.parse("nope", "w")


@pytest.mark.parametrize(
    ("field", "enum_type"),
    [
        ("write_policy", WritePolicy),
        ("prefetch_policy", PrefetchPolicy),
        ("storage", StorageKind),
        ("cp_kv", CpKvMode),
        ("transfer", TransferBackend),
    ],
)
def test_config_takes_strings_and_stores_members(field, enum_type):
    for value in enum_type.values():
        extra = {"storage_options": {"root": "/tmp/x"}} if field == "storage" else {}
        cfg = HiCacheConfig(device_pages=8, **{field: value}, **extra)
        assert getattr(cfg, field) is enum_type(value)
    with pytest.raises(ValueError, match=f"HiCacheConfig.{field}='bogus'; choose from"):
        HiCacheConfig(device_pages=8, **{field: "bogus"})


def test_serve_flags_offer_exactly_the_enum_values():
    actions = {a.dest: a for a in build_parser()._actions}
    assert tuple(actions["write_policy"].choices) == WritePolicy.values()
    assert tuple(actions["prefetch_policy"].choices) == PrefetchPolicy.values()
    assert tuple(actions["cp_kv"].choices) == CpKvMode.values()
    assert tuple(actions["storage"].choices) == StorageKind.backends()
    args = build_parser().parse_args(["--write-policy", "write_back", "--cp-kv", "shard"])
    cfg = cache_config(args)
    assert cfg is not None
    assert cfg.write_policy is WritePolicy.WRITE_BACK and cfg.cp_kv is CpKvMode.SHARD
    assert cfg.storage is StorageKind.FILE


def test_layout_takes_the_string_or_the_member():
    from tests.unit.cache_support import make_spec

    a = StateLayout.for_coords(make_spec(), (1, 2, 1), (0, 1, 0), "shard")
    b = StateLayout.for_coords(make_spec(), (1, 2, 1), (0, 1, 0), CpKvMode.SHARD)
    assert a.cp_kv is b.cp_kv is CpKvMode.SHARD
    assert a.page_size_local == b.page_size_local == 2
    with pytest.raises(ValueError, match="cp_kv='bogus'"):
        StateLayout.for_coords(make_spec(), (1, 1, 1), (0, 0, 0), "bogus")


def test_other_choice_lists_derive_from_the_enums():
    from mesh_hicache.storage.factory import STORAGE_KINDS
    from mesh_hicache.storage.keys import REGIONS
    from runtime.model.config import ModelConfig

    assert STORAGE_KINDS == StorageKind.backends() and REGIONS == RegionName.values()
    config = ModelConfig()
    config.check_mesh(tp=1, cp=2, pp=1, page_size=4, cp_kv=CpKvMode.SHARD)
    with pytest.raises(ValueError, match="cp_kv='bogus'; choose from"):
        config.check_mesh(tp=1, cp=1, pp=1, page_size=4, cp_kv="bogus")
    with pytest.raises(ValueError, match="divisible by cp=2"):
        config.check_mesh(tp=1, cp=2, pp=1, page_size=3, cp_kv="shard")
