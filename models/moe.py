"""A DeepSeek-V3-style Mixture-of-Experts decoder in plain PyTorch, built on models/gpt.py.

What: the dense Llama-style model of models/gpt.py in which every block after the first
`first_k_dense` replaces its feed-forward network with an MoE layer:
    router          gate logits -> scores (softmax before/after top-k, or sigmoid), an optional
                    fp32 expert bias that changes the selection only, group-limited top-k,
                    normalised and scaled weights, tokens per expert, auxiliary losses;
    routed experts  stacked SwiGLU weights, tokens permuted by expert, torch._grouped_mm;
    shared experts  a dense SwiGLU every token goes through (models.gpt.FeedForward).
The router and the token permutation / weighted combine are written the obvious way because
compiler passes (graphtrain.passes) find them in the graph and replace them with fused kernels;
the semantics they must keep are those of `Router.forward` (the spec all MoE code shares) and
`routed_experts`. The auxiliary losses reach the gradient through AuxLossInjector, never the
returned loss (forward returns the plain cross-entropy, as the dense model's). The balancing
state each Router keeps, driven by graphtrain.balance (this file imports no distributed code):
Router's docstring. Balance losses count as DeepSeek-V3 (f_i) and Megatron-Core do: the plain
top-k of the scores, without the expert bias and the group limit (docs/design/moe_balance.md).

Numerics: routing in fp32 (logits are cast up after the gate); experts in the input's dtype, or
in the autocast dtype under autocast; the weighted combine in fp32, cast back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.fields import option
from models.gpt import GPT, PRESETS, FeedForward, GPTConfig, TransformerBlock, derive
from models.layers import init_trunc_normal, is_sharded

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    num_experts: int = option(8, "routed experts E")
    top_k: int = option(2, "routed experts per token k")
    num_shared_experts: int = option(
        1, "width of the shared SwiGLU, in units of moe_ffn_dim (0: none)"
    )
    moe_ffn_dim: int = option(256, "hidden width F of one expert")
    first_k_dense: int = option(1, "the first layers keep the dense FFN of width ffn_dim")
    score_func: str = option("sigmoid", '"softmax" or "sigmoid"')
    pre_softmax: bool = option(
        True, "softmax: over all experts (True) or over the top-k only (False)"
    )
    num_groups: int = option(1, "group-limited routing: G groups of E/G consecutive experts")
    topk_groups: int = option(1, "groups kept per token")
    normalize_weights: bool = option(True, "weights / their sum (not with softmax after top-k)")
    route_scale: float = option(1.0, "weights * route_scale")
    expert_bias: bool = option(True, "aux-loss-free balancing (DeepSeek-V3): bias on the selection")
    bias_update_rate: float = option(1e-3, "update_bias's rate, once per optimizer step")
    aux_loss_coef: float = option(0.0, "per micro-batch load-balancing loss")
    seq_aux_loss_coef: float = option(1e-4, "per sequence")
    global_aux_loss_coef: float = option(0.0, "counts over the step's micro-batches and dp ranks")
    z_loss_coef: float = option(0.0, "router z-loss")
    force_balance: bool = option(
        False, "benchmarks: random routing with a straight-through gradient"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "top_k", "moe_ffn_dim", "num_groups", "topk_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_shared_experts", "first_k_dense", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("aux_loss_coef", "seq_aux_loss_coef", "global_aux_loss_coef", "z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"model.{name} must be >= 0 (0 turns it off), got {getattr(self, name)}"
                )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.top_k={self.top_k} exceeds model.num_experts={self.num_experts}"
            )
        if self.first_k_dense >= self.num_layers:
            # All layers dense is a dense model trained with an MoE model's overheads and names:
            # almost surely a mistake (a dense preset is the way to train one).
            raise ValueError(
                f"model.first_k_dense={self.first_k_dense} leaves no MoE layer in "
                f"model.num_layers={self.num_layers}; set first_k_dense below num_layers, or "
                "use a dense preset (tiny, debug, 125m, 1b, 8b) for a dense model"
            )
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(
                f"model.score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}"
            )
        if self.num_experts % self.num_groups:
            raise ValueError(
                f"model.num_experts={self.num_experts} is not divisible by "
                f"model.num_groups={self.num_groups}"
            )
        if self.topk_groups > self.num_groups:
            raise ValueError(
                f"model.topk_groups={self.topk_groups} exceeds model.num_groups={self.num_groups}"
            )
        if self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(
                f"model.top_k={self.top_k} exceeds the {self.topk_groups} kept groups of "
                f"{self.num_experts // self.num_groups} experts"
            )
        if self.route_scale <= 0:
            raise ValueError(f"model.route_scale must be > 0, got {self.route_scale}")
        # torch._grouped_mm reads rows with 16-byte aligned strides: multiples of 8 elements
        # in bf16 (4 in fp32); a misaligned stride is an error, not a slow path.
        for name in ("dim", "moe_ffn_dim"):
            if getattr(self, name) % 8:
                raise ValueError(
                    f"model.{name}={getattr(self, name)} must be a multiple of 8 for the "
                    "grouped expert GEMMs (16-byte rows in bf16)"
                )


# The MoE layers of the debug presets (moe-debug, hybrid-moe-debug): 8 experts of width 32
# (top-2) in 4 groups of which 2 are kept, one shared expert, the first block dense.
DEBUG_ROUTING = {
    "num_experts": 8,
    "top_k": 2,
    "num_shared_experts": 1,
    "moe_ffn_dim": 32,
    "first_k_dense": 1,
    "num_groups": 4,
    "topk_groups": 2,
    "aux_loss_coef": 1e-2,
    "seq_aux_loss_coef": 1e-3,
}

MOE_PRESETS: dict[str, MoEConfig] = {
    # 10,887,424 parameters, 5,249,024 active per token (active_params; 2.1M of it the head):
    # the dense `tiny` with 3 of its 4 FFNs replaced by 8 experts of width 256 (top-2) plus one
    # shared expert, so a token's FFN work equals tiny's (3 x 256 = 768). Sigmoid scores with
    # the aux-loss-free bias and a small sequence aux loss, as DeepSeek-V3.
    "moe-tiny": derive(
        PRESETS["tiny"],
        MoEConfig,
        num_experts=8,
        top_k=2,
        num_shared_experts=1,
        moe_ffn_dim=256,
        first_k_dense=1,
    ),
    # 245,184 parameters, for fast tests: `debug` with 3 blocks, groups, the bias and every
    # auxiliary loss exercised.
    "moe-debug": derive(
        PRESETS["debug"],
        MoEConfig,
        num_layers=3,
        **DEBUG_ROUTING,
        global_aux_loss_coef=1e-2,
        z_loss_coef=1e-3,
    ),
    # The one-GPU MoE benchmark shape: 1,046,041,600 parameters, 191,430,656 active per token
    # (active_params, the 33.5M head included). 64 experts of width 512, top-6, 2 shared
    # (a token's FFN width 8 x 512 = 4096 = the dense first layer's), DeepSeek-V3 routing with
    # 8 groups of which 4 are kept. Vocabulary 32768 so the head does not dominate the step.
    "moe-1b": MoEConfig(
        vocab_size=32768,
        dim=1024,
        num_layers=10,
        num_heads=16,
        num_kv_heads=8,
        ffn_dim=4096,
        max_seq_len=4096,
        rope_theta=500000.0,
        num_experts=64,
        top_k=6,
        num_shared_experts=2,
        moe_ffn_dim=512,
        first_k_dense=1,
        num_groups=8,
        topk_groups=4,
    ),
}


def active_params(cfg: MoEConfig) -> int:
    """Weights one token is multiplied with in the forward pass: attention, dense FFNs, router
    gates, shared experts, top_k routed experts and the output head (the embedding lookup and
    the norms are not matmuls). Forward matmul FLOPs per token = 2 * active_params(cfg)."""
    d, hd = cfg.dim, cfg.head_dim
    attention = 2 * d * cfg.num_heads * hd + 2 * d * cfg.num_kv_heads * hd  # wq, wo; wk, wv
    dense_ffn = 3 * d * cfg.ffn_dim
    moe_ffn = 3 * d * cfg.moe_ffn_dim * (cfg.top_k + cfg.num_shared_experts) + d * cfg.num_experts
    num_moe = cfg.num_layers - cfg.first_k_dense
    return (
        cfg.num_layers * attention
        + cfg.first_k_dense * dense_ffn
        + num_moe * moe_ffn
        + d * cfg.vocab_size
    )


def _topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last dim, ties towards the lower index.

    torch.topk breaks ties arbitrarily (on CPU it often returns the higher index first), and
    exact ties are common once the gate runs in bf16; a stable sort makes the choice the one
    the fused router kernel reproduces.
    """
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


