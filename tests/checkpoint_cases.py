"""Tiny random Hugging Face checkpoints built by transformers itself (no download).

Each case constructs a config class with shapes like the real models (one or two B/C
groups, nope / full / partial RoPE, tied embeddings, multipliers != 1, MoE with several
experts, Nemotron-H's block pattern with a leading MLP and consecutive mixers),
re-draws every weight with a scale that makes the model non-trivial (transformers'
0.02 init gives near-constant logits) and saves it with ``save_pretrained``.
Helpers convert transformers' cache into this runtime's state layout for comparison, and
the checks every checkpoint family shares (prefill logits and state, chunked prefill and
decode, batched decode, greedy tokens, resume from every tier, bfloat16) take a case's
directory, so every family's ``tests/unit/test_checkpoints_*.py`` uses them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
pytest.importorskip("safetensors", reason="needs safetensors (test extra)")

from runtime.checkpoints import load_checkpoint  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.model import HybridModel, SeqState  # noqa: E402

VOCAB = 128
ATOL = 1e-4
PROMPT = 37
CASES = ("granite_moe", "granite_dense", "bamba", "nemotron_h")
DENSE_CASES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
"""Dense attention decoders: no recurrent state, the cache keeps K/V only."""


def _config(case: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    if case == "granite_moe":  # Granite 4.0-H Tiny/Small-like: nope, 1 group, tied, MoE
        return transformers.GraniteMoeHybridConfig(
            **common,
            layer_types=["mamba", "attention", "mamba", "mamba"],
            num_hidden_layers=4,
            mamba_n_heads=8,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_d_head=8,
            mamba_chunk_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=16,
            shared_intermediate_size=24,
            position_embedding_type="nope",
            tie_word_embeddings=True,
            embedding_multiplier=3.0,
            attention_multiplier=0.25,
            residual_multiplier=0.6,
            logits_scaling=2.5,
        )
    if case == "granite_dense":  # Granite 4.0-H Micro-like: dense, full RoPE, untied
        return transformers.GraniteMoeHybridConfig(
            **common,
            layer_types=["mamba", "mamba", "attention"],
            num_hidden_layers=3,
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_d_head=8,
            mamba_chunk_size=16,
            num_local_experts=0,
            shared_intermediate_size=48,
            position_embedding_type="rope",
            tie_word_embeddings=False,
            embedding_multiplier=2.0,
            residual_multiplier=0.8,
            logits_scaling=1.5,
            attention_multiplier=0.3,
        )
    if case == "bamba":  # partial rotary (0.5), 2 groups
        return transformers.BambaConfig(
            **common,
            num_hidden_layers=3,
            attn_layer_indices=[1],
            intermediate_size=48,
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_d_head=8,
            mamba_chunk_size=16,
        )
    if case in DENSE_CASES:
        return _dense_config(case, common)
    assert case == "nemotron_h"  # block pattern "-ME*-MM", group-limited sigmoid router
    return transformers.NemotronHConfig(
        **common,
        layers_block_type=[
            "mlp",
            "linear_attention",
            "moe",
            "full_attention",
            "mlp",
            "linear_attention",
            "linear_attention",
        ],  # fmt: skip
        head_dim=8,
        intermediate_size=48,
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=2,
        chunk_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=16,
        routed_scaling_factor=1.5,
        # transformers 5.24 clamped the SSM step below at time_step_min, 5.25 clamps it to
        # time_step_limit (the runtime's rule): a limit from time_step_min makes the two
        # oracles agree, and the clamp still binds (random weights give smaller steps).
        time_step_limit=(0.001, float("inf")),
    )


def _dense_config(case: str, common: dict):
    common = dict(common, num_hidden_layers=3, intermediate_size=48, rms_norm_eps=1e-5)
    if case == "llama":  # Llama 3.1-like: llama3 RoPE scaling, tied embeddings
        rope = {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        }  # fmt: skip
        return transformers.LlamaConfig(
            **common, rope_parameters=rope, tie_word_embeddings=True, max_position_embeddings=128
        )
    if case == "mistral":  # no sliding window (Mistral 7B v0.2 and later), head_dim given
        return transformers.MistralConfig(**common, head_dim=8, sliding_window=None)
    if case == "qwen2":  # q/k/v biases
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    if case == "qwen3":  # per-head q/k RMSNorm, head_dim != hidden / heads
        return transformers.Qwen3Config(**common, head_dim=16)
    assert case == "qwen3_moe"  # experts on layers 0 and 2, a dense MLP on layer 1
    return transformers.Qwen3MoeConfig(
        **common,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_only_layers=[1],
        norm_topk_prob=False,
    )


_MODELS = {
    "granite_moe": "GraniteMoeHybridForCausalLM",
    "granite_dense": "GraniteMoeHybridForCausalLM",
    "bamba": "BambaForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def randn(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if not p.is_floating_point() or "inv_freq" in name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 15 + 1))
        elif leaf == "D":
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif leaf == "dt_bias":
            lo, hi = math.log(1e-3), math.log(1e-1)
            dt0 = torch.exp(torch.rand(p.shape, generator=gen) * (hi - lo) + lo)
            p.copy_(dt0 + torch.log(-torch.expm1(-dt0)))
            p[:2] = -10.0  # softplus ~ 5e-5: below Nemotron-H's dt clamp (1e-3)
        elif leaf == "e_score_correction_bias":
            p.copy_(randn(p.shape) * 0.1)
        elif p.dim() == 1 and "norm" in name:
            p.copy_(1 + 0.1 * randn(p.shape))
        elif p.dim() == 1:  # conv bias
            p.copy_(0.1 * randn(p.shape))
        elif "conv1d" in name:
            p.copy_(0.5 * randn(p.shape))
        elif "embed" in name:
            p.copy_(randn(p.shape))
        else:
            p.copy_(randn(p.shape) * p.shape[-1] ** -0.5)


def build(case: str, root: Path, seed: int = 0) -> Path:
    """Save case ``case`` under ``root / case`` (once) and return the directory."""
    directory = root / case
    if not (directory / "config.json").exists():
        model = getattr(transformers, _MODELS[case])(_config(case)).eval()
        _redraw(model, seed)
        model.save_pretrained(directory)
    return directory


def hf_model(directory: Path, dtype: torch.dtype = torch.float32):
    """The checkpoint loaded by transformers (eager attention)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation="eager"
    ).eval()


