"""The GPU attentions for packed documents checked on CPU (issue 26, defect 9): no CPU training
step runs them.

Flex attention (the CUDA default; no CPU backward): what the kernel reads is checked instead:
the BlockMask's shape and its tiles against the dense document mask (which tiles are skipped,
which run without the mask_mod, which with it), the model's forward and loss with the
BlockMask against SDPA with the dense mask (eager and compiled), and that a new batch's mask
reuses the compiled code instead of recompiling every step.

Varlen attention (training.attention=varlen; torch's varlen_attn, whose kernel is CUDA's
FlashAttention-2): torch's op runs as it is, its autograd and fake kernels included, with a
float64 CPU kernel written here from the op's contract (causal softmax attention inside each
span of cu_seqlens, GQA by repeating key heads). Checked: the spans built from document ids,
the model's loss and every gradient against SDPA with the dense mask, the compiled block, and
the trainer's forward through the model compiled with Inductor.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from graphtrain.attention import (
    build_attention_mask,
    document_block_mask,
    document_causal_mask,
    document_spans,
    resolve_attention,
)
from graphtrain.compile import apply_compile
from graphtrain.data.packing import pack_rows
from graphtrain.optim import WorkingWeights
from graphtrain.step import ForwardLoss
from models import MODEL_PRESETS, build_model
from models.gpt import GPT, PRESETS, DocumentSpans


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


# -- varlen ------------------------------------------------------------------------------------


def _spans_attention(q, k, v, cu, causal, scale):
    """float64 attention of each span of cu (q (N, H, D), k and v (N, Hkv, D)): its output, its
    log-sum-exp (H, N) and, for the backward, the probabilities of each span."""
    H, D = q.shape[1], q.shape[2]
    scale = D**-0.5 if scale is None else scale
    k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(H, q.shape[0], dtype=torch.float64)
    probs = []
    for s, e in itertools.pairwise(cu):
        if s == e:
            continue
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(e - s, e - s).triu(1).bool(), float("-inf"))
        lse[:, s:e] = scores.logsumexp(-1)
        p = scores.softmax(-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", p, v[s:e])
        probs.append((s, e, p))
    return out, lse, probs


def _cpu_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale=None, *_):
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    out, lse, _ = _spans_attention(
        query.double(), key.double(), value.double(), cu_seq_q.tolist(), is_causal, scale
    )
    return out.to(query.dtype), lse.float(), torch.zeros(2, dtype=torch.uint64)


def _cpu_varlen_backward(grad_out, query, key, value, out, lse, cu_q, cu_k, max_q, max_k,
                         is_causal, rng_state, scale=None, window_size=None):  # fmt: skip
    """Softmax attention's backward by its formulas (not autograd: kernels run below it)."""
    q, k, v, do = (t.double() for t in (query, key, value, grad_out))
    H, rep = q.shape[1], q.shape[1] // k.shape[1]
    scale = q.shape[2] ** -0.5 if scale is None else scale
    o, _, probs = _spans_attention(q, k, v, cu_q.tolist(), is_causal, scale)
    kr, vr = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kr), torch.zeros_like(vr)
    for s, e, p in probs:
        dv[s:e] = torch.einsum("hqk,qhd->khd", p, do[s:e])
        dp = torch.einsum("qhd,khd->hqk", do[s:e], vr[s:e])
        rowsum = (do[s:e] * o[s:e]).sum(-1).transpose(0, 1).unsqueeze(-1)  # (H, L, 1)
        ds = p * (dp - rowsum) * scale
        dq[s:e] = torch.einsum("hqk,khd->qhd", ds, kr[s:e])
        dk[s:e] = torch.einsum("hqk,qhd->khd", ds, q[s:e])
    # GQA: a key head's gradient sums over the query heads that share it
    dk, dv = (t.view(t.shape[0], H // rep, rep, -1).sum(2) for t in (dk, dv))
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


@pytest.fixture(scope="module")
def cpu_varlen():
    """torch's varlen op with the CPU kernels above (registered for this process: nothing else
    runs varlen on a CPU, training.attention=varlen is refused there)."""
    import torch.nn.attention.varlen  # defines the ops (the models import it at first use)

    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", _cpu_varlen)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", _cpu_varlen_backward)


def test_document_spans_start_at_every_document_and_row():
    B, T = 3, 50
    ids = _document_ids(B, T, seed=3)
    ids[1] = 7  # a row of one document, the same id as the last one of row 0 may have
    spans = document_spans(ids)
    cu = spans.cu_seqlens
    assert cu.dtype == torch.int32 and spans.max_len == T
    n = int((cu < B * T).sum())  # the spans' starts; then B * T, padded
    starts = cu[:n].tolist()
    assert starts[0] == 0 and starts == sorted(set(starts))
    assert (cu[n:] == B * T).all() and len(cu) > n and len(cu) & (len(cu) - 1) == 0
    flat = ids.reshape(-1)
    for s, e in itertools.pairwise([*starts, B * T]):
        assert s // T == (e - 1) // T, (s, e)  # inside one row
        assert (flat[s:e] == flat[s]).all(), (s, e)  # one document
    want = {0} | {i for i in range(1, B * T) if i % T == 0 or flat[i] != flat[i - 1]}
    assert set(starts) == want
    assert len(document_spans(torch.zeros(1, 8, dtype=torch.long)).cu_seqlens) == 2  # [0, 8]


def test_varlen_is_refused_without_cuda():
    with pytest.raises(ValueError, match=r"training\.attention='varlen' needs a CUDA device"):
        resolve_attention("varlen", torch.device("cpu"))


@pytest.mark.parametrize("preset", ["debug", "hybrid-debug"])
def test_model_loss_and_gradients_with_varlen_match_sdpa(preset, cpu_varlen):
    """The model's forward (main loss and the MTP depth) and backward with DocumentSpans
    through torch's varlen op, against SDPA with the dense mask: fp32 rounding. hybrid-debug:
    Qwen3-Next's gated attention block after three Gated DeltaNet blocks."""
    model = build_model(dataclasses.replace(MODEL_PRESETS[preset], mtp_depth=1))
    model.init_weights(seed=0)
    inputs, labels, positions, ids = _batch(model, seed=2)

    def loss_and_grads(mask):
        model.zero_grad()
        loss = model(inputs, labels, positions, mask, document_ids=ids)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    spans = build_attention_mask(ids, "varlen")
    assert isinstance(spans, DocumentSpans)
    loss, grads = loss_and_grads(spans)
    want_loss, want_grads = loss_and_grads(document_causal_mask(ids))
    # A mask that ignores the documents (one span a row) gives another loss.
    rows = DocumentSpans(torch.tensor([0, 200, 400], dtype=torch.int32), 200)
    other, _ = loss_and_grads(rows)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0.0)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(other, want_loss, rtol=1e-6, atol=0.0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_block_with_varlen_compiles_once_for_many_document_counts(model, cpu_varlen):
    """Each batch has other spans (and, past a power of two, a longer cu_seqlens): at most one
    recompile (the second length makes Dynamo's span count dynamic; max_len is the constant
    T), never one per batch, and the compiled block (AOTAutograd's forward and backward
    graphs, the op's backward in the latter) computes what SDPA does, gradients included."""
    block = model.layers["0"]
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    counters.clear()
    sizes = set()
    for step in range(4):
        inputs, _, positions, ids = _batch(model, seed=20 + step)
        for cut in range(190, 190 - 4 * step, -1):  # four more documents each batch
            ids = ids + (torch.arange(200) >= cut).long()
        spans = document_spans(ids)
        sizes.add(len(spans.cu_seqlens))
        h = model.tok_embeddings(inputs).detach().requires_grad_()
        rope = model.rope[positions]
        g = torch.randn(h.shape, generator=torch.Generator().manual_seed(step))
        wrt = [h, *block.parameters()]
        got = compiled(h, rope, spans)
        got_grads = torch.autograd.grad(got, wrt, g)
        want = block(h, rope, document_causal_mask(ids))
        want_grads = torch.autograd.grad(want, wrt, g)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert sizes == {16, 32, 64}, sizes
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    torch._dynamo.reset()


def test_compiled_trainer_forward_with_varlen_matches_sdpa(cpu_varlen, tmp_path):
    """The trainer's forward (ForwardLoss: model_inputs finds the spans in the loader's CPU
    ids) through the model compiled as the trainer compiles it (graphtrain's regions and
    default passes, Inductor, the op as an extern kernel forward and backward), against the
    uncompiled model with SDPA: loss and every gradient."""
    cfg = dataclasses.replace(PRESETS["debug"], num_layers=1, mtp_depth=1)
    model = GPT(cfg)
    model.init_weights(seed=0)
    reference = copy.deepcopy(model)
    apply_compile(model, inner="inductor", dump_dir=tmp_path, device_type="cpu")
    rng = np.random.default_rng(0)
    batch = pack_rows(rng.integers(1, 40, size=(2, 129)), eos_id=1)  # ~3 documents a row
    assert len(set(batch["document_ids"][0].tolist())) > 2

    def loss_and_grads(net, attention):
        no_copies = WorkingWeights(net, [], torch.float32)
        forward = ForwardLoss(
            net, torch.device("cpu"), attention, contextlib.nullcontext(), no_copies
        )
        loss = forward(batch)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in net.named_parameters()}

    loss, grads = loss_and_grads(model, "varlen")
    want_loss, want_grads = loss_and_grads(reference, "sdpa")
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0.0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)
    ops = " ".join(p.read_text() for p in tmp_path.glob("block-0/**/summary.json"))
    assert "torch_attn._varlen_attn" in ops
    torch._dynamo.reset()


def test_attention_benchmark_cpu_smoke():
    """benchmarks/attention.py imports, and its FlexAttention row agrees with float32 math on
    packed documents (its GPU rows say why they did not run)."""
    from conftest import run_benchmark_smoke

    run_benchmark_smoke(
        "attention.py", "cpu smoke: the document rows that run on CPU agree with float32 math"
    )
