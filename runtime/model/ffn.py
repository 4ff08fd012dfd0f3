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
        if self.up_bias is not None and self.down_bias is not None:
            self.up_bias, self.down_bias = self.up_bias.to(device), self.down_bias.to(device)

    def __call__(self, x: Tensor) -> Tensor:
        up = F.linear(x, self.up, self.up_bias)
        if self.kind in GATED:
            gate, up = up.split(self.hidden, dim=-1)
            if self.kind == "swiglu":
                hidden = F.silu(gate) * up
            elif self.kind == "geglu":
                hidden = F.gelu(gate, approximate="tanh") * up
            else:
                gate = gate.clamp(max=self.limit)
                up = up.clamp(-self.limit, self.limit)
                hidden = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        elif self.kind == "relu2":
            hidden = torch.relu(up).square()
        else:
            hidden = F.gelu(up)
        return F.linear(hidden, self.down, self.down_bias)


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
    ``router_has_bias``), weights = softmax over those k (Granite, gpt-oss).
    ``sigmoid`` router: scores = sigmoid(logits); experts chosen by top-k of
    ``scores + bias`` inside the ``router_topk_groups`` best groups (a group's value is
    the sum of its two best biased scores); weights = the chosen scores, divided by their
    sum when ``router_normalize``, times ``router_scale`` (Nemotron-H).
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
        self.shared = None
        if c.shared_expert_hidden:
            self.shared = MLP(
                c.mlp_kind, f"{prefix}.shared", c.shared_expert_hidden, weights, tp, c.dtype
            )

    def to(self, device: torch.device) -> None:
        self.router = self.router.to(device)
        if self.router_bias is not None:
            self.router_bias = self.router_bias.to(device)
        for mlp in [*self.experts, *([self.shared] if self.shared else [])]:
            mlp.to(device)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(expert ids ``[T, k]`` int64, weights ``[T, k]`` float32) for tokens ``x`` ``[T, D]``."""
        c = self.config
        logits = F.linear(x, self.router).float()
        if c.router == "softmax":
            if self.router_bias is not None:  # a bias on the logits (gpt-oss)
                logits = logits + self.router_bias
            top, ids = logits.topk(c.experts_per_token, dim=-1)
            return ids, torch.softmax(top, dim=-1)
        assert self.router_bias is not None  # the sigmoid router always has one
        scores = logits.sigmoid()
        choice = scores + self.router_bias
        groups = c.router_groups
        if groups > 1:
            per_group = choice.view(x.shape[0], groups, c.num_experts // groups)
            group_value = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
            best = group_value.topk(c.router_topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_value, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(per_group.shape[-1], 1), -torch.inf)
        ids = choice.topk(c.experts_per_token, dim=-1).indices
        weights = scores.gather(1, ids)
        if c.router_normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * c.router_scale

    def __call__(self, x: Tensor, tp: AxisComm) -> Tensor:
        ids, weights = self.route(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            tokens, slot = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e](x[tokens]).float() * weights[tokens, slot, None]
            out.index_add_(0, tokens, y)
        out = out.to(x.dtype)
        if self.shared is not None:
            out = out + self.shared(x)
        return tp.all_reduce(out)
