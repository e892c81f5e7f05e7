"""Gated DeltaNet (GDN) in plain PyTorch, as Qwen3-Next defines it: the layer and its recurrence.

What: `GatedDeltaNet` maps (B, T, dim) -> (B, T, dim): projections q/k/v/z (in_proj_qkvz, grouped
by key head as Qwen3-Next stores them) and b/a (in_proj_ba); a causal depthwise convolution of
width conv_kernel over q, k, v (channels grouped by key head) followed by SiLU; L2-normalised q
and k; per value head
    g = -exp(A_log) * softplus(a + dt_bias) (the log decay, < 0),   beta = sigmoid(b);
the gated delta rule on a state S (key_head_dim x value_head_dim) per value head,
    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,   a_t = exp(g_t),
    o_t = S_t^T (q_t / sqrt(key_head_dim));
RMSNorm of o per head gated by SiLU(z), and out_proj. Value heads outnumber key heads by an
integer ratio r: each q/k head serves r consecutive value heads.

Packed documents: `document_ids` (B, T) (None: each row is one document). Where the document
changes the state restarts from zero (a_t = 0) and the convolution reads no earlier position,
so no information crosses documents, as with attention's block-diagonal mask.

`chunk_gated_delta_rule` is the chunked form the model runs (chunks of 64 positions: within a
chunk a unit-triangular system inverted and matmuls, across chunks a loop over the state);
`gated_delta_rule_recurrent` is the step-by-step spec it is tested against. Numerics: the
recurrence and its state in fp32 whatever the input dtype (float64 stays float64), the output
in v's dtype. The compiler's pass (graphtrain.passes.gated_delta_rule) may replace the chunked
function with a fused kernel of the same contract.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.fx.traceback
import torch.nn.functional as F
from torch import nn

from models.layers import RMSNorm, init_trunc_normal, local_tensor

# The loop over chunks, (q_state, intra, u_v, u_s, k_end, chunk_decay) -> o: `chunk_recurrence`.
Recurrence = Callable[..., torch.Tensor]

# (I + L)^-1 of strictly lower-triangular L [..., C, C]: `unit_lower_inverse`.
Inverse = Callable[[torch.Tensor], torch.Tensor]

# The annotation key of the recurrence region (gated_delta_rule): a compiler pass looks for it.
REGION_KEY = "gated_delta_rule_region"


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32, returned in x's dtype (FLA's form)."""
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def segment_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, T) int64 numbers that grow by one wherever the id changes from
    the previous position: equal numbers mark one contiguous document, whatever the ids were."""
    change = document_ids[:, 1:] != document_ids[:, :-1]
    return F.pad(change.long().cumsum(1), (1, 0))


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, segments: torch.Tensor | None
) -> torch.Tensor:
    """Depthwise causal convolution. x: (B, T, C); weight: (C, 1, K) as nn.Conv1d stores it, so
    out_t = sum_m weight[:, 0, K-1-m] * x_{t-m}; positions of another segment read as zero."""
    K = weight.shape[-1]
    T = x.shape[1]
    w = weight.squeeze(1)  # (C, K)
    out = x * w[:, K - 1]
    for m in range(1, K):
        shifted = F.pad(x, (0, 0, m, 0))[:, :T]  # x_{t-m}, zero before the row
        if segments is not None:
            same = F.pad(segments, (m, 0), value=-1)[:, :T] == segments  # (B, T)
            shifted = shifted * same.unsqueeze(-1)
        out = out + shifted * w[:, K - 1 - m]
    return out


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segments: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    recurrence: Recurrence | None = None,
    inverse: Inverse | None = None,
) -> torch.Tensor:
    """The gated delta rule, chunked. q, k: (B, T, H, Dk); v: (B, T, H, Dv); g (log decay, <= 0),
    beta: (B, T, H); segments: (B, T) from `segment_ids` or None. Returns o (B, T, H, Dv) in v's
    dtype; the state starts at zero in each row and at each segment start. scale: q's factor
    (default Dk ** -0.5). recurrence: the loop over chunks (default `chunk_recurrence`);
    inverse: each chunk's (I + L)^-1 (default `unit_lower_inverse`); kernels of the same
    contracts may stand in for them.

    Per chunk of C positions with c_i the sum of g over the chunk's positions <= i in i's
    segment and D_ij = exp(c_i - c_j) for j <= i in one segment (else 0), the C delta-rule
    writes u solve (I + L) u = beta v - beta k-read of the incoming state, L_ij = beta_i D_ij
    k_i.k_j (j < i); outputs and the next state follow from u by matmuls (the WY form of
    DeltaNet and FLA's chunk kernels). Computed in fp32 (float64 stays) under autocast too.
    """
    # In the compute dtype whatever autocast says: under it the matmuls would be 16-bit (the
    # decays' masked sums, the system, its inverse: poor, and CPU has no 16-bit triangular
    # solve), where the op computes these terms in fp32 as FLA's kernels accumulate them.
    # (Meta tensors, e.g. counting FLOPs, have no autocast to turn off.)
    no_autocast = q.device.type in ("cpu", "cuda")
    with torch.autocast(q.device.type, enabled=False) if no_autocast else contextlib.nullcontext():
        T, Dk = q.shape[1], q.shape[-1]
        out_dtype = v.dtype
        ct = _compute_dtype(v)
        scale = Dk**-0.5 if scale is None else scale
        C = chunk_size
        pad = (-T) % C
        N = (T + pad) // C
        # (B, H, T, D) in the compute dtype; padding sits after the last position (k = beta = 0
        # there: it writes nothing and changes no earlier output).
        q, k, v = (F.pad(x.transpose(1, 2).to(ct), (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x.transpose(1, 2).to(ct), (0, pad)) for x in (g, beta))
        q = q * scale
        q, k, v = (x.unflatten(2, (N, C)) for x in (q, k, v))  # (B, H, N, C, D)
        g, beta = g.unflatten(2, (N, C)), beta.unflatten(2, (N, C))  # (B, H, N, C)

        decay, state_decay, end_decay = _chunk_decays(g, segments, T)
        chunk_decay = state_decay[..., -1, None, None]  # (B, H, N, 1, 1): the state carried over

        k_beta = k * beta.unsqueeze(-1)
        lower = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
        # The system I + lower inverted once and applied by matmuls (FLA's WY form), not solved for
        # u_v and u_s: C right-hand sides where those solves take Dk + Dv.
        system_inverse = (unit_lower_inverse if inverse is None else inverse)(lower)
        u_v = system_inverse @ (v * beta.unsqueeze(-1))
        u_s = system_inverse @ (k_beta * state_decay.unsqueeze(-1))
        intra = (q @ k.transpose(-1, -2)) * decay  # (B, H, N, C, C)
        q_state = q * state_decay.unsqueeze(-1)
        k_end = k * end_decay.unsqueeze(-1)

        o = (chunk_recurrence if recurrence is None else recurrence)(
            q_state, intra, u_v, u_s, k_end, chunk_decay
        )
        o = o.flatten(2, 3)[:, :, :T]  # (B, H, T, Dv)
        return o.transpose(1, 2).to(out_dtype)


def _chunk_decays(
    g: torch.Tensor, segments: torch.Tensor | None, T: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decays of `chunk_gated_delta_rule` from g (B, H, N, C), chunked and padded, and the
    (B, T) segments or None: D (B, H, N, C, C) between positions of a chunk and segment, the
    incoming state's to each position (0 past a segment start) and each position's to the
    chunk's end (B, H, N, C)."""
    B, _, N, C = g.shape
    if segments is None:
        segments = torch.zeros(B, T, dtype=torch.long, device=g.device)
    seg = torch.cat([segments, segments[:, -1:].expand(B, N * C - T)], 1).view(B, 1, N, C)
    # The segment of the state entering each chunk: the previous chunk's last position's.
    incoming = torch.cat([seg[:, :, :1, :1], seg[:, :, :-1, -1:]], 2)  # (B, 1, N, 1)
    first = seg == incoming  # (B, 1, N, C): position i still sees the incoming state
    causal = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    keep = (seg.unsqueeze(-1) == seg.unsqueeze(-2)) & causal  # (B, 1, N, C, C) [i, j]
    # Cumulative log decay within each chunk and segment, as a masked sum rather than a cumsum:
    # differences of a plain cumsum would carry an earlier document's decays at rounding level
    # into a later one's values and gradients; here they are multiplied by exact zeros.
    c = (keep.to(g.dtype) @ g.unsqueeze(-1)).squeeze(-1)  # (B, H, N, C)
    # Masked to -inf before exp: c_i - c_j > 0 for j > i would overflow.
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~keep, -math.inf).exp()
    state_decay = c.masked_fill(~first, -math.inf).exp()  # read of the incoming state
    end_decay = (c[..., -1:] - c).masked_fill(~keep[..., -1, :], -math.inf).exp()
    return decay, state_decay, end_decay


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + lower)^-1 for strictly lower-triangular `lower` [..., C, C]: one triangular solve
    against the identity."""
    eye = torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device)
    return torch.linalg.solve_triangular(lower + eye, eye.expand_as(lower), upper=False)


def chunk_recurrence(
    q_state: torch.Tensor,
    intra: torch.Tensor,
    u_v: torch.Tensor,
    u_s: torch.Tensor,
    k_end: torch.Tensor,
    chunk_decay: torch.Tensor,
) -> torch.Tensor:
    """The sequential part of `chunk_gated_delta_rule`: over the chunks n of each (B, H), from a
    zero state S_0 (Dk, Dv),
        u_n = u_v[n] - u_s[n] @ S_n                   what chunk n writes
        o_n = q_state[n] @ S_n + intra[n] @ u_n       its output
        S_{n+1} = chunk_decay[n] S_n + k_end[n]^T @ u_n.
    q_state, u_s, k_end (B, H, N, C, Dk); intra (B, H, N, C, C); u_v (B, H, N, C, Dv);
    chunk_decay (B, H, N, 1, 1). Returns o (B, H, N, C, Dv)."""
    B, H, N, _, Dk = u_s.shape
    state = u_v.new_zeros(B, H, Dk, u_v.shape[-1])
    outs = []
    for n in range(N):
        u = u_v[:, :, n] - u_s[:, :, n] @ state
        outs.append(q_state[:, :, n] @ state + intra[:, :, n] @ u)
        state = state * chunk_decay[:, :, n] + k_end[:, :, n].transpose(-1, -2) @ u
    return torch.stack(outs, 2)


@torch.compiler.nested_compile_region
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segments: torch.Tensor | None,
    chunk_size: int,
    scale: float,
) -> torch.Tensor:
    """`chunk_gated_delta_rule` marked as one region for the compiler: under torch.compile it is
    a single invoke_subgraph node whose operands are the tensors (q, k, v, g, beta[, segments])
    and whose nodes carry the annotation {REGION_KEY: {"chunk_size", "scale"}}, so a pass can
    replace the whole recurrence with a kernel. In eager both markers do nothing."""
    with torch.fx.traceback.annotate({REGION_KEY: {"chunk_size": chunk_size, "scale": scale}}):
        return chunk_gated_delta_rule(q, k, v, g, beta, segments, chunk_size, scale)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segments: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The gated delta rule one position at a time: the spec `chunk_gated_delta_rule` keeps
    (same arguments, no chunk_size)."""
    B, T, H, Dk = q.shape
    ct = _compute_dtype(v)
    scale = Dk**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(ct) for x in (q, k, v, g, beta))
    state = torch.zeros(B, H, Dk, v.shape[-1], dtype=ct, device=q.device)
    outs = []
    for t in range(T):
        a = g[:, t].exp()  # (B, H)
        if segments is not None and t > 0:
            a = a * (segments[:, t] == segments[:, t - 1]).unsqueeze(-1)
        state = state * a[..., None, None]
        read = (state * k[:, t, :, :, None]).sum(-2)  # (B, H, Dv): S^T k
        write = beta[:, t, :, None] * (v[:, t] - read)
        state = state + k[:, t, :, :, None] * write[:, :, None, :]
        outs.append((state * (q[:, t] * scale)[..., None]).sum(-2))
    return torch.stack(outs, 1).to(v.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm over the last dim, then times SiLU(z) (Qwen3-Next's RMSNormGated)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(x.dtype)
        return (out * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The token mixer of a GDN block: Qwen3-Next's Qwen3NextGatedDeltaNet, with its parameter
    names and, but for one, its layouts. in_proj_qkvz and in_proj_ba are grouped by key head
    as Qwen3-Next stores them; conv1d's channels are grouped by key head too (q, k and the r
    value heads' v of key head 0, then of head 1, ...) where Qwen3-Next orders them all q, all
    k, all v. So every per-head tensor is a contiguous block per key head, and tensor
    parallelism splits each on its first dim (models/hybrid_plan.py); the Hugging Face export
    reorders conv1d (models/hybrid_hf.py)."""

    def __init__(
        self,
        dim: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel: int,
        norm_eps: float,
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        self.key_head_dim = key_head_dim
        self.value_head_dim = value_head_dim
        self.ratio = num_value_heads // num_key_heads  # value heads per key head
        self.chunk_size = chunk_size
        key_dim, value_dim = num_key_heads * key_head_dim, num_value_heads * value_head_dim
        self.in_proj_qkvz = nn.Linear(dim, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(dim, 2 * num_value_heads, bias=False)
        conv_dim = 2 * key_dim + value_dim
        # Only the weight is used (causal_conv1d): nn.Conv1d keeps Qwen3-Next's name and shape;
        # its channels grouped by key head (class docstring).
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(num_value_heads))
        self.A_log = nn.Parameter(torch.empty(num_value_heads))
        self.norm = GatedRMSNorm(value_head_dim, norm_eps)
        self.out_proj = nn.Linear(value_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, dim); document_ids: (B, T) or None (each row one document)."""
        B, T, _ = x.shape
        Dk, Dv, r = self.key_head_dim, self.value_head_dim, self.ratio
        mixed_width = 2 * Dk + r * Dv  # one key head's q, k and its r value heads' v
        # -1 heads: under tensor parallelism each rank holds a slice of the key heads.
        qkvz = self.in_proj_qkvz(x).view(B, T, -1, mixed_width + r * Dv)  # (B, T, Hk, ...)
        # Slices, not split: split's backward is a cat whose output strides eager and fake
        # tensors disagree on here (transposed gradients in), and the compiled backward's view
        # of it then fails (torch 2.13, aot_eager).
        mixed, z = qkvz[..., :mixed_width], qkvz[..., mixed_width:]
        ba = self.in_proj_ba(x).view(B, T, -1, 2 * r)
        b, a = ba[..., :r], ba[..., r:]
        z = z.reshape(B, T, -1, Dv)  # (B, T, Hv, Dv)
        b, a = b.reshape(B, T, -1), a.reshape(B, T, -1)  # (B, T, Hv)
        segments = None if document_ids is None else segment_ids(document_ids)
        # The convolution's channels are grouped by key head (q, k, v of head 0, then head 1,
        # ...; class docstring), so (B, T, Hk, mixed_width) flattens onto them.
        weight = local_tensor(self.conv1d.weight)
        mixed = F.silu(causal_conv1d(mixed.reshape(B, T, -1), weight, segments))
        q, k, v = mixed.unflatten(-1, (-1, mixed_width)).split([Dk, Dk, r * Dv], dim=-1)
        q, k = l2norm(q), l2norm(k)  # (B, T, Hk, Dk)
        v = v.reshape(B, T, -1, Dv)  # (B, T, Hv, Dv)
        if r > 1:
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        beta = b.sigmoid()
        # fp32: exp(A_log) and softplus in bf16 lose the small decays that matter over a chunk.
        A_log, dt_bias = local_tensor(self.A_log), local_tensor(self.dt_bias)
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
        o = gated_delta_rule(q, k, v, g, beta, segments, self.chunk_size, Dk**-0.5)
        o = self.norm(o, z)  # (B, T, Hv, Dv)
        return self.out_proj(o.flatten(2))

    def init_weights(self, std: float, out_std: float) -> None:
        init_trunc_normal(std, self.in_proj_qkvz.weight, self.in_proj_ba.weight)
        init_trunc_normal(out_std, self.out_proj.weight)
        bound = self.conv1d.weight.shape[-1] ** -0.5  # nn.Conv1d's default: fan-in = kernel
        nn.init.uniform_(self.conv1d.weight, -bound, bound)
        with torch.no_grad():
            # Mamba-2 / FLA: A ~ U(1, 16); dt ~ log-uniform in [1e-3, 0.1], dt_bias its
            # inverse softplus, so the decay exp(-A dt) starts between slow and fast.
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(0.1)).exp()
            dt = dt.clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.norm.init_weights()
