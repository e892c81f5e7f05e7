"""Exact training FLOPs of a Llama-style decoder, for tokens/s -> MFU.

What
    training_flops counts the floating-point operations of one forward + backward pass of a
    decoder with RMSNorm, RoPE, grouped-query attention, a SwiGLU feed-forward network and an
    output head (tied or untied: the same count), over num_tokens tokens whose attention mask
    allows num_attention_pairs (query, key) pairs; model_training_flops adds what a model
    config has besides (MoE routed and shared experts, MTP depths, Gated DeltaNet blocks, the
    gate projection of Qwen3-Next's gated attention).
        forward        = num_tokens * (num_layers * layer_matmul + head)
                         + num_attention_pairs * num_layers * 4 * head_dim * num_heads
        training_flops = 3 * forward    (a matmul's backward is two matmuls of its size)

Contract
    "Model FLOPs" (PaLM's MFU definition): the recompute of attention scores in a
    flash-attention backward and activation checkpointing are not counted. Exact for the
    matmuls and attention pairs (so causal and packed-document masks are counted as they
    are); the O(dim)-per-token work (embedding lookup, norms, RoPE, activations, softmax, the
    loss, the optimizer step) is left out: under 1% of the total for real models.
    The derivation, MTP and hybrid blocks, and a worked example: docs/design/flops.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from models.gpt import GPTConfig
from models.hybrid import GDN
from models.moe import MoEConfig, active_params


def training_flops(
    *,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    ffn_dim: int,
    vocab_size: int,
    num_tokens: int,
    num_attention_pairs: int,
) -> int:
    """Forward + backward FLOPs of a Llama-style decoder (see the module docstring)."""
    for name, value in (
        ("dim", dim),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("ffn_dim", ffn_dim),
        ("vocab_size", vocab_size),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if num_tokens < 0 or num_attention_pairs < 0:
        raise ValueError(
            f"num_tokens ({num_tokens}) and num_attention_pairs ({num_attention_pairs}) "
            "must be >= 0"
        )
    if dim % num_heads != 0:
        raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
        )
    head_dim = dim // num_heads
    q_dim = num_heads * head_dim
    kv_dim = num_kv_heads * head_dim
    layer_matmul = (
        2 * dim * q_dim  # wq
        + 2 * 2 * dim * kv_dim  # wk, wv
        + 2 * q_dim * dim  # wo
        + 3 * 2 * dim * ffn_dim  # w1, w3, w2
    )
    head = 2 * dim * vocab_size
    attention_per_pair = num_layers * 4 * head_dim * num_heads  # q.k and p*v, every head
    forward = num_tokens * (num_layers * layer_matmul + head)
    forward += num_attention_pairs * attention_per_pair
    return 3 * forward


def model_training_flops(cfg: Any, *, num_tokens: int, num_attention_pairs: int) -> int:
    """training_flops with the shape read from a model config (models.GPTConfig's fields).

    MoE models (models.MoEConfig): the matmuls a token runs are those of the active parameters
    (attention, dense FFNs, router gate, shared experts and its top_k routed experts, head;
    models.moe.active_params), 2 FLOPs each per token forward, plus the same attention term;
    backward = 2 * forward as above. Tokens are counted once per routed expert they visit.

    MTP depths (cfg.mtp_depth): counted as that many more layers of the last layer's kind, plus
    each depth's 2*dim -> dim projection and output head (module docstring).
    """
    if getattr(cfg, "layer_pattern", None) is not None:
        return _hybrid_training_flops(cfg, num_tokens, num_attention_pairs)
    depth = getattr(cfg, "mtp_depth", 0)
    if depth:
        extra = {"num_layers": cfg.num_layers + depth, "mtp_depth": 0}
        if isinstance(cfg, MoEConfig) and cfg.first_k_dense == cfg.num_layers:
            extra["first_k_dense"] = cfg.num_layers + depth  # an all-dense trunk: dense MTP blocks
        deeper = dataclasses.replace(cfg, **extra)
        per_token = 2 * 2 * cfg.dim * cfg.dim + 2 * cfg.dim * cfg.vocab_size  # eh_proj, head
        return (
            model_training_flops(
                deeper, num_tokens=num_tokens, num_attention_pairs=num_attention_pairs
            )
            + 3 * depth * num_tokens * per_token
        )
    if isinstance(cfg, MoEConfig):
        attention_per_pair = cfg.num_layers * 4 * cfg.head_dim * cfg.num_heads
        forward = num_tokens * 2 * active_params(cfg) + num_attention_pairs * attention_per_pair
        return 3 * forward
    return training_flops(
        dim=cfg.dim,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        ffn_dim=cfg.ffn_dim,
        vocab_size=cfg.vocab_size,
        num_tokens=num_tokens,
        num_attention_pairs=num_attention_pairs,
    )


def dense_causal_pairs(batch_size: int, seq_len: int) -> int:
    """(query, key) pairs of a causal mask: each sequence of T tokens has T*(T+1)/2."""
    if batch_size < 0 or seq_len < 0:
        raise ValueError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be >= 0")
    return batch_size * seq_len * (seq_len + 1) // 2


def document_causal_pairs(document_lengths: Iterable[int]) -> int:
    """Pairs of a document-causal mask (packed sequences): sum over documents of L*(L+1)/2."""
    total = 0
    for length in document_lengths:
        if length < 0:
            raise ValueError(f"document length must be >= 0, got {length}")
        total += length * (length + 1) // 2
    return total


def gated_deltanet_forward_flops_per_token(cfg: Any) -> int:
    """Forward FLOPs per token of one Gated DeltaNet mixer (module docstring), from a
    models.HybridConfig."""
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv, C = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_chunk_size
    key_dim, value_dim = Hk * Dk, Hv * Dv
    projections = 2 * cfg.dim * (2 * key_dim + 2 * value_dim + 2 * Hv) + 2 * value_dim * cfg.dim
    rule = Hv * (C * (5 * Dk + 3 * Dv + 2) + 6 * Dk * Dv)
    return projections + rule


def _hybrid_training_flops(cfg: Any, num_tokens: int, num_attention_pairs: int) -> int:
    # The same model with plain attention in every block (its MTP blocks are attention blocks
    # in both), then each GDN block's attention swapped for the GDN mixer and, with
    # gated_attention, each attention block's output-gate projection (wq's second half,
    # dim -> q_dim) added. GatedAttention's q/k norms and sigmoid gate are elementwise
    # (O(dim) per token), left out as every norm and activation is.
    base_cls = MoEConfig if isinstance(cfg, MoEConfig) else GPTConfig
    base = base_cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(base_cls)})
    num_gdn = sum(cfg.mixer(i) == GDN for i in range(cfg.num_layers))
    num_attention = cfg.num_layers - num_gdn + cfg.mtp_depth
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention_matmul = 2 * cfg.dim * q_dim + 2 * 2 * cfg.dim * kv_dim + 2 * q_dim * cfg.dim
    attention_per_pair = 4 * cfg.head_dim * cfg.num_heads
    swap = num_tokens * (gated_deltanet_forward_flops_per_token(cfg) - attention_matmul)
    swap -= num_attention_pairs * attention_per_pair
    gates = num_attention * num_tokens * 2 * cfg.dim * q_dim if cfg.gated_attention else 0
    return model_training_flops(
        base, num_tokens=num_tokens, num_attention_pairs=num_attention_pairs
    ) + 3 * (num_gdn * swap + gates)
