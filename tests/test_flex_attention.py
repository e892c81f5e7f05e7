"""The flex attention path (the CUDA default for packed documents) checked on CPU (issue 26,
defect 9): no CPU training step runs it (FlexAttention has no CPU backward), so what the kernel
reads is checked here instead: the BlockMask's shape and its tiles against the dense document
mask (which tiles are skipped, which run without the mask_mod, which with it), the model's
forward and loss with the BlockMask against SDPA with the dense mask (eager and compiled), and
that a new batch's mask reuses the compiled code instead of recompiling every step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from graphtrain.attention import document_block_mask, document_causal_mask
from models.gpt import GPT, PRESETS


def _document_ids(B: int, T: int, seed: int) -> torch.Tensor:
    """Packed rows: documents of random lengths (some shorter than a tile, some longer)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(B, T, dtype=torch.int64)
    for b in range(B):
        cuts = torch.randint(1, T, (5,), generator=g).sort().values
        for cut in cuts:
            ids[b, cut:] += 1
    return ids


def test_block_mask_tiles_match_the_dense_document_mask():
    # T = 200: a ragged last tile (the model tests below use the same shape, so the compiled
    # create_block_mask is built once for the module, ~20 s on 2 cores)
    B, T = 2, 200
    ids = _document_ids(B, T, seed=T)
    mask = document_block_mask(ids)
    dense = document_causal_mask(ids)[:, 0]  # (B, T, T)
    assert mask.shape == (B, 1, T, T)
    q_block, kv_block = mask.BLOCK_SIZE
    n_q, n_kv = -(-T // q_block), -(-T // kv_block)
    assert mask.kv_num_blocks.shape == (B, 1, n_q)
    # The kernel's view: per query tile, the key tiles it visits; "full" tiles skip the
    # mask_mod, the others apply it. Every tile must be classified as the dense mask says.
    for b in range(B):
        for i in range(n_q):
            partial = set(mask.kv_indices[b, 0, i, : mask.kv_num_blocks[b, 0, i]].tolist())
            full = set(mask.full_kv_indices[b, 0, i, : mask.full_kv_num_blocks[b, 0, i]].tolist())
            assert not partial & full
            for j in range(n_kv):
                tile = dense[b, i * q_block : (i + 1) * q_block, j * kv_block : (j + 1) * kv_block]
                if tile.all():
                    assert j in full, (b, i, j)
                elif tile.any():
                    assert j in partial, (b, i, j)
                else:
                    assert j not in partial | full, (b, i, j)  # skipped: costs nothing
    # And at element level, the mask_mod the partial tiles run is the document mask.
    q, kv = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    for b in range(B):
        got = mask.mask_mod(torch.tensor(b), torch.tensor(0), q, kv)
        assert torch.equal(got, dense[b])


@pytest.fixture(scope="module")
def model():
    cfg = dataclasses.replace(PRESETS["debug"], num_layers=1, mtp_depth=1)
    model = GPT(cfg)
    model.init_weights(seed=0)
    return model


def _batch(model: GPT, seed: int, T: int = 200):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, T + 1), generator=g)
    ids = _document_ids(2, T, seed)
    # positions restart at each document, as the packing writes them
    starts = torch.cat([torch.ones(2, 1, dtype=torch.bool), ids[:, 1:] != ids[:, :-1]], dim=1)
    index = torch.arange(T).expand(2, T)
    last_start = torch.cummax(torch.where(starts, index, 0), dim=1).values
    return tokens[:, :-1], tokens[:, 1:], index - last_start, ids


def test_model_loss_with_the_block_mask_matches_sdpa(model):
    """The trainer's forward (main loss and the MTP depth, document-aware) with the BlockMask
    as the CUDA step passes it, against SDPA with the dense mask: fp32, float rounding."""
    inputs, labels, positions, ids = _batch(model, seed=1)
    with torch.no_grad():
        flex = model(inputs, labels, positions, document_block_mask(ids), document_ids=ids)
        sdpa = model(inputs, labels, positions, document_causal_mask(ids), document_ids=ids)
        # a mask that ignores the documents gives another loss: the comparison can fail
        causal = model(inputs, labels, positions, None, document_ids=ids)
    # Seen: equal (torch 2.11, 2.13). A mask that ignores the documents moved the loss by
    # 5e-5 to 5e-4 (both torch versions, three seeds): 7 to 70 times the tolerance.
    tolerance = dict(rtol=1e-6, atol=0.0)
    torch.testing.assert_close(flex, sdpa, **tolerance)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(flex, causal, **tolerance)


def test_compiled_block_takes_a_new_mask_every_step_without_recompiling(model):
    """Each step builds a new BlockMask (a new mask_mod closure over that batch's document
    ids): the compiled block must reuse its code, or every step would recompile and, past
    Dynamo's recompile limit, fall back to eager."""
    block = model.layers["0"]
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    counters.clear()
    with torch.no_grad():
        for step in range(3):
            inputs, _, positions, ids = _batch(model, seed=10 + step)
            h = model.tok_embeddings(inputs)
            rope = model.rope[positions]
            got = compiled(h, rope, document_block_mask(ids))
            want = block(h, rope, document_causal_mask(ids))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()
