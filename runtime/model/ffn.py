"""Feed-forward blocks: a dense MLP and a top-k mixture of experts, split over tp.

Every MLP (dense, routed expert or shared expert) keeps the hidden columns
``tp_split(F)`` of its rank (rows of ``gate``/``up``, columns of ``down``), so its output
is a partial sum; a block reduces over tp once. The MoE router is replicated: every tp
rank routes the same (identical) tokens to the same experts.

Dims: ``T`` tokens, ``D`` d_model, ``F`` local hidden, ``X`` experts, ``k`` experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mesh_hicache.layout import tp_split
from runtime.model.config import ModelConfig
from runtime.model.parallel import AxisComm
from runtime.model.select import top_k, top_k_mask
from runtime.model.weights import WeightSource

GATED = ("swiglu", "geglu", "swiglu_clamp")


class MLP:
    """``swiglu``: ``down(silu(gate x) * up x)``; ``geglu``: ``down(gelu_tanh(gate x) *
    up x)``; ``swiglu_clamp``: gpt-oss's clamped SwiGLU with biases (``gate_bias``,
    ``up_bias``, ``down_bias``; the down bias is added by tp rank 0 only, so the reduced sum
    holds it once); ``gelu``: ``down(gelu(up x))``; ``relu2``: ``down(relu(up x)^2)``.
    ``__call__`` returns this rank's partial sum."""

    def __init__(
        self,
        kind: str,
        prefix: str,
        hidden: int,
        weights: WeightSource,
        tp: AxisComm,
        dtype,
        clamp: tuple[float, float] = (1.702, 7.0),
    ) -> None:
        f0, f1 = tp_split(hidden, tp.size, tp.rank)
        self.kind = kind
        self.hidden = f1 - f0
        self.alpha, self.limit = clamp
        up = weights.get(f"{prefix}.up", rows=((f0, f1),))
        if kind in GATED:  # [gate | up] in one GEMM
            up = torch.cat([weights.get(f"{prefix}.gate", rows=((f0, f1),)), up])
        self.up = up.to(dtype)
        self.down = weights.get(f"{prefix}.down", cols=((f0, f1),)).to(dtype)
        self.up_bias: Tensor | None = None
        self.down_bias: Tensor | None = None
        if kind == "swiglu_clamp":
            gate_b = weights.get(f"{prefix}.gate_bias", rows=((f0, f1),))
            self.up_bias = torch.cat([gate_b, weights.get(f"{prefix}.up_bias", rows=((f0, f1),))])
            self.up_bias = self.up_bias.to(dtype)
            down_b = weights.get(f"{prefix}.down_bias").to(dtype)
            self.down_bias = down_b if tp.rank == 0 else torch.zeros_like(down_b)

    def to(self, device: torch.device) -> None:
        self.up, self.down = self.up.to(device), self.down.to(device)
        self.biases_to(device)

    def biases_to(self, device: torch.device) -> None:
        if self.up_bias is not None and self.down_bias is not None:
            self.up_bias, self.down_bias = self.up_bias.to(device), self.down_bias.to(device)

    def __call__(self, x: Tensor) -> Tensor:
        up = F.linear(x, self.up, self.up_bias)
        return F.linear(self.activate(up), self.down, self.down_bias)

    def activate(self, up: Tensor) -> Tensor:
        """The hidden activations of the up projection ``up`` ``[..., (2)F]``."""
        if self.kind in GATED:
            gate, up = up.split(self.hidden, dim=-1)
            if self.kind == "swiglu":
                return F.silu(gate) * up
            if self.kind == "geglu":
                return F.gelu(gate, approximate="tanh") * up
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        if self.kind == "relu2":
            return torch.relu(up).square()
        return F.gelu(up)


class DenseMLP:
    """A dense MLP block's op: the MLP reduced over tp."""

    def __init__(
        self, config: ModelConfig, prefix: str, weights: WeightSource, tp: AxisComm
    ) -> None:
        c = config
        clamp = (c.swiglu_alpha, c.swiglu_limit)
        self.mlp = MLP(c.mlp_kind, prefix, c.mlp_hidden, weights, tp, c.dtype, clamp)

    def to(self, device: torch.device) -> None:
        self.mlp.to(device)

    def __call__(self, x: Tensor, tp: AxisComm) -> Tensor:
        return tp.all_reduce(self.mlp(x))


