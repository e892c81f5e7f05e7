"""Tensor-parallel plan for models/gpt.py: module-path patterns -> style names.

Plain strings, so models/ imports no distributed code; graphtrain.parallel.tensor_parallel maps
each name to a torch.distributed.tensor.parallel style. "*" matches one path component.
The layout over the tp axis of each entry is explained beside it (B batch, T sequence, V vocab;
"Shard(1)" = split on T). input_ids (B, T) arrive full on every rank; per block, h is a DTensor
Shard(1), (B, T/tp, dim) on each rank (sequence parallel). The residual adds inside a block are
on the local T slices: no communication. A tied output head (cfg.tie_embeddings) shares the
table with tok_embeddings: both split on V.
"""

from __future__ import annotations

GPT_TP_PLAN: dict[str, str] = {
    # table split on V; each rank looks up its rows, the partial sums are reduce-scattered -> h
    # Shard(1)
    "tok_embeddings": "embedding_rowwise",
    # norm runs on the local T slice; weight replicated
    "layers.*.attention_norm": "sequence_parallel",
    # all-gather x on T -> Replicate; rope (B, T, D/2, 2) and attn_mask (None, bool (B,1,T,T)
    # or BlockMask) pass through untouched (full sequence everywhere)
    "layers.*.attention": "gather_sequence",
    # wq, wk, wv split on heads: each rank attends with H/tp heads
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    # split on heads (its input dim); the partial outputs are reduce-scattered onto T -> Shard(1)
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "sequence_parallel",
    "layers.*.feed_forward": "gather_sequence",
    "layers.*.feed_forward.w1": "colwise",  # split on ffn_dim
    "layers.*.feed_forward.w2": "rowwise",  # split on ffn_dim, reduce-scatter onto T
    "layers.*.feed_forward.w3": "colwise",  # split on ffn_dim
    "norm": "sequence_parallel",
    # all-gather on T, split on V, logits all-gathered to full (B, T, V) so F.cross_entropy
    # stays plain
    "output": "colwise_head",
}


def mtp_tp_plan(plan: dict[str, str], moe_block: bool) -> dict[str, str]:
    """The entries of the MTP layers (models/mtp.py, "mtp_layers.*"), given the trunk's `plan`:
    their own, and the trunk's "layers.*." block entries for the MTP block (an MoE block if
    `moe_block`, else dense). h and Emb(ids) arrive Shard(1) like the trunk's."""
    out = {
        # the (B, T) keep mask, full on every rank, cut to this rank's T slice (Shard(1)); no
        # communication
        "mtp_layers.*": "split_keep_mask",
        "mtp_layers.*.enorm": "sequence_parallel",
        "mtp_layers.*.hnorm": "sequence_parallel",
        # 2*dim -> dim on the local T slice with a replicated weight (no communication; its
        # gradient is partial over tp, summed by reduce_partial_grads)
        "mtp_layers.*.eh_proj": "sequence_local",
    }
    for pattern, style in plan.items():
        if not pattern.startswith("layers.*."):
            continue
        rest = pattern.removeprefix("layers.*.")
        # Only entries that match a module of the MTP block (a pattern must match a module).
        if rest.startswith("feed_forward" if moe_block else "moe"):
            continue
        out[f"mtp_layers.*.block.{rest}"] = style
    return out
