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
  * "varlen": DocumentSpans (models/gpt.py), the documents' offsets in the flattened batch, for
    torch's varlen_attn: FlashAttention-2's variable-length kernel, which visits only the
    (document, document) tiles. CUDA only; a measured alternative to flex, not the default.
  * "causal": None; plain causal attention over the whole row (documents see each other).
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from models.gpt import AttnMask, DocumentSpans

ATTENTION_KINDS = ("flex", "varlen", "sdpa", "causal")


def resolve_attention(kind: str, device: torch.device) -> str:
    """ "auto" -> flex on CUDA, sdpa elsewhere; an explicit choice is checked."""
    if kind == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if kind not in ATTENTION_KINDS:
        raise ValueError(
            f"training.attention must be auto or one of {ATTENTION_KINDS}, got {kind!r}"
        )
    if kind in ("flex", "varlen") and device.type != "cuda":
        why = "FlexAttention has no CPU backward" if kind == "flex" else "a FlashAttention kernel"
        raise ValueError(
            f"training.attention={kind!r} needs a CUDA device ({why}); use 'sdpa' on CPU"
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


def document_spans(document_ids: torch.Tensor) -> DocumentSpans:
    """(B, T) document ids -> DocumentSpans: a document starts where the id changes and at each
    row (the packer numbers a row's documents 0, 1, 2, ...: a document is a run of one id).
    cu_seqlens is padded with empty spans to a power-of-two length, so that the compiled
    regions (and MTP's CUDA graphs) see a few shapes, not one per document count; max_len is
    T, a bound that needs no device sync. Meant for the loader's CPU ids (the start positions
    have a data-dependent size: on a GPU, finding them would wait for the device)."""
    B, T = document_ids.shape
    ids = document_ids.reshape(-1)
    start = torch.ones_like(ids, dtype=torch.bool)
    start[1:] = ids[1:] != ids[:-1]
    start[::T] = True
    starts = start.nonzero().flatten()
    size = 1 << len(starts).bit_length()  # > len(starts): room for the closing B * T
    cu = torch.full((size,), B * T, dtype=torch.int32, device=document_ids.device)
    cu[: len(starts)] = starts
    return DocumentSpans(cu, T)


def build_attention_mask(
    document_ids: torch.Tensor, kind: str, device: torch.device | None = None
) -> AttnMask:
    """The mask of `kind` for the documents, on `device` (default: the ids')."""
    device = document_ids.device if device is None else device
    if kind == "varlen":
        cu, max_len = document_spans(document_ids)
        if device.type == "cuda" and cu.device.type == "cpu":
            cu = cu.pin_memory()  # so that the copy is asynchronous
        return DocumentSpans(cu.to(device, non_blocking=True), max_len)
    document_ids = document_ids.to(device, non_blocking=True)
    if kind == "flex":
        return document_block_mask(document_ids)
    if kind == "sdpa":
        return document_causal_mask(document_ids)
    return None
