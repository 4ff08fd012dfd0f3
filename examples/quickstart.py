"""mesh_hicache in one file: a user-defined hybrid model's state, cached in L1/L2/L3.

    python examples/quickstart.py                 # one rank, CPU, L3 in a temp directory

"ToyHybrid" is a made-up model with 4 layers: attention at layers 0 and 2 (paged K/V of
2 heads x 8 dims) and a Mamba-style recurrence at layers 1 and 3 (a conv state and an SSM
state, one per prefix boundary). Its "forward" is a deterministic function of the
tokens, so the program can check that whatever the cache hands back equals what a
recompute gives. It then serves a prompt, serves a longer prompt sharing its prefix (an
L1 hit), and starts a SECOND PROCESS on the same L3 root, whose empty L1/L2 get the
prefix from L3. Every call on the cache is collective: on a mesh, every rank makes the
same calls in the same order (this program runs on a one-rank mesh).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mesh_hicache import HiCache, HiCacheConfig, MeshTopology
from mesh_hicache.spec import KVSpec, MambaSpec, StateSpec

PAGE = 16  # tokens per KV page; Mamba states are checkpointed at page boundaries
KV_LAYERS, SSM_LAYERS = (0, 2), (1, 3)
HEADS, DIM = 2, 8
CONV_DIM, KERNEL, SSM_HEADS, SSM_DIM, STATE = 16, 4, 2, 8, 4


# -- the made-up model: K/V per token, a recurrent state per prefix ------------------------


def toy_kv(layer: int, tokens: list[int]) -> torch.Tensor:
    """K (and, negated, V) of every token: ``[len(tokens), HEADS, DIM]``."""
    t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    return torch.sin(t * (layer + 1) + torch.arange(HEADS * DIM).view(1, HEADS, DIM))


def toy_state(layer: int, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv and SSM state after exactly ``tokens`` (depends on all of them)."""
    h = float(sum((i + 1) * t for i, t in enumerate(tokens)) % 9973) + layer
    conv = torch.full((CONV_DIM, KERNEL - 1), h)
    ssm = torch.full((SSM_HEADS, SSM_DIM, STATE), -h)
    return conv, ssm


def serve(cache: HiCache, prompt: list[int]) -> tuple[int, tuple[int, int, int]]:
    """One request: reuse the cached prefix, compute the rest, cache it. Returns the
    reused prefix length and the tokens served per tier (L1, L2, L3)."""
    # Match one token short: the last prompt token is always computed (its logits
    # start decoding).
    req = cache.match(prompt, leave_one=True)
    try:
        cache.load(req)  # stop the L3 prefetch, start host -> device (layer-wise)
        for layer in range(4):
            req.wait_layer(layer)  # this layer's cached state is on device now
        n = cache.finish_load(req)  # agreed prefix length (0 if a copy failed anywhere)
        served = tuple(int(x) for x in req.served)
        dev = cache.device
        if n:  # check what came back against a recompute of the prefix
            pages = torch.tensor(req.prefix_pages[: n // PAGE])
            for layer in KV_LAYERS:
                k = dev.k(layer)[pages].reshape(n, HEADS, DIM)
                assert torch.allclose(k, toy_kv(layer, prompt[:n]))
            assert req.mamba_slot is not None
            for layer in SSM_LAYERS:
                conv, _ = toy_state(layer, prompt[:n])
                assert torch.equal(dev.conv(layer)[req.mamba_slot], conv)
        # Cache the prompt up to its last page boundary: m tokens, page-aligned.
        m = len(prompt) // PAGE * PAGE
        if m > n:
            # insert() takes the pages of ALL m tokens: the cached prefix's, then new ones.
            new_pages = cache.alloc_pages(req, (m - n) // PAGE)  # may evict; CacheFull
            pages_of_m = req.prefix_pages[: n // PAGE] + new_pages
            for layer in KV_LAYERS:
                kv = toy_kv(layer, prompt[n:m]).view(-1, PAGE, HEADS, DIM)
                dev.k(layer)[torch.tensor(new_pages)] = kv
                dev.v(layer)[torch.tensor(new_pages)] = -kv
            # The slot must hold the state after exactly m tokens (not len(prompt)).
            slot = cache.alloc_slot(req)
            for layer in SSM_LAYERS:
                conv, ssm = toy_state(layer, prompt[:m])
                dev.conv(layer)[slot] = conv
                dev.ssm(layer)[slot] = ssm
            cache.insert(req, prompt[:m], pages_of_m, mamba_slot=slot)
        return n, served  # (a real engine would prefill prompt[n:] and decode here)
    finally:
        cache.release(req)  # finished or aborted: unlock, free what the tree did not take


def build_cache(root: str) -> HiCache:
    """A one-rank mesh (collective on a real mesh) and a cache with L1, L2 and L3."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "cp", "tp"))
    # The state families of ToyHybrid: what the cache stores, with shapes and dtypes.
    spec = StateSpec(
        page_size=PAGE,
        kv=KVSpec(layer_ids=KV_LAYERS, num_kv_heads=HEADS, head_dim=DIM),
        mamba=MambaSpec(
            layer_ids=SSM_LAYERS,
            conv_dim=CONV_DIM,
            conv_kernel=KERNEL,
            num_heads=SSM_HEADS,
            head_dim=SSM_DIM,
            state_dim=STATE,
        ),
        model_id="toy-hybrid-v1",  # part of every storage key: another model never hits
    )
    topo = MeshTopology.from_mesh(mesh)  # collective
    config = HiCacheConfig(
        device_pages=64,  # L1 pages per rank
        host_ratio=4.0,  # L2 = 4 x L1
        write_policy="write_through",
        storage="file",
        storage_options={"root": root},
        prefetch_threshold=16,  # prefetch from L3 from one page on
    )
    cache = HiCache(topo, spec, config)  # collective
    return cache


PROMPT = [(37 * i + 11) % 1000 for i in range(100)]  # 100 tokens: 6 whole pages


def first_process(root: str) -> None:
    cache = build_cache(root)
    n, served = serve(cache, PROMPT)
    assert n == 0, "a cold cache hits nothing"
    n, served = serve(cache, PROMPT + [1, 2, 3])
    print(f"process 1, second request: reused {n} tokens, per tier (L1, L2, L3) {served}")
    assert n == 96 and served[0] == 96
    print(f"process 1 stats: {cache.stats().hit_tokens_device} tokens hit in L1")
    cache.flush()  # wait until every backup reached L2 and L3 (collective)
    cache.close()  # release, flush, stop the worker threads (collective, idempotent)
    dist.destroy_process_group()


def second_process(root: str) -> None:
    # New process: empty L1 and L2, the same L3 root; close() when the block ends.
    with build_cache(root) as cache:
        n, served = serve(cache, PROMPT + [4, 5])
    print(f"process 2: reused {n} tokens, per tier (L1, L2, L3) {served}")
    assert n == 96 and served[2] == 96, "the prefix comes from L3"
    dist.destroy_process_group()


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--second":
        second_process(sys.argv[2])
        return 0
    with tempfile.TemporaryDirectory(prefix="quickstart_l3_") as root:
        first_process(root)
        subprocess.run([sys.executable, __file__, "--second", root], check=True)
    print("quickstart: OK")
    return 0


if __name__ == "__main__":
    code = main()
    # Exit normally, once no process group is left alive: the cache and the mesh are gone
    # with the functions that held them, and a collection ends their reference cycles, so
    # every gloo worker thread is joined before the interpreter finalizes (a thread still
    # dropping a collective's tensors then would abort the process; docs/engine_guide.md).
    gc.collect()
    sys.exit(code)