class MoE:
    """Top-k routed experts plus an optional shared expert.

    ``softmax`` router: top-k of the logits (plus ``router_bias`` with
    ``router_has_bias``), weights = softmax over those k (Granite, gpt-oss); without
    ``router_normalize``, the top-k of the softmax over all experts (Qwen3-MoE's
    ``norm_topk_prob=False``).
    ``sigmoid`` router: scores = sigmoid(logits); experts chosen by top-k of
    ``scores + bias`` inside the ``router_topk_groups`` best groups (a group's value is
    the sum of its two best biased scores); weights = the chosen scores, divided by their
    sum when ``router_normalize``, times ``router_scale`` (Nemotron-H). Tied scores go to
    the lower expert / group id (``runtime.model.select``).
    """

    def __init__(
        self, config: ModelConfig, prefix: str, weights: WeightSource, tp: AxisComm
    ) -> None:
        c = config
        self.config = c
        self.router = weights.get(f"{prefix}.router").to(c.dtype)
        self.router_bias = None
        if c.router == "sigmoid" or c.router_has_bias:
            self.router_bias = weights.get(f"{prefix}.router_bias").float()
        clamp = (c.swiglu_alpha, c.swiglu_limit)
        self.experts = [
            MLP(c.mlp_kind, f"{prefix}.experts.{e}", c.expert_hidden, weights, tp, c.dtype, clamp)
            for e in range(c.num_experts)
        ]
        # Every expert's weights in one tensor (the experts' own are views of it); small
        # experts also keep their down projections side by side for the dense path.
        self.w_up = torch.stack([m.up for m in self.experts])  # [X, (2)F, D]
        self.w_down = torch.stack([m.down for m in self.experts])  # [X, D, F]
        self._view_experts()
        self.shared = None
        if c.shared_expert_hidden:
            self.shared = MLP(
                c.mlp_kind, f"{prefix}.shared", c.shared_expert_hidden, weights, tp, c.dtype
            )

    def _view_experts(self) -> None:
        for e, mlp in enumerate(self.experts):
            mlp.up, mlp.down = self.w_up[e], self.w_down[e]
        x, d = self.w_down.shape[:2]
        self.per_token_all = x * (self.w_up[0].numel() + self.w_down[0].numel())
        self.down_all: Tensor | None = None  # [D, X*F]: expert e's columns at e*F
        if self.per_token_all <= DENSE_LIMIT and self.experts[0].up_bias is None:
            self.down_all = self.w_down.permute(1, 0, 2).reshape(d, -1).contiguous()

    def to(self, device: torch.device) -> None:
        self.router = self.router.to(device)
        if self.router_bias is not None:
            self.router_bias = self.router_bias.to(device)
        self.w_up, self.w_down = self.w_up.to(device), self.w_down.to(device)
        self._view_experts()
        for mlp in self.experts:  # their weights are views of w_up / w_down
            mlp.biases_to(device)
        if self.shared is not None:
            self.shared.to(device)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(expert ids ``[T, k]`` int64, weights ``[T, k]`` float32) for tokens ``x`` ``[T, D]``."""
        c = self.config
        logits = F.linear(x, self.router).float()
        if c.router == "softmax":
            if self.router_bias is not None:  # a bias on the logits (gpt-oss)
                logits = logits + self.router_bias
            if not c.router_normalize:  # the top-k of the softmax over all experts
                top, ids = top_k(torch.softmax(logits, dim=-1), c.experts_per_token)
                return ids, top
            top, ids = top_k(logits, c.experts_per_token)
            return ids, torch.softmax(top, dim=-1)
        assert self.router_bias is not None  # the sigmoid router always has one
        scores = logits.sigmoid()
        choice = scores + self.router_bias
        groups = c.router_groups
        if groups > 1:
            per_group = choice.view(x.shape[0], groups, c.num_experts // groups)
            group_value = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
            keep = top_k_mask(group_value, c.router_topk_groups)
            choice = choice.masked_fill(~keep.repeat_interleave(per_group.shape[-1], 1), -torch.inf)
        ids = top_k(choice, c.experts_per_token)[1]
        weights = scores.gather(1, ids)
        if c.router_normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * c.router_scale

    def routed(self, x: Tensor) -> Tensor:
        """The routed experts' weighted sum for tokens ``x`` ``[T, D]`` (float32, this rank's
        partial sum). Small experts and few tokens (decode of a small model, where each op
        costs its dispatch, not its arithmetic): every expert on every token in two GEMMs,
        the unchosen ones weighted 0. Else the (token, expert) pairs are sorted by expert
        (one host sync for the counts) and each expert runs its rows."""
        if x.shape[0] == 0:  # a rank's empty chunk of a short prompt
            return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        ids, weights = self.route(x)
        t, k = ids.shape
        if self.down_all is not None and t * self.per_token_all <= DENSE_LIMIT:
            up = F.linear(x, self.w_up.view(-1, x.shape[1])).view(
                t, len(self.experts), self.w_up.shape[1]
            )
            hidden = self.experts[0].activate(up)  # [T, X, F]
            dense = torch.zeros(t, len(self.experts), dtype=weights.dtype, device=x.device)
            dense.scatter_(1, ids, weights)
            scaled = hidden * dense.to(hidden.dtype)[..., None]
            return F.linear(scaled.reshape(t, -1), self.down_all).float()
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // k
        xs = x[tokens]
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self.experts[e](xs[start : start + n]))
                start += n
        y = torch.cat(outs).float() * weights.reshape(-1)[order, None]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add_(0, tokens, y)

    def __call__(self, x: Tensor, tp: AxisComm) -> Tensor:
        out = self.routed(x).to(x.dtype)
        if self.shared is not None:
            out = out + self.shared(x)
        return tp.all_reduce(out)


DENSE_LIMIT = 1 << 22
"""Up to this many multiply-adds (tokens x every expert's weights), :meth:`MoE.routed`
runs every expert on every token instead of looping over the chosen ones."""