def hf_layer_index(case: str, config, layer: int) -> int:
    """transformers' layer index of this runtime's cache layer ``layer`` (its mixer block):
    Nemotron-H has one block per layer, Granite / Bamba two (mixer, feed-forward)."""
    blocks = config.layer_blocks()[layer]
    mixer = next(b for b in blocks if config.blocks[b] in "AS")
    return mixer if case == "nemotron_h" else mixer // 2


def hf_conv_to_runtime(conv: torch.Tensor, config) -> torch.Tensor:
    """transformers' conv state ``[x | B | C, K]`` -> this runtime's ``[group-major, K-1]``."""
    c = config
    p, n, g = c.ssm_head_dim, c.ssm_state_dim, c.num_groups
    inner, width = c.ssm_heads * p, c.ssm_heads // g * p
    rows = []
    for group in range(g):
        rows.append(conv[group * width : (group + 1) * width])
        rows.append(conv[inner + group * n : inner + (group + 1) * n])
        rows.append(conv[inner + g * n + group * n : inner + g * n + (group + 1) * n])
    return torch.cat(rows)[:, -(c.conv_kernel - 1) :]


def prompt_ids(n: int, seed: int = 3) -> torch.Tensor:
    """``n`` random token ids below 128 (seeded)."""
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


def hf_logits(directory: Path, ids: torch.Tensor, dtype: torch.dtype = torch.float32):
    """transformers' logits ``[len(ids), vocab]`` (as float32) of one full forward over the
    1-D token ids ``ids``, with the checkpoint's weights in ``dtype``."""
    with torch.no_grad():
        return hf_model(directory, dtype)(ids[None]).logits[0].float()


