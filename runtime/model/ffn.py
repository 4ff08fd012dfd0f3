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


class MLP:
    """``swiglu``: ``down(silu(gate x) * up x)``; ``gelu``: ``down(gelu(up x))``;
    ``relu2``: ``down(relu(up x)^2)``. ``__call__`` returns this rank's partial sum."""

    def __init__(
        self, kind: str, prefix: str, hidden: int, weights: WeightSource, tp: AxisComm, dtype
    ) -> None:
        f0, f1 = tp_split(hidden, tp.size, tp.rank)
        self.kind = kind
        self.hidden = f1 - f0
        up = weights.get(f"{prefix}.up", rows=((f0, f1),))
        if kind == "swiglu":  # [gate | up] in one GEMM
            up = torch.cat([weights.get(f"{prefix}.gate", rows=((f0, f1),)), up])
        self.up = up.to(dtype)
        self.down = weights.get(f"{prefix}.down", cols=((f0, f1),)).to(dtype)

    def to(self, device: torch.device) -> None:
        self.up, self.down = self.up.to(device), self.down.to(device)

    def __call__(self, x: Tensor) -> Tensor:
        up = F.linear(x, self.up)
        if self.kind == "swiglu":
            gate, up = up.split(self.hidden, dim=-1)
            hidden = F.silu(gate) * up
        elif self.kind == "relu2":
            hidden = torch.relu(up).square()
        else:
            hidden = F.gelu(up)
        return F.linear(hidden, self.down)


class DenseMLP:
    """A dense MLP block's op: the MLP reduced over tp."""

    def __init__(
        self, config: ModelConfig, prefix: str, weights: WeightSource, tp: AxisComm
    ) -> None:
        self.mlp = MLP(config.mlp_kind, prefix, config.mlp_hidden, weights, tp, config.dtype)

    def to(self, device: torch.device) -> None:
        self.mlp.to(device)

    def __call__(self, x: Tensor, tp: AxisComm) -> Tensor:
        return tp.all_reduce(self.mlp(x))


class MoE:
    """Top-k routed experts plus an optional shared expert.

    ``softmax`` router: top-k of the logits, weights = softmax over those k (Granite);
    without ``router_normalize``, the top-k of the softmax over all experts (Qwen3-MoE's
    ``norm_topk_prob=False``).
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
        if c.router == "sigmoid":
            self.router_bias = weights.get(f"{prefix}.router_bias").float()
        self.experts = [
            MLP(c.mlp_kind, f"{prefix}.experts.{e}", c.expert_hidden, weights, tp, c.dtype)
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
        if self.router_bias is None:
            if not c.router_normalize:  # the top-k of the softmax over all experts
                top, ids = torch.softmax(logits, dim=-1).topk(c.experts_per_token, dim=-1)
                return ids, top
            top, ids = logits.topk(c.experts_per_token, dim=-1)
            return ids, torch.softmax(top, dim=-1)
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