# Router.forward is matched by the fuse_moe_router pass (graphtrain/passes/moe_route.py).
class Router(nn.Module):
    """Token -> top_k experts, their weights, tokens per expert and the auxiliary losses.

    last_nonfinite: tokens of the last forward whose router logits are not all finite (a NaN
    or inf in the gate or its input: their scores, weights and choices mean nothing), an int64
    scalar left on the device (no host sync in the step) for the trainer to sum and check at
    its log steps.

    Balancing state, driven by graphtrain.balance (this file imports no distributed code):
    around each training micro-batch it sets the aux-loss scale and accumulates the counts, and
    an optimizer step pre-hook calls update_bias. Per router:
        expert_bias      fp32 [E] buffer, saved in checkpoints, kept fp32 under .to(bfloat16)
        step_counts      fp32 [E] buffer, not saved: counts of the optimizer step so far
        step_plain_counts  fp32 [E] buffer, not saved: the step's plain top-k counts (global_aux)
        aux_loss_scale   fp32 scalar buffer, not saved: the micro-batch's loss weight
        reduce_counts    None, or Tensor -> Tensor (an all-reduce over data-parallel ranks)
        last_counts      tokens per expert of the last forward, reduced (detached)
        last_plain_counts  the same for the plain top-k (global_aux only, else None)
        last_aux         {"aux" | "seq_aux" | "global_aux" | "z": detached value}, last forward
        accumulate_counts()  step_counts += last_counts (and the plain ones), after each
                             micro-batch's backward
        update_bias(rate)    expert_bias += rate * sign(mean - step_counts); both counts = 0
    The forward only assigns attributes (no in-place updates), so re-running it (activation
    checkpoint recompute) changes nothing.
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.last_nonfinite: torch.Tensor | None = None
        bias = torch.zeros(cfg.num_experts) if cfg.expert_bias else None
        self.register_buffer("expert_bias", bias)
        self.register_buffer("step_counts", torch.zeros(cfg.num_experts), persistent=False)
        plain = torch.zeros(cfg.num_experts) if cfg.global_aux_loss_coef else None
        self.register_buffer("step_plain_counts", plain, persistent=False)
        self.register_buffer("aux_loss_scale", torch.ones(()), persistent=False)
        self.reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.last_counts: torch.Tensor | None = None
        self.last_plain_counts: torch.Tensor | None = None
        self.last_aux: dict[str, torch.Tensor] = {}

    def forward(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x: (B, L, dim). Returns weights (B*L, k) fp32, expert indices (B*L, k) int64, tokens
        per expert (E,) int64, and the sum of the enabled auxiliary losses (fp32) or None."""
        cfg = self.cfg
        B, L, _ = x.shape
        logits = self.gate(x.flatten(0, 1)).float()  # (T, E)
        # Counted on the logits, the fused router's input (graphtrain.passes.fuse_moe_router):
        # finite logits give finite scores, and the op's own outputs stay as they are.
        self.last_nonfinite = (~torch.isfinite(logits)).any(-1).sum()
        if cfg.force_balance and self.training:
            # Random routing, straight-through gradient: the values are noise, the gradient
            # reaches the gate as if they were the logits.
            logits = torch.randn_like(logits) + (logits - logits.detach())
        if cfg.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        elif cfg.pre_softmax:
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = logits
        sel = scores if self.expert_bias is None else scores + self.expert_bias
        if cfg.num_groups > 1:
            sel = self._limit_groups(sel)
        indices = _topk_indices(sel, cfg.top_k)  # (T, k)
        hits = None  # (T, E): 1 at each token's plain top-k, what the balance losses count
        if cfg.aux_loss_coef or cfg.seq_aux_loss_coef or cfg.global_aux_loss_coef:
            limited = cfg.num_groups > 1 and cfg.topk_groups < cfg.num_groups
            plain = indices
            if self.expert_bias is not None or limited:
                plain = _topk_indices(scores, cfg.top_k)  # no bias, no group limit
            hits = torch.zeros_like(scores).scatter(1, plain, 1.0)
        weights = scores.gather(1, indices)  # unbiased: the bias never changes the weights
        if cfg.score_func == "softmax" and not cfg.pre_softmax:
            weights = torch.softmax(weights, dim=-1)
        elif cfg.normalize_weights:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * cfg.route_scale
        counts = torch.bincount(indices.flatten(), minlength=cfg.num_experts)  # (E,)
        reduced, plain_reduced = counts.float(), None
        if cfg.global_aux_loss_coef:
            # The plain counts ride along in the same all-reduce.
            reduced = torch.cat([reduced, hits.sum(0)])
        if self.reduce_counts is not None:
            reduced = self.reduce_counts(reduced)
        if cfg.global_aux_loss_coef:
            reduced, plain_reduced = reduced[: cfg.num_experts], reduced[cfg.num_experts :]
        losses = self._aux_losses(logits, scores, hits, plain_reduced, B, L)
        self.last_counts = reduced.detach()
        if plain_reduced is not None:
            self.last_plain_counts = plain_reduced.detach()
        self.last_aux = {name: loss.detach() for name, loss in losses.items()}
        return weights, indices, counts, sum(losses.values()) if losses else None

    def _limit_groups(self, sel: torch.Tensor) -> torch.Tensor:
        """Keep the topk_groups groups with the largest top-2 sums; the others' experts -> -inf."""
        cfg = self.cfg
        grouped = sel.unflatten(-1, (cfg.num_groups, -1))  # (T, G, E/G)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # (T, G)
        keep = _topk_indices(group_scores, cfg.topk_groups)
        drop = torch.ones_like(group_scores, dtype=torch.bool).scatter(1, keep, False)
        return grouped.masked_fill(drop.unsqueeze(-1), float("-inf")).flatten(1)

    def _aux_losses(
        self,
        logits: torch.Tensor,
        scores: torch.Tensor,
        hits: torch.Tensor | None,
        plain_reduced: torch.Tensor | None,
        B: int,
        L: int,
    ) -> dict[str, torch.Tensor]:
        """The enabled losses; hits (T, E): each token's plain top-k (module docstring),
        plain_reduced: their counts summed over the ranks that route other tokens."""
        cfg = self.cfg
        E, k, T = cfg.num_experts, cfg.top_k, B * L
        losses = {}
        if cfg.aux_loss_coef or cfg.seq_aux_loss_coef or cfg.global_aux_loss_coef:
            if cfg.score_func == "sigmoid":
                p = scores / scores.sum(-1, keepdim=True)
            elif cfg.pre_softmax:
                p = scores
            else:
                p = torch.softmax(logits, dim=-1)
            p_sum = p.sum(0)  # (E,)
            if cfg.aux_loss_coef:
                counts = hits.sum(0)  # (E,)
                losses["aux"] = cfg.aux_loss_coef * E / (k * T * T) * (p_sum * counts).sum()
            if cfg.seq_aux_loss_coef:
                p_seq = p.view(B, L, E).sum(1)  # (B, E)
                c_seq = hits.view(B, L, E).sum(1)  # (B, E)
                per_seq = E / (k * L * L) * (p_seq * c_seq).sum(1)  # (B,)
                losses["seq_aux"] = cfg.seq_aux_loss_coef * per_seq.mean()
            if cfg.global_aux_loss_coef:
                gcounts = self.step_plain_counts + plain_reduced
                global_tokens = gcounts.sum() / k
                losses["global_aux"] = (
                    cfg.global_aux_loss_coef * E / (k * T) * (p_sum * gcounts).sum() / global_tokens
                )
        if cfg.z_loss_coef:
            losses["z"] = cfg.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()
        return losses

    @torch.no_grad()
    def accumulate_counts(self) -> None:
        """step_counts += last_counts (step_plain_counts += last_plain_counts):
        graphtrain.balance calls it after each micro-batch."""
        self.step_counts += self.last_counts
        if self.step_plain_counts is not None and self.last_plain_counts is not None:
            self.step_plain_counts += self.last_plain_counts

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """Once per optimizer step: move expert_bias towards balance, then reset the counts."""
        if self.expert_bias is not None and rate:
            self.expert_bias += rate * torch.sign(self.step_counts.mean() - self.step_counts)
        self.step_counts.zero_()
        if self.step_plain_counts is not None:
            self.step_plain_counts.zero_()

    def init_weights(self, std: float) -> None:
        init_trunc_normal(std, self.gate.weight)
        for buf in (self.expert_bias, self.step_counts, self.step_plain_counts):
            if buf is not None:
                nn.init.zeros_(buf)
        nn.init.ones_(self.aux_loss_scale)

    def _apply(self, fn, recurse=True):
        # The buffers stay fp32 whatever the model is cast to: update_bias's steps (1e-3) are
        # below bf16's resolution near 1, and counts above 256 would round. The original fp32
        # tensor is moved, so a cast is never rounded and cast back.
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, buf in before.items():
            after = self._buffers[name]
            if buf is not None and after is not None and after.dtype != buf.dtype:
                self._buffers[name] = buf.to(after.device)
        return self


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (N, in) @ w[e].T for each expert e on its rows offs[e-1]:offs[e]; w: (E, out, in)."""
    if torch.is_autocast_enabled(x.device.type):
        # torch._grouped_mm is on none of autocast's op lists (pytorch issue 174763): cast as
        # autocast casts a linear.
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


# w1 and w3 merged by fuse_sibling_grouped_mm; each grouped GEMM taken by fp8_linear (FP8 on).
def swiglu_experts(
    xs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of expert e on its counts[e] contiguous rows of xs (N, dim), as grouped GEMMs."""
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)  # end row of each expert
    h = F.silu(_grouped_mm(xs, w1, offs)) * _grouped_mm(xs, w3, offs)
    return _grouped_mm(h, w2, offs)


