"""The model on a mesh gives the one-device logits: prefill, resume, greedy decode.

Tolerance: float32 with ATOL = RTOL = 1e-4. Only the order of floating-point sums
differs from one device: tp all-reduces add partial matmuls, cp chains SSM chunk states
and corrects outputs instead of one scan, and sharded decode attention merges partial
softmaxes by log-sum-exp. Measured: max |logit difference| ~5e-6 for logits of
magnitude ~4 (1x1x2, 1x2x2 shard with a prefix, 2x2x2 shard), so 1e-4 has a 20x margin.
"""

from __future__ import annotations

import pytest
import torch

from mesh_hicache.topology import MeshTopology
from runtime.model import HybridModel, kv_shard_positions, preset
from tests.distributed.harness import run_on_mesh

ATOL = RTOL = 1e-4
PAGE = 8
NUM_DECODE = 8
PROMPT = 29  # not divisible by cp=2 or 4


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(7))


def _run(model: HybridModel, tokens: torch.Tensor, prefix_len: int) -> dict:
    """Prefill (in two parts when prefix_len > 0), then greedy decode."""
    state = model.new_state()
    if prefix_len:
        model.prefill(tokens[:prefix_len], state)
    logits = [model.prefill(tokens[prefix_len:], state)]
    out_ids = []
    for _ in range(NUM_DECODE):
        out_ids.append(int(logits[-1].argmax()))
        logits.append(model.decode(out_ids[-1], state))
    return {"logits": torch.stack(logits), "ids": out_ids, "state": state}


def _body(mesh, overrides: dict, cp_kv: str, prefix_len: int) -> dict:
    topo = MeshTopology.from_mesh(mesh)
    model = HybridModel(preset("tiny", **overrides), topo, cp_kv=cp_kv, page_size=PAGE)
    got = _run(model, _tokens(PROMPT), prefix_len)
    full = model.prefill(_tokens(PROMPT), model.new_state(), all_logits=True)
    state = got.pop("state")
    got.update(
        coords=topo.coords,
        layers=model.local_layers,
        all_logits=full,
        k={i: t.clone() for i, t in state.k.items()},
        ssm={i: t.clone() for i, t in state.ssm.items()},
        conv={i: t.clone() for i, t in state.conv.items()},
    )
    return got


def _check(shape, overrides: dict, cp_kv: str, prefix_len: int) -> None:
    config = preset("tiny", **overrides)
    ref_model = HybridModel(config)
    ref = _run(ref_model, _tokens(PROMPT), 0)
    ref_all = ref_model.prefill(_tokens(PROMPT), ref_model.new_state(), all_logits=True)
    results = run_on_mesh(shape, _body, overrides, cp_kv, prefix_len, timeout=120)
    pp, cp, tp = shape
    ref_state = ref["state"]
    seen_layers = set()
    for res in results:
        assert res["ids"] == ref["ids"]
        torch.testing.assert_close(res["logits"], ref["logits"], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(res["all_logits"], ref_all, atol=ATOL, rtol=RTOL)
        _, c, t = res["coords"]
        seen_layers.update(res["layers"])
        # The state the engine stores: this rank's tp shard of the one-device state.
        total = PROMPT + NUM_DECODE
        for lid, k in res["k"].items():
            if config.num_kv_heads >= tp:
                kv_heads = config.num_kv_heads // tp
                head0 = t * kv_heads
            else:  # replicated: the KV head of this rank's first query head
                kv_heads = 1
                head0 = (t * config.num_heads // tp) // (config.num_heads // config.num_kv_heads)
            want = ref_state.k[lid][:, head0 : head0 + kv_heads]
            if cp_kv == "shard":
                want = want[kv_shard_positions(total, PAGE, cp, c)]
            torch.testing.assert_close(k, want, atol=ATOL, rtol=RTOL)
        for lid, ssm in res["ssm"].items():
            heads = config.ssm_heads // tp
            want = ref_state.ssm[lid][t * heads : (t + 1) * heads]
            torch.testing.assert_close(ssm, want, atol=ATOL, rtol=RTOL)
            channels = config.conv_dim // tp
            want = ref_state.conv[lid][t * channels : (t + 1) * channels]
            torch.testing.assert_close(res["conv"][lid], want, atol=ATOL, rtol=RTOL)
    assert seen_layers == set(range(config.num_layers))


@pytest.mark.parametrize(
    ("shape", "cp_kv"),
    [
        ((1, 1, 2), "replicate"),
        ((1, 2, 1), "replicate"),
        ((1, 2, 1), "shard"),
        ((2, 1, 1), "replicate"),
        ((1, 2, 2), "replicate"),
        ((1, 2, 2), "shard"),
        ((2, 2, 1), "shard"),
        ((2, 2, 2), "shard"),
    ],
)
def test_mesh_logits_equal_one_rank(shape, cp_kv: str) -> None:
    _check(shape, {}, cp_kv, prefix_len=0)


@pytest.mark.parametrize("prefix_len", [16, 13, 28])
@pytest.mark.parametrize("cp_kv", ["replicate", "shard"])
def test_resume_on_mesh(prefix_len: int, cp_kv: str) -> None:
    # 28 leaves a one-token suffix: fewer new tokens than cp ranks.
    _check((1, 2, 2), {}, cp_kv, prefix_len)


@pytest.mark.parametrize(("shape", "kv_heads"), [((1, 1, 4), 2), ((1, 2, 2), 1)])
def test_fewer_kv_heads_than_tp(shape, kv_heads: int) -> None:
    _check(shape, {"num_kv_heads": kv_heads}, "shard" if shape[1] > 1 else "replicate", 13)


def test_pipeline_with_uneven_stages() -> None:
    # 7 layers over 2 stages: 4 + 3; gelu MLP.
    overrides = {"layer_pattern": "SASSSAS", "mlp_kind": "gelu"}
    _check((2, 1, 2), overrides, "replicate", 16)
