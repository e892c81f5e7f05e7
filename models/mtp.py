"""Multi-token prediction (DeepSeek-V3 MTP) in plain PyTorch: the extra layers and the shifts.

What: depth k = 1..D of a model with `mtp_depth` D predicts the token k + 1 positions ahead. Its
layer (MTPLayer) combines the previous depth's hidden state h^(k-1) (h^0: the trunk's last hidden
state, before the final norm) with the embedding of the token k ahead,
    h^k = block(eh_proj([enorm(Emb(t_(i+k))); hnorm(h^(k-1)_i)]))
then the main model's final norm, output head and embedding (shared, not copied) give depth k's
logits and its cross-entropy against t_(i+k+1). The model's loss is
    main + (mtp_loss_scale / D) * sum_k L_k.
Names follow DeepSeek-V3's MTP modules (eh_proj, enorm, hnorm; the block is a transformer block
of the trunk's kind), so export is a renaming (graphtrain.checkpoint.hf). The concatenation puts
the embedding half first: the column order of eh_proj in DeepSeek-V3's released weights (and in
Megatron-Core, vLLM and SGLang), although the paper writes h first.

Packed sequences (`mtp_shift`): a row holds several documents. The token k ahead of position i
is used only where it belongs to i's document; elsewhere (another document, or past the row's
end) the embedding input is zero and the label -100 (ignored). Labels come from the trunk's
`labels` shifted by k, so a position whose target (k + 1 ahead) starts another document is
ignored too (the data marks labels after an eos -100). All of it is tensor arithmetic of fixed
shape: no host synchronisation, nothing data-dependent for the compiler.

This file imports no distributed, compile or kernel code.
"""

from __future__ import annotations

import torch
from torch import nn

from models.layers import init_trunc_normal

IGNORE_INDEX = -100


def _shift_left(x: torch.Tensor, k: int, fill: int | bool) -> torch.Tensor:
    """x (B, T) moved k positions to the left along T, the last k positions set to `fill`."""
    B, T = x.shape
    return torch.cat([x[:, k:], x.new_full((B, min(k, T)), fill)], dim=1)


def mtp_shift(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    document_ids: torch.Tensor | None,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of depth k at every position i of (B, T) rows: (ids, labels, keep).

    ids[i] = input_ids[i + k], labels[i] = labels[i + k] (the token k + 1 ahead) and keep[i] =
    whether the token k ahead exists in the row and is in i's document (document_ids None: the
    whole row is one document). Where keep is False the id is 0 (its embedding is zeroed by the
    layer) and the label IGNORE_INDEX.
    """
    if document_ids is None:
        keep = _shift_left(torch.ones_like(input_ids, dtype=torch.bool), k, False)
    else:
        keep = _shift_left(document_ids, k, -1) == document_ids
    ids = _shift_left(input_ids, k, 0)
    shifted = _shift_left(labels, k, IGNORE_INDEX).masked_fill(~keep, IGNORE_INDEX)
    return ids, shifted, keep


class MTPLayer(nn.Module):
    """One MTP depth: norms of both inputs, the 2*dim -> dim projection and a transformer block.

    The norms and the block are built by the model (models.gpt.GPT.build_mtp_layer), so this
    file needs no model class. forward returns h^k, before the shared final norm.
    """

    def __init__(self, enorm: nn.Module, hnorm: nn.Module, dim: int, block: nn.Module) -> None:
        super().__init__()
        self.enorm = enorm
        self.hnorm = hnorm
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block

    def forward(
        self,
        h: torch.Tensor,
        emb: torch.Tensor,
        keep: torch.Tensor,
        rope: torch.Tensor,
        attn_mask: object,
    ) -> torch.Tensor:
        """h: h^(k-1) (B, T, dim); emb: Emb(ids) of mtp_shift (B, T, dim); keep (B, T) bool;
        rope and attn_mask: the trunk's (same positions, same document mask)."""
        # Zero AFTER the norm: RMSNorm of a zero row is zero anyway, and masking its output
        # keeps the embedding's gradient at those rows exactly zero as well.
        e = self.enorm(emb) * keep.unsqueeze(-1).to(emb.dtype)
        x = self.eh_proj(torch.cat([e, self.hnorm(h)], dim=-1))  # (B, T, dim)
        return self.block(x, rope, attn_mask)

    def init_weights(self, std: float, out_std: float) -> None:
        self.enorm.init_weights()
        self.hnorm.init_weights()
        init_trunc_normal(std, self.eh_proj.weight)
        self.block.init_weights(std, out_std)