# The hidden (ffn) dim of each GroupedExperts weight: what expert tensor parallel splits.
EXPERT_HIDDEN_DIM = {"w1": 1, "w2": 2, "w3": 1}


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights (torchtitan's layout), run as grouped GEMMs on rows
    already sorted by expert.

    No padding of the token groups: bf16 and fp32 grouped GEMMs accept any group size, zero
    included (only FP8/MXFP8 need groups of 16/32 rows, torchtitan PR 2255).
    Under expert parallelism this module's input and output are moved by hooks around it
    (graphtrain.parallel.expert_parallel): it then sees the rows other ranks send to its own
    experts, and its weights are shards of the full ones (DTensors), read as their local block
    (`to_local`) in the rows' dtype: variable-size groups of rows are no sharded layout, and
    FSDP's mixed precision does not cast weights it does not manage.
    """

    def __init__(self, num_experts: int, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows xs (N, dim) sorted by expert, counts[e] rows for expert e -> outputs (N, dim)."""
        w1, w2, w3 = (_local_block(w, xs.dtype) for w in (self.w1, self.w2, self.w3))
        return swiglu_experts(xs, counts, w1, w2, w3)

    def init_weights(self, std: float, out_std: float) -> None:
        init_trunc_normal(std, self.w1, self.w3)
        init_trunc_normal(out_std, self.w2)


def _local_block(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A sharded weight -> this rank's block in the rows' dtype; a plain weight as it is."""
    return w.to_local().to(dtype) if is_sharded(w) else w


# Permute and combine: matched by the fuse_moe_dispatch pass (passes/fuse_moe_dispatch.py).
def routed_experts(
    experts: GroupedExperts,
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """x (T, dim); weights, indices (T, k); counts (E,) -> sum_j weights[t, j] *
    expert_{indices[t, j]}(x[t]), (T, dim) in x's dtype: permute, experts, combine."""
    T, k = indices.shape
    # Slots (token, j) sorted by expert, token order kept within an expert.
    order = torch.argsort(indices.flatten(), stable=True)  # (T*k,)
    xs = x[order // k]  # (T*k, dim): each expert's tokens contiguous
    ys = experts(xs, counts)  # (T*k, dim)
    y = torch.empty_like(ys).index_copy_(0, order, ys)  # back to slot order
    out = (y.view(T, k, -1).float() * weights.unsqueeze(-1)).sum(1)  # (T, dim) fp32
    return out.to(x.dtype)


class AuxLossInjector(torch.autograd.Function):
    """Identity on `out`; backward also hands `aux` the gradient `scale`, as if scale * aux had
    been added to the loss (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad, scale.clone(), None


class MoE(nn.Module):
    """Router + routed experts + shared experts; the FFN of an MoE block."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.moe_ffn_dim)
        self.shared_experts = (
            FeedForward(cfg.dim, cfg.num_shared_experts * cfg.moe_ffn_dim)
            if cfg.num_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L, dim) -> (B, L, dim)."""
        weights, indices, counts, aux = self.router(x)
        flat = x.flatten(0, 1)  # (T, dim)
        out = routed_experts(self.experts, flat, weights, indices, counts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        out = out.view_as(x)
        if aux is not None:
            out = AuxLossInjector.apply(out, aux, self.router.aux_loss_scale)
        return out

    def init_weights(self, std: float, out_std: float) -> None:
        self.router.init_weights(std)
        self.experts.init_weights(std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std, out_std)


class MoEBlock(TransformerBlock):
    """A transformer block whose position-wise network is an MoE layer, named `moe`."""

    def build_ffn(self, cfg: MoEConfig) -> None:
        self.moe = MoE(cfg)

    @property
    def ffn(self) -> nn.Module:
        return self.moe


class MoEGPT(GPT):
    """GPT with MoE blocks after the first cfg.first_k_dense dense ones; same forward contract."""

    cfg: MoEConfig

    def build_block(self, layer_id: int) -> nn.Module:
        return (MoEBlock if self.is_moe_layer(layer_id) else TransformerBlock)(self.cfg)

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.cfg.first_k_dense

    def routers(self) -> list[tuple[str, Router]]:
        """(layer name, router) of every MoE block present, e.g. ("layers.1", router), the MTP
        layers' blocks included ("mtp_layers.0.block")."""
        blocks = [(f"layers.{name}", layer) for name, layer in self.layers.items()]
        if self.cfg.mtp_depth:
            blocks += [(f"mtp_layers.{n}.block", m.block) for n, m in self.mtp_layers.items()]
        return [(name, block.moe.router) for name, block in blocks if isinstance(block, MoEBlock)]

    @torch.no_grad()
    def set_aux_loss_scale(self, scale: float | torch.Tensor) -> None:
        """The weight of this micro-batch's auxiliary losses (its loss weight, e.g. 1/num_micro);
        filled into every router's buffer in place, so compiled code does not recompile."""
        for _, router in self.routers():
            router.aux_loss_scale.fill_(scale)


def build_moe(cfg: MoEConfig) -> MoEGPT:
    return MoEGPT(cfg)
