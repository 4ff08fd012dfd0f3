"""Prefill and decode speed of this runtime vs transformers on the same checkpoint.

    python scripts/bench_model.py                        # builds a Granite-4.0-H-like checkpoint
    python scripts/bench_model.py --model /models/ckpt --lengths 256 1024 --threads 2
    python scripts/bench_model.py --arch nemotron_h --json out.json
    python scripts/bench_model.py --arch deepseek_v32 --lengths 256 1024   # MLA + DSA
    python scripts/bench_model.py --arch jamba --lengths 256 1024          # Mamba-1 + MoE
    python scripts/bench_model.py --arch falcon_h1 --lengths 256 1024      # attention || Mamba-2

One process, one rank, float32, pinned threads (``--threads``; the process is also
pinned to that many cores when the OS allows). For each prefill length the two
implementations run alternately (runtime, transformers, runtime, ...) ``--repeats``
times after a warm-up; the median (and the best) wall time count; decode is ``--decode`` steps
after a prefill of the first length. transformers runs its eager PyTorch path (its
kernels packages are not installed here) with ``logits_to_keep=1`` as ``generate`` does.
Prints tokens/s and the ratio runtime / transformers (> 1: the runtime is faster).

    python scripts/bench_model.py --batch 1 4 16          # decode_batch vs B decodes, small
    python scripts/bench_model.py --batch 4 16 --model /models/ckpt --paged

``--batch B...``: instead, batched decode of the runtime alone (the ``--preset``, default
``small``, or ``--model``): B sequences of different lengths (``--lengths[0]`` + 16 i
tokens) decode ``--decode`` steps with one ``decode_batch`` per step (A) and with B
``decode`` calls per step (B), alternating A/B ``--repeats`` times from the same states;
median tokens/s of each and the ratio A / B (> 1: batching is faster). ``--paged`` puts
the states in L1 pool pages (``paged_state``) instead of contiguous tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.checkpoints import load_checkpoint  # noqa: E402
from runtime.model import HybridModel, preset  # noqa: E402

ARCHS = (
    "granite_moe", "granite_dense", "bamba", "nemotron_h", "qwen3_next", "qwen35", "deepseek_v32",
    "gpt_oss", "gemma3", "jamba", "falcon_h1",
)  # fmt: skip


def build_checkpoint(arch: str, directory: Path) -> Path:
    """A random checkpoint of a small but realistically shaped model (~40M parameters)."""
    import transformers

    model: Any
    config: Any
    common: dict[str, Any] = dict(
        vocab_size=8192, hidden_size=512, num_attention_heads=8, num_key_value_heads=2
    )
    mamba: dict[str, Any] = dict(
        mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=256
    )
    layers = ["mamba"] * 3 + ["attention"] + ["mamba"] * 3 + ["attention"]
    if arch in ("granite_moe", "granite_dense"):
        moe = arch == "granite_moe"
        config = transformers.GraniteMoeHybridConfig(
            **common,
            **mamba,
            mamba_n_groups=1,
            layer_types=layers,
            num_hidden_layers=len(layers),
            num_local_experts=8 if moe else 0,
            num_experts_per_tok=2,
            intermediate_size=512,
            shared_intermediate_size=1024,
            position_embedding_type="nope",
            tie_word_embeddings=True,
        )
        model = transformers.GraniteMoeHybridForCausalLM(config)
    elif arch in ("qwen3_next", "qwen35"):  # Gated DeltaNet hybrids, 3 linear : 1 full
        gdn: dict[str, Any] = dict(
            **common,
            head_dim=64,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            layer_types=["linear_attention" if k == "mamba" else "full_attention" for k in layers],
            num_hidden_layers=len(layers),
            intermediate_size=1536,
        )
        if arch == "qwen3_next":
            config = transformers.Qwen3NextConfig(
                **gdn,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=512,
                shared_expert_intermediate_size=512,
            )
            model = transformers.Qwen3NextForCausalLM(config)
        else:
            config = transformers.Qwen3_5TextConfig(**gdn)
            model = transformers.Qwen3_5ForCausalLM(config)
    elif arch == "deepseek_v32":  # MLA + lightning indexer (top-256) + MoE, 1 dense layer
        config = transformers.DeepseekV32Config(
            vocab_size=8192,
            hidden_size=512,
            num_attention_heads=8,
            num_key_value_heads=8,
            num_hidden_layers=len(layers),
            first_k_dense_replace=1,
            intermediate_size=1536,
            moe_intermediate_size=512,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            q_lora_rank=384,
            kv_lora_rank=256,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            index_n_heads=8,
            index_head_dim=64,
            index_topk=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        model = transformers.DeepseekV32ForCausalLM(config)
    elif arch == "gpt_oss":  # alternating 128-token sliding / full layers, sinks, MoE
        config = transformers.GptOssConfig(
            **common,
            head_dim=64,
            num_hidden_layers=len(layers),
            sliding_window=128,
            intermediate_size=512,
            num_local_experts=8,
            num_experts_per_tok=2,
        )
        model = transformers.GptOssForCausalLM(config)
    elif arch == "gemma3":  # 5 local (512-token window) : 1 global, sandwich norms, GeGLU
        config = transformers.Gemma3TextConfig(
            **common,
            head_dim=64,
            num_hidden_layers=6,
            sliding_window=512,
            intermediate_size=1536,
        )
        model = transformers.Gemma3ForCausalLM(config)
    elif arch == "jamba":  # Mamba-1 : attention 3 : 1, MoE every other layer (as Jamba)
        config = transformers.JambaConfig(
            **common,
            num_hidden_layers=len(layers),
            attn_layer_period=4,
            attn_layer_offset=3,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            intermediate_size=1536,
            mamba_d_state=16,
            mamba_expand=2,
        )
        model = transformers.JambaForCausalLM(config)
    elif arch == "falcon_h1":  # every layer attention and Mamba-2 in parallel, muP != 1
        config = transformers.FalconH1Config(
            **common,
            **mamba,
            mamba_n_groups=1,
            mamba_d_ssm=16 * 64,
            num_hidden_layers=len(layers),
            intermediate_size=1536,
            embedding_multiplier=5.0,
            lm_head_multiplier=0.05,
            key_multiplier=0.4,
            ssm_out_multiplier=0.25,
            ssm_multipliers=[0.35, 0.25, 0.5, 0.35, 0.35],
        )
        model = transformers.FalconH1ForCausalLM(config)
    elif arch == "bamba":
        config = transformers.BambaConfig(
            **common,
            **mamba,
            mamba_n_groups=1,
            num_hidden_layers=len(layers),
            attn_layer_indices=[3, 7],
            intermediate_size=1536,
        )
        model = transformers.BambaForCausalLM(config)
    else:
        blocks = []
        for kind in layers:
            blocks += ["full_attention" if kind == "attention" else "linear_attention", "mlp"]
        config = transformers.NemotronHConfig(
            **common,
            layers_block_type=blocks,
            head_dim=64,
            intermediate_size=1536,
            mamba_num_heads=16,
            mamba_head_dim=64,
            ssm_state_size=64,
            n_groups=1,
            chunk_size=256,
        )
        model = transformers.NemotronHForCausalLM(config)
    model.save_pretrained(directory)
    return directory


def pin(threads: int) -> None:
    torch.set_num_threads(threads)
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))[:threads]
        os.sched_setaffinity(0, cores)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def ours_decode(model: HybridModel, ids: torch.Tensor, steps: int) -> float:
    """Seconds for ``steps`` greedy decode steps after a prefill of ``ids``."""
    state = model.new_state()
    logits = model.prefill(ids, state)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model.decode(int(logits.argmax()), state)
    return time.perf_counter() - t0


def theirs_decode(model, ids: torch.Tensor, steps: int) -> float:
    """The same with transformers (its cache, explicit positions)."""
    pos = ids.shape[0]
    out = model(ids[None], position_ids=torch.arange(pos)[None], use_cache=True)
    cache = out.cache
    t0 = time.perf_counter()
    for i in range(steps):
        token = out.logits[:, -1:].argmax(-1)
        out = model(token, cache=cache, position_ids=torch.tensor([[pos + i]]), use_cache=True)
    return time.perf_counter() - t0


def report(label: str, tokens: int, times: dict[str, list[float]]) -> dict[str, float]:
    """Tokens/s from the median and the best of the repeats (on a shared machine the best
    run is the one least disturbed by other processes); the ratio is runtime / theirs."""
    row: dict[str, float] = {}
    for stat, pick in (("median", statistics.median), ("best", min)):
        for name, values in times.items():
            row[f"{name}_{stat}"] = tokens / pick(values)
        row[f"ratio_{stat}"] = row[f"runtime_{stat}"] / row[f"transformers_{stat}"]
    print(
        f"{label}: runtime {row['runtime_median']:8.1f} tok/s   transformers "
        f"{row['transformers_median']:8.1f} tok/s   ratio {row['ratio_median']:.2f} "
        f"(best-of: {row['ratio_best']:.2f})",
        flush=True,
    )
    return row


def profile_table(fn, ids: torch.Tensor) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(ids)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)


def bench_batch(model: HybridModel, sizes: list[int], args: argparse.Namespace) -> dict:
    """decode_batch (A) vs one decode per sequence (B), alternating; see the module doc."""
    from mesh_hicache.pools.device import DevicePools

    vocab, ps = model.config.vocab_size, model.page_size
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    for size in sizes:
        lengths = [args.lengths[0] + 16 * i for i in range(size)]
        per_seq = -(-(max(lengths) + args.decode) // ps)  # every run restarts from base
        pools = None
        if args.paged:
            pools = DevicePools(model.layout, num_pages=size * per_seq, device=model.device)
        base = []
        for i, n in enumerate(lengths):
            if pools is None:
                state = model.new_state()
            else:
                state = model.paged_state(pools, list(range(i * per_seq, (i + 1) * per_seq)))
            model.prefill(torch.randint(0, vocab, (n,), generator=gen), state)
            base.append(state)
        tokens = torch.randint(0, vocab, (size,), generator=gen).tolist()
        times: dict[str, list[float]] = {"batched": [], "sequential": []}
        for _ in range(args.repeats):
            for mode in times:
                # Clones of paged states share the pages: each run rewrites the same slots.
                states = [s.clone() for s in base]
                t0 = time.perf_counter()
                for _ in range(args.decode):
                    if mode == "batched":
                        model.decode_batch(tokens, states)
                    else:
                        for token, state in zip(tokens, states, strict=True):
                            model.decode(token, state)
                times[mode].append(time.perf_counter() - t0)
        row = {f"{m}_tok_s": size * args.decode / statistics.median(t) for m, t in times.items()}
        row["ratio"] = row["batched_tok_s"] / row["sequential_tok_s"]
        print(
            f"B={size:3d}: decode_batch {row['batched_tok_s']:8.1f} tok/s   sequential "
            f"{row['sequential_tok_s']:8.1f} tok/s   ratio {row['ratio']:.2f}",
            flush=True,
        )
        results[f"batch_{size}"] = row
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: build --arch in a tmp dir)")
    p.add_argument("--arch", choices=ARCHS, default="granite_moe")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--decode", type=int, default=32, help="decode steps")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--profile", action="store_true", help="also print where a prefill of each spends time"
    )
    p.add_argument(
        "--batch", type=int, nargs="+", help="batched decode sizes B (runtime only; see above)"
    )
    p.add_argument("--preset", default="small", help="--batch without --model: this preset")
    p.add_argument("--paged", action="store_true", help="--batch: paged states (L1 pages)")
    args = p.parse_args(argv)
    if args.batch and min(args.batch) < 1:
        p.error(f"--batch sizes must be >= 1, got {args.batch}")
    pin(args.threads)
    if args.batch:
        if args.model:
            ckpt = load_checkpoint(args.model, torch.float32)
            model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
        else:
            model = HybridModel(preset(args.preset), page_size=16)
        with torch.inference_mode():
            results = bench_batch(model, args.batch, args)
        if args.json:
            meta = {"model": args.model or args.preset, "threads": args.threads}
            meta["paged"] = args.paged
            Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        return 0
    import transformers

    directory = Path(args.model) if args.model else None
    if directory is None:
        directory = build_checkpoint(args.arch, Path(tempfile.mkdtemp(prefix="bench_model_")))
    ckpt = load_checkpoint(directory, torch.float32)
    ours = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    vocab = ckpt.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, float]] = {}

    def ours_prefill(ids: torch.Tensor) -> None:
        ours.prefill(ids, ours.new_state())

    def theirs_prefill(ids: torch.Tensor) -> None:
        pos = torch.arange(ids.shape[0])[None]
        theirs(ids[None], position_ids=pos, use_cache=True, logits_to_keep=1)

    with torch.inference_mode():
        ours_prefill(torch.randint(0, vocab, (64,), generator=gen))  # warm-up
        theirs_prefill(torch.randint(0, vocab, (64,), generator=gen))
        for length in args.lengths:
            ids = torch.randint(0, vocab, (length,), generator=gen)
            times: dict[str, list[float]] = {"runtime": [], "transformers": []}
            for _ in range(args.repeats):
                times["runtime"].append(timed(ours_prefill, ids))
                times["transformers"].append(timed(theirs_prefill, ids))
            results[f"prefill_{length}"] = report(f"prefill {length:5d}", length, times)
        ids = torch.randint(0, vocab, (args.lengths[0],), generator=gen)
        times = {"runtime": [], "transformers": []}
        for _ in range(args.repeats):
            times["runtime"].append(ours_decode(ours, ids, args.decode))
            times["transformers"].append(theirs_decode(theirs, ids, args.decode))
        results["decode"] = report(f"decode x{args.decode:3d}", args.decode, times)
        if args.profile:
            ids = torch.randint(0, vocab, (args.lengths[0],), generator=gen)
            for name, fn in (("runtime", ours_prefill), ("transformers", theirs_prefill)):
                print(f"-- {name}, prefill {args.lengths[0]}: top ops by self CPU time")
                print(profile_table(fn, ids))
    if args.json:
        meta = {"model": str(directory), "arch": ckpt.architecture, "threads": args.threads}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