def assert_prefill_equals_transformers(
    directory: Path,
    hf_index: Callable[[object, int], int],
    conv_to_runtime: Callable[[torch.Tensor, object], torch.Tensor],
    ssm_to_runtime: Callable[[torch.Tensor], torch.Tensor] | None,
) -> SeqState:
    """Prefill logits of a ``PROMPT``-token prompt and the state after it (every KV, conv
    and recurrent layer) equal transformers' logits and cache within ``ATOL``.
    ``hf_index(config, layer)`` is transformers' layer index of cache layer ``layer``.
    Every layer keeps K/V, a conv state, or both (parallel layers); ``ssm_to_runtime``
    None: the family keeps no recurrent state (``state.ssm`` must be empty). Returns the
    runtime's state after the prefill, for a family's own checks."""
    ckpt = load_checkpoint(directory)
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    ids = prompt_ids(PROMPT)
    hf = hf_model(directory)
    with torch.no_grad():
        out = hf(ids[None], position_ids=torch.arange(PROMPT)[None], use_cache=True)
    want = out.logits[0].float()
    assert want.abs().max() > 1.0  # a non-trivial model
    state = model.new_state()
    got = model.prefill(ids, state, all_logits=True)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    c = ckpt.config
    if ssm_to_runtime is None:
        assert state.ssm == {}
    for layer in range(c.num_layers):
        idx = hf_index(c, layer)
        assert layer in state.k or layer in state.conv, layer
        if layer in state.k:
            keys = out.cache.layers[idx].keys[0].transpose(0, 1)
            values = out.cache.layers[idx].values[0].transpose(0, 1)
            torch.testing.assert_close(state.k[layer], keys, atol=ATOL, rtol=0)
            torch.testing.assert_close(state.v[layer], values, atol=ATOL, rtol=0)
        if layer in state.conv:
            conv = conv_to_runtime(out.cache.get_conv_state(idx, state_idx=0)[0], c)
            torch.testing.assert_close(state.conv[layer], conv, atol=ATOL, rtol=0)
        if layer in state.conv and ssm_to_runtime is not None:
            ssm = ssm_to_runtime(out.cache.get_recurrent_state(idx, state_idx=0)[0])
            torch.testing.assert_close(state.ssm[layer], ssm, atol=ATOL, rtol=0)
    return state


