"""A tiny hybrid engine on mesh_hicache: attention K/V in the cache's pages, recurrent state
in its slots, tp over a mesh, greedy decode, and a self-check against a recompute.

    python examples/tiny_engine.py --storage-root DIR             # one rank
    torchrun --standalone --nproc-per-node 2 examples/tiny_engine.py --tp 2 --storage-root DIR

Run it twice on one ``DIR``: the second process starts with empty L1 and L2 and its first
request is served from L3 (it prints the tier of every hit and the counters). Without
``--storage-root`` it uses a temporary directory. docs/engine_guide.md walks through it.

The model (seeded random weights, 4 layers): attention at layers 0 and 2 (GQA, 4 query
heads over 2 KV heads; tp splits the heads), a Mamba-like recurrence at layers 1 and 3
(per head a causal depthwise conv over its channels, then a diagonal decaying state
``h = a * h + dt * x B^T``, read out by ``C``; tp splits the heads, so a rank holds a
contiguous block of conv channels, head-major as ``MambaSpec`` documents). It imports
only torch and mesh_hicache.

Dims: T tokens, D model width, H query heads, G KV heads, E head dim, S SSM heads,
P channels per SSM head, N state size, K conv width (all local to a tp rank where split).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mesh_hicache import CachedRequest, HiCache, HiCacheConfig, MeshTopology
from mesh_hicache.layout import kv_head_range, tp_split
from mesh_hicache.spec import KVSpec, MambaSpec, StateSpec

PAGE = 4
VOCAB, WIDTH = 64, 32
ATTN_LAYERS, SSM_LAYERS = (0, 2), (1, 3)
Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
SSM_HEADS, SSM_DIM, STATE, KERNEL = 2, 4, 4, 4
MAX_NEW = 6
TOLERANCE = 1e-5
"""Cached and recomputed logits may differ by float32 rounding only: the cached path
runs the prompt in other chunks ([n, m), [m, L) instead of [0, L)), so the attention
matmuls sum in another order (measured: up to 2e-6); anything wrong in a page, a slot
or a split would be off by far more."""


def tiny_spec() -> StateSpec:
    """What the cache stores for this model: K/V per attention layer, conv + SSM state per
    recurrent layer (whole-model sizes; the cache splits them over tp)."""
    return StateSpec(
        page_size=PAGE,
        kv=KVSpec(layer_ids=ATTN_LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM),
        mamba=MambaSpec(
            layer_ids=SSM_LAYERS,
            conv_dim=SSM_HEADS * SSM_DIM,  # head-major: head s owns channels [s*P, (s+1)*P)
            conv_kernel=KERNEL,
            num_heads=SSM_HEADS,
            head_dim=SSM_DIM,
            state_dim=STATE,
        ),
        model_id="tiny-engine-seed0",  # the weights' identity: part of every storage key
    )


# -- the model ---------------------------------------------------------------------------------


class State:
    """One sequence's state: K/V rows (in cache pages, or in its own tensors) and the
    recurrent conv/SSM state of each recurrent layer."""

    def __init__(self, pools: object = None, pages: Sequence[int] = ()) -> None:
        self.pools, self.pages = pools, list(pages)
        self.num_tokens = 0
        self.k: dict[int, Tensor] = {}  # contiguous rows [T, G, E] when pools is None
        self.v: dict[int, Tensor] = {}
        self.conv: dict[int, Tensor] = {}  # [C, K-1]
        self.ssm: dict[int, Tensor] = {}  # [S, P, N]

    def write_kv(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Rows of tokens ``[num_tokens, num_tokens + T)``."""
        start = self.num_tokens
        if self.pools is None:
            self.k[layer] = torch.cat([self.k[layer], k]) if layer in self.k else k
            self.v[layer] = torch.cat([self.v[layer], v]) if layer in self.v else v
            return
        pos = torch.arange(start, start + k.shape[0])
        page = torch.tensor(self.pages)[pos // PAGE]
        self.pools.k(layer)[page, pos % PAGE] = k  # type: ignore[attr-defined]
        self.pools.v(layer)[page, pos % PAGE] = v  # type: ignore[attr-defined]

    def read_kv(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        """K and V rows of tokens ``[0, end)``: ``[end, G, E]`` each."""
        if self.pools is None:
            return self.k[layer][:end], self.v[layer][:end]
        page = torch.tensor(self.pages[: -(-end // PAGE)])
        k = self.pools.k(layer)[page]  # type: ignore[attr-defined]
        v = self.pools.v(layer)[page]  # type: ignore[attr-defined]
        return k.flatten(0, 1)[:end], v.flatten(0, 1)[:end]


class TinyHybrid:
    """The model on one tp rank: whole-model weights drawn from one seed, then this rank's
    rows/columns kept (the tp transform); each mixer's output is summed over tp."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.tp_group = mesh.get_group("tp")
        tp, rank = mesh.size(mesh.mesh_dim_names.index("tp")), mesh.get_local_rank("tp")
        self.tp = tp
        gen = torch.Generator().manual_seed(0)

        def w(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

        self.embed, self.head = w(VOCAB, WIDTH) * WIDTH**0.5, w(VOCAB, WIDTH)
        q0, q1 = tp_split(Q_HEADS, tp, rank)
        g0, g1 = kv_head_range(Q_HEADS, KV_HEADS, tp, rank)
        s0, s1 = tp_split(SSM_HEADS, tp, rank)
        self.q_heads, self.kv_heads, self.ssm_heads = q1 - q0, g1 - g0, s1 - s0
        e, p, n = HEAD_DIM, SSM_DIM, STATE
        self.layers: dict[int, dict[str, Tensor]] = {}
        for layer in range(4):
            if layer in ATTN_LAYERS:
                wq, wk, wv = w(Q_HEADS * e, WIDTH), w(KV_HEADS * e, WIDTH), w(KV_HEADS * e, WIDTH)
                wo = w(WIDTH, Q_HEADS * e)
                self.layers[layer] = {
                    "wq": wq[q0 * e : q1 * e],
                    "wk": wk[g0 * e : g1 * e],
                    "wv": wv[g0 * e : g1 * e],
                    "wo": wo[:, q0 * e : q1 * e],
                }
            else:
                wx, wb, wc = (
                    w(SSM_HEADS * p, WIDTH),
                    w(SSM_HEADS * n, WIDTH),
                    w(SSM_HEADS * n, WIDTH),
                )
                wdt, conv = w(SSM_HEADS, WIDTH), w(SSM_HEADS * p, KERNEL)
                a_log, d_skip, wo = (
                    torch.rand(SSM_HEADS, generator=gen),
                    w(SSM_HEADS, 1),
                    w(WIDTH, SSM_HEADS * p),
                )
                self.layers[layer] = {
                    "wx": wx[s0 * p : s1 * p],  # conv channels of this rank's heads
                    "wb": wb[s0 * n : s1 * n],
                    "wc": wc[s0 * n : s1 * n],
                    "wdt": wdt[s0:s1],
                    "conv": conv[s0 * p : s1 * p],
                    "a_log": a_log[s0:s1],
                    "d": d_skip[s0:s1, 0],
                    "wo": wo[:, s0 * p : s1 * p],
                }

    def new_state(self, pools: object = None, pages: Sequence[int] = ()) -> State:
        state = State(pools, pages)
        c = self.ssm_heads * SSM_DIM
        for layer in SSM_LAYERS:
            state.conv[layer] = torch.zeros(c, KERNEL - 1)
            state.ssm[layer] = torch.zeros(self.ssm_heads, SSM_DIM, STATE)
        return state

    def forward(self, tokens: Sequence[int], state: State) -> Tensor:
        """Run ``tokens`` (the next T of the sequence) and advance ``state``; logits ``[T, V]``."""
        x = self.embed[torch.tensor(list(tokens))]
        for layer in range(4):
            mix = self._attention if layer in ATTN_LAYERS else self._recurrent
            out = mix(layer, F.rms_norm(x, (WIDTH,)), state)
            if self.tp > 1:
                dist.all_reduce(out, group=self.tp_group)  # partial sums of the heads
            x = x + out
        state.num_tokens += len(tokens)
        return F.rms_norm(x, (WIDTH,)) @ self.head.T

    def _attention(self, layer: int, x: Tensor, state: State) -> Tensor:
        wts, t, start = self.layers[layer], x.shape[0], state.num_tokens
        q = (x @ wts["wq"].T).view(t, self.q_heads, HEAD_DIM)
        k = (x @ wts["wk"].T).view(t, self.kv_heads, HEAD_DIM)
        v = (x @ wts["wv"].T).view(t, self.kv_heads, HEAD_DIM)
        state.write_kv(layer, k, v)
        keys, values = state.read_kv(layer, start + t)  # [start + T, G, E]
        rep = self.q_heads // self.kv_heads
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        scores = torch.einsum("the,she->hts", q, keys) / HEAD_DIM**0.5
        causal = torch.arange(start + t)[None, :] <= torch.arange(start, start + t)[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hts,she->the", probs, values).reshape(t, -1)
        return out @ wts["wo"].T

    def _recurrent(self, layer: int, x: Tensor, state: State) -> Tensor:
        wts, s = self.layers[layer], self.ssm_heads
        xin = x @ wts["wx"].T  # [T, C], C = S*P head-major
        b = (x @ wts["wb"].T).view(-1, s, STATE)
        c = (x @ wts["wc"].T).view(-1, s, STATE)
        dt = F.softplus(x @ wts["wdt"].T)  # [T, S]
        decay = torch.exp(-dt * wts["a_log"].exp())
        conv, h = state.conv[layer], state.ssm[layer]
        ys = []
        for i in range(x.shape[0]):
            window = torch.cat([conv, xin[i, :, None]], dim=1)  # [C, K]
            conv = window[:, 1:]
            u = F.silu((window * wts["conv"]).sum(-1)).view(s, SSM_DIM)  # [S, P]
            h = (
                decay[i, :, None, None] * h
                + dt[i, :, None, None] * u[:, :, None] * b[i, :, None, :]
            )
            ys.append((h * c[i, :, None, :]).sum(-1) + wts["d"][:, None] * u)
        state.conv[layer], state.ssm[layer] = conv, h
        return torch.stack(ys).reshape(x.shape[0], -1) @ wts["wo"].T


# -- one request through the cache ---------------------------------------------------------------


def capture(state: State, cache: HiCache, req: CachedRequest) -> int:
    """Copy the recurrent state after exactly ``state.num_tokens`` tokens into a new slot."""
    slot = cache.alloc_slot(req)  # collective; CacheFull on every rank together
    for layer in SSM_LAYERS:
        cache.device.conv(layer)[slot] = state.conv[layer]
        cache.device.ssm(layer)[slot] = state.ssm[layer]
    return slot


def serve(model: TinyHybrid, cache: HiCache, prompt: list[int]) -> tuple[list[int], Tensor, tuple]:
    """Serve one request: returns (output tokens, logits of every step, served per tier)."""
    req = cache.match(prompt, leave_one=True)  # at least the last prompt token is computed
    try:
        cache.load(req)  # end the L3 prefetch, start host -> device copies
        for layer in range(4):
            req.wait_layer(layer)  # (an engine waits per layer inside its forward)
        n = cache.finish_load(req)  # agreed prefix length: tokens [0, n) are cached
        total = len(prompt) + MAX_NEW - 1  # tokens whose K/V we compute (not the last output)
        new_pages = cache.alloc_pages(req, -(-total // PAGE) - n // PAGE)
        pages = req.prefix_pages[: n // PAGE] + new_pages
        state = model.new_state(cache.device, pages)
        if n:  # resume from the cached boundary: K/V stay in the pages, copy the state
            assert req.mamba_slot is not None
            for layer in SSM_LAYERS:
                state.conv[layer] = cache.device.conv(layer)[req.mamba_slot].clone()
                state.ssm[layer] = cache.device.ssm(layer)[req.mamba_slot].clone()
            state.num_tokens = n
        # The prefill split: [n, m) up to the last page boundary m inside the prompt,
        # capture the state there, then [m, L).
        m = (len(prompt) - 1) // PAGE * PAGE
        logits = []
        if m > n:
            model.forward(prompt[n:m], state)
            slot = capture(state, cache, req)
            cache.insert(req, prompt[:m], pages[: m // PAGE], mamba_slot=slot)
            pages[: m // PAGE] = req.held_pages[: m // PAGE]  # the tree's pages from now on
            state.pages = pages
        logits.append(model.forward(prompt[max(n, m) :], state)[-1])
        output, boundary = [int(logits[-1].argmax())], None
        if state.num_tokens % PAGE == 0:
            boundary = capture(state, cache, req)
        while len(output) < MAX_NEW:
            logits.append(model.forward(output[-1:], state)[-1])
            output.append(int(logits[-1].argmax()))
            if state.num_tokens % PAGE == 0:  # the last boundary reached while decoding
                if boundary is None:
                    boundary = capture(state, cache, req)
                else:
                    for layer in SSM_LAYERS:
                        cache.device.conv(layer)[boundary] = state.conv[layer]
                        cache.device.ssm(layer)[boundary] = state.ssm[layer]
        # Insert a second time: prompt + output up to the last boundary decode reached.
        m2 = state.num_tokens // PAGE * PAGE
        if boundary is not None and m2 > m:
            full = prompt + output
            cache.insert(req, full[:m2], pages[: m2 // PAGE], mamba_slot=boundary)
        return output, torch.stack(logits), tuple(int(t) for t in req.served)
    finally:
        cache.release(req)  # done or failed: unlock, free what the tree did not take


def recompute(model: TinyHybrid, prompt: list[int]) -> tuple[list[int], Tensor]:
    """The same request with no cache at all: the reference."""
    state = model.new_state()
    logits = [model.forward(prompt, state)[-1]]
    output = [int(logits[-1].argmax())]
    while len(output) < MAX_NEW:
        logits.append(model.forward(output[-1:], state)[-1])
        output.append(int(logits[-1].argmax()))
    return output, torch.stack(logits)


# -- the program ---------------------------------------------------------------------------------


BASE = [(7 * i + 3) % VOCAB for i in range(22)]


def next_prompt(i: int, outputs: list[list[int]]) -> list[int]:
    """Request ``i``: a prompt, a longer prompt sharing it, then the first one's next chat
    turn (its prompt, its answer, a new message: a hit at the decode checkpoint)."""
    if i == 0:
        return BASE
    return BASE + [5, 9, 1, 4, 2] if i == 1 else BASE + outputs[0] + [60, 61]


def run(mesh: DeviceMesh, root: str, rank: int) -> None:
    model = TinyHybrid(mesh)
    topo = MeshTopology.from_mesh(mesh)  # collective
    config = HiCacheConfig(
        device_pages=64,
        host_ratio=2.0,
        write_policy="write_through",
        storage="file",
        storage_options={"root": root},
        prefetch_threshold=PAGE,  # prefetch from L3 from one page on
        collective_timeout_s=60.0,
    )
    with HiCache(topo, tiny_spec(), config) as cache:  # collective; close() on the way out
        outputs: list[list[int]] = []
        for i in range(3):
            prompt = next_prompt(i, outputs)
            output, logits, served = serve(model, cache, prompt)
            outputs.append(output)
            cache.step()  # once per scheduler step: consume finished backups (collective)
            want_output, want_logits = recompute(model, prompt)
            diff = float((logits - want_logits).abs().max())
            if output != want_output or diff > TOLERANCE:
                raise RuntimeError(
                    f"request {i}: cached run differs from the recompute (max |diff| "
                    f"{diff:.2e} > {TOLERANCE:g}, or tokens {output} != {want_output})"
                )
            if rank == 0:
                print(
                    f"request {i}: prompt {len(prompt)} tokens, reused {sum(served)} from "
                    f"(L1, L2, L3) {served}, output {output}, max |logit diff| {diff:.1e}"
                )
        cache.check_integrity()
        stats = cache.stats()
    if rank == 0:
        print(
            f"counters: requests {stats.requests}, hit tokens L1 {stats.hit_tokens_device} "
            f"L2 {stats.hit_tokens_host} L3 {stats.hit_tokens_storage}, "
            f"raw KV hit {stats.raw_kv_hit_tokens}, L3 objects written "
            f"{stats.storage_put_objects}, bytes L3->host {stats.bytes_storage_to_host}"
        )


def gloo_threads() -> list[str]:
    """Threads of this process that belong to a gloo process group."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return [n for n in names if "gloo" in n]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (torchrun)")
    parser.add_argument("--storage-root", default=None, help="L3 directory (default: a temp dir)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    else:
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    if dist.get_world_size() != args.tp:
        raise ValueError(f"--tp {args.tp} needs {args.tp} ranks, got {dist.get_world_size()}")
    rank = dist.get_rank()
    try:
        with tempfile.TemporaryDirectory(prefix="tiny_engine_l3_") as tmp:
            mesh = init_device_mesh("cpu", (1, 1, args.tp), mesh_dim_names=("pp", "cp", "tp"))
            run(mesh, args.storage_root or tmp, rank)
            del mesh
    finally:
        dist.destroy_process_group()
    # Exit normally. The process groups' worker threads must be gone before the
    # interpreter finalizes: one still dropping a collective's tensors would ask for the
    # GIL then, which aborts the process. Dropping the last reference to a group joins
    # its threads (torch releases the GIL for that), so nothing may keep a group alive:
    # the cache is closed and gone, the mesh deleted, and a collection ends the cycles.
    gc.collect()
    left = gloo_threads()
    if left:
        print(f"warning: gloo threads still running at exit: {left}", file=sys.stderr)
    if rank == 0:
        print("tiny_engine: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
