"""Attention masks for packed sequences: attention stays inside each document, and is causal.

The model takes the mask as an argument and dispatches on its type (models/gpt.py):
  * "flex": a FlexAttention BlockMask. The GPU path: the compiled flex kernel skips every
    (query-block, key-block) tile that lies across documents or above the diagonal, so packed
    rows cost what their documents cost. Chosen over a varlen flash-attention call because it
    traces through torch.compile as one op with its own backward, needs no cu_seqlens plumbing
    through the blocks, handles GQA, and the same mask_mod serves later variants (sliding
    window, prefix-LM) without new kernels.
  * "sdpa": a dense bool mask (B, 1, T, T) for scaled_dot_product_attention. Works everywhere,
    including the CPU (FlexAttention has no CPU backward in torch 2.13), at O(T^2) memory.
  * "causal": None; plain causal attention over the whole row (documents see each other).
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

ATTENTION_KINDS = ("flex", "sdpa", "causal")


def resolve_attention(kind: str, device: torch.device) -> str:
    """ "auto" -> flex on CUDA, sdpa elsewhere; an explicit choice is checked."""
    if kind == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if kind not in ATTENTION_KINDS:
        raise ValueError(
            f"training.attention must be auto or one of {ATTENTION_KINDS}, got {kind!r}"
        )
    if kind == "flex" and device.type != "cuda":
        raise ValueError(
            "training.attention='flex' needs a CUDA device (FlexAttention has no CPU backward); "
            "use 'sdpa' on CPU"
        )
    return kind


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) bool, True where query q may attend to key k."""
    T = document_ids.shape[1]
    same_doc = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)


# Building the block mask runs the mask_mod over every tile: compile it once, reuse per step.
@functools.cache
def _compiled_create_block_mask():
    return torch.compile(create_block_mask)


def document_block_mask(document_ids: torch.Tensor) -> BlockMask:
    B, T = document_ids.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (q_idx >= kv_idx)

    return _compiled_create_block_mask()(mask_mod, B, None, T, T, device=document_ids.device)


def build_attention_mask(document_ids: torch.Tensor, kind: str) -> torch.Tensor | BlockMask | None:
    if kind == "flex":
        return document_block_mask(document_ids)
    if kind == "sdpa":
        return document_causal_mask(document_ids)
    return None