def greedy_reference(hf, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of transformers model ``hf`` after ``prompt``: each the argmax
    of a full forward over the sequence so far (no KV cache, so no release's cache
    handling is involved; see :func:`assert_greedy_equals_generate`)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            logits = hf(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def assert_greedy_equals_generate(directory: Path) -> None:
    """Eight greedy tokens from the engine equal transformers' greedy decoding, each token
    the argmax of a full forward over the sequence so far. Not ``generate``: its cache
    changes between releases (transformers 5.25 asks layer 0 for the sequence length,
    which a leading MLP block, as in Nemotron-H's ``-M...``, does not track)."""
    ckpt = load_checkpoint(directory)
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    prompt = prompt_ids(21, seed=5)
    want = greedy_reference(hf_model(directory), prompt.tolist(), 8)
    got = Engine(model, None, max_new_tokens=8).serve(prompt.tolist()).output_ids
    assert got == want


def assert_resume_from_every_tier(topology, directory: Path, tmp_path: Path) -> None:
    """Resuming from L1, L2 and L3 (``tests.engine_cases.resume_scenarios``) hits the
    tier and equals recompute (logits within its ATOL, same tokens)."""
    from tests.engine_cases import ATOL as RESUME_ATOL
    from tests.engine_cases import resume_scenarios

    checks = resume_scenarios(topology, root=str(tmp_path), checkpoint=str(directory))
    for c in checks:
        assert c.cached > 0, f"{c.label}: expected a {c.tier} hit"
        assert c.max_diff < RESUME_ATOL, f"{c.label}: logits differ by {c.max_diff}"
        assert c.tokens_equal, c.label
    assert {c.tier for c in checks} == {"device", "host", "storage"}


def assert_chunked_prefill_and_decode_equal(
    directory: Path,
    length: int,
    paged: bool,
    chunks: Sequence[int] = (5, 11),
    page_ids: Sequence[int] = (5, 2, 7, 0),
    want: torch.Tensor | None = None,
) -> None:
    """``prompt_ids(length)`` prefilled in chunks of ``chunks`` tokens, then the rest decoded
    one token at a time: every position's logits equal ``want`` (default: transformers'
    full forward, :func:`hf_logits`) within ``ATOL``. The state is contiguous, or with
    ``paged`` it lives in pages ``page_ids`` of an 8-page, one-slot device pool."""
    from mesh_hicache.pools.device import DevicePools

    ckpt = load_checkpoint(directory)
    ids = prompt_ids(length)
    if want is None:
        want = hf_logits(directory, ids)
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    state = model.new_state()
    if paged:
        pools = DevicePools(model.layout, num_pages=8, num_slots=1)
        state = model.paged_state(pools, list(page_ids))
    got, start = [], 0
    for n in chunks:
        got.append(model.prefill(ids[start : start + n], state, all_logits=True))
        start += n
    for i in range(start, length):
        got.append(model.decode(int(ids[i]), state)[None])
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)


def assert_decode_batch_equals_one_by_one(
    directory: Path,
    prompts: Sequence[torch.Tensor] | None = None,
    tokens: Sequence[int] = (7, 100, 31),
    atol: float = 1e-5,
) -> tuple[list[SeqState], list[SeqState]]:
    """One ``decode_batch`` step of ``tokens`` after ``prompts`` (default: prompts of 9,
    14 and 3 tokens) equals each request's own ``decode`` within ``atol``. Returns the
    batch's states and the one-by-one states after that step, for a family's own checks."""
    ckpt = load_checkpoint(directory)
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    if prompts is None:
        prompts = [prompt_ids(n, seed=n) for n in (9, 14, 3)]
    states = [model.new_state() for _ in prompts]
    alone = [model.new_state() for _ in prompts]
    for p, s, a in zip(prompts, states, alone, strict=True):
        model.prefill(p, s)
        model.prefill(p, a)
    batch = model.decode_batch(list(tokens), states)
    one = torch.stack([model.decode(t, a) for t, a in zip(tokens, alone, strict=True)])
    torch.testing.assert_close(batch, one, atol=atol, rtol=0)
    return states, alone


def assert_bfloat16_close_to_transformers(directory: Path, length: int) -> HybridModel:
    """bfloat16 rounding moves transformers' own logits (over ``prompt_ids(length)``) away
    from its float32 ones, by more than 0 and less than half their scale; this runtime's
    bfloat16 logits must stay as close to float32 as transformers' bfloat16 (at most 1.5x
    its error). Returns the bfloat16 model, for checks of its weights' dtype."""
    ckpt = load_checkpoint(directory, dtype=torch.bfloat16)
    model = HybridModel(ckpt.config, weights=ckpt.weights)
    ids = prompt_ids(length)
    exact = hf_logits(directory, ids)
    theirs = hf_logits(directory, ids, torch.bfloat16)
    got = model.prefill(ids, model.new_state(), all_logits=True)
    their_err = (theirs - exact).abs().max()
    assert 0 < their_err < 0.5 * exact.abs().max()
    assert (got - exact).abs().max() <= 1.5 * their_err
    return model
