"""The Gated DeltaNet maths (models/gated_deltanet.py): the chunked recurrence against the
step-by-step spec in float64, forward and every gradient; document resets; the convolution;
the layer against Hugging Face's Qwen3-Next layer with the same weights."""

import pytest
import torch
import torch.nn.functional as F

from models.gated_deltanet import (
    GatedDeltaNet,
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_rule_recurrent,
    l2norm,
    segment_ids,
)


def _inputs(B, T, H, Dk, Dv, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q = randn(B, T, H, Dk)
    k = l2norm(randn(B, T, H, Dk))  # the model's keys are unit vectors
    v = randn(B, T, H, Dv)
    g = -F.softplus(randn(B, T, H)) * 0.5  # log decays in about (-2, 0)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _doc_ids(lengths_per_row):
    """(rows, T) document ids 0, 1, ... of rows of documents of the given lengths."""
    return torch.stack(
        [
            torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
            for row in lengths_per_row
        ]
    )


def _docs(lengths_per_row):
    return segment_ids(_doc_ids(lengths_per_row))


CASES = {
    # T, chunk, document lengths per row (None: one document per row)
    "odd-length-one-doc": (37, 8, None),
    "shorter-than-a-chunk": (5, 64, None),
    "one-position": (1, 8, None),
    "several-docs": (37, 8, [[5, 20, 2, 10], [37]]),
    "doc-shorter-than-chunk-and-length-1": (29, 16, [[1, 3, 1, 24], [16, 13]]),
    "docs-on-chunk-boundaries": (32, 8, [[8, 8, 16], [7, 1, 9, 15]]),
    "default-chunk": (150, 64, [[70, 1, 79], [150]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_equals_recurrence_forward_and_gradients_float64(case):
    T, chunk, lengths = CASES[case]
    B = 2
    xs = _inputs(B, T, 3, 6, 5)
    seg = None if lengths is None else _docs(lengths)
    chunked = chunk_gated_delta_rule(*xs, seg, chunk_size=chunk)
    step = gated_delta_rule_recurrent(*xs, seg)
    torch.testing.assert_close(chunked, step, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(step)
    grads_c = torch.autograd.grad((chunked * w).sum(), xs)
    grads_s = torch.autograd.grad((step * w).sum(), xs)
    for name, gc, gs in zip("q k v g beta".split(), grads_c, grads_s, strict=True):
        # The comparison checks something (at T = 1 the decay acts on a zero state only).
        assert gs.abs().max() > 0 or (name == "g" and T == 1), name
        torch.testing.assert_close(gc, gs, rtol=1e-9, atol=1e-9, msg=name)


def test_fp32_chunked_is_close_to_float64_recurrence():
    xs = _inputs(2, 100, 2, 16, 16)
    seg = _docs([[40, 60], [100]])
    ref = gated_delta_rule_recurrent(*xs, seg)
    out = chunk_gated_delta_rule(*(x.detach().float() for x in xs), seg)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-4, atol=1e-5)


def test_bf16_inputs_give_bf16_output_computed_in_fp32():
    xs = [x.detach() for x in _inputs(1, 20, 2, 8, 8)]
    ref = chunk_gated_delta_rule(*(x.to(torch.bfloat16).float() for x in xs), chunk_size=8)
    out = chunk_gated_delta_rule(*(x.to(torch.bfloat16) for x in xs), chunk_size=8)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.to(torch.bfloat16), rtol=0, atol=0)


def test_autocast_leaves_the_chunked_form_in_fp32():
    """A forward under bf16 autocast computes the form as without it (its matmuls would
    otherwise be bf16, and CPU has no bf16 triangular solve: the eager hybrid model under
    autocast failed), gradients too; a GDN layer's forward and backward run so."""
    xs = [x.detach().float().requires_grad_() for x in _inputs(2, 40, 2, 8, 8)]
    seg = _docs([[25, 15], [40]])
    ref = chunk_gated_delta_rule(*xs, seg, chunk_size=16)
    ref_grads = torch.autograd.grad(ref.sum(), xs)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the forward, as the trainer's step
        out = chunk_gated_delta_rule(*xs, seg, chunk_size=16)
    grads = torch.autograd.grad(out.sum(), xs)
    assert torch.equal(out, ref)
    for name, a, b in zip("q k v g beta".split(), grads, ref_grads, strict=True):
        assert torch.equal(a, b), name
    meta = [x.detach().to("meta") for x in xs]  # meta tensors (FLOP counts): no autocast there
    assert chunk_gated_delta_rule(*meta, chunk_size=16).shape == ref.shape
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 8, 8, 4, 1e-6, chunk_size=16)
    layer.init_weights(0.02, 0.02)
    x = torch.randn(2, 40, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x, _doc_ids([[25, 15], [40]]))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad is not None and x.grad.isfinite().all()


def test_a_document_sees_nothing_of_the_one_before():
    """Each document's output equals the output of that document run alone, and its outputs
    have no gradient with respect to any earlier document's inputs."""
    lengths = [9, 1, 14, 6]
    T = sum(lengths)
    xs = _inputs(1, T, 2, 4, 3)
    out = chunk_gated_delta_rule(*xs, _docs([lengths]), chunk_size=8)
    start = 0
    for n in lengths:
        alone = chunk_gated_delta_rule(*(x[:, start : start + n] for x in xs), chunk_size=8)
        torch.testing.assert_close(out[:, start : start + n], alone, rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(out[:, start : start + n].sum(), xs, retain_graph=True)
        for grad in grads:
            assert (grad[:, :start] == 0).all()
        start += n


def test_segment_ids_number_contiguous_runs():
    ids = torch.tensor([[5, 5, 2, 2, 5, 0], [3, 3, 3, 3, 3, 3]])
    assert segment_ids(ids).tolist() == [[0, 0, 1, 1, 2, 3], [0, 0, 0, 0, 0, 0]]


def test_causal_conv_matches_conv1d_and_resets_at_documents():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 13, 6, generator=gen, dtype=torch.float64)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3, bias=False).double()
    expected = conv(x.transpose(1, 2))[..., :13].transpose(1, 2)
    torch.testing.assert_close(causal_conv1d(x, conv.weight, None), expected)
    lengths = [2, 5, 6]
    out = causal_conv1d(x, conv.weight, _docs([lengths, lengths]))
    start = 0
    for n in lengths:
        alone = causal_conv1d(x[:, start : start + n], conv.weight, None)
        torch.testing.assert_close(out[:, start : start + n], alone)
        start += n


def _layer(seed=0, **kw):
    shape = dict(
        dim=32,
        num_key_heads=2,
        num_value_heads=4,
        key_head_dim=8,
        value_head_dim=6,
        conv_kernel=4,
        norm_eps=1e-6,
        chunk_size=8,
    )
    layer = GatedDeltaNet(**{**shape, **kw}).double()
    torch.manual_seed(seed)
    layer.init_weights(0.2, 0.1)
    return layer


def test_layer_keeps_documents_apart():
    layer = _layer()
    lengths = [7, 12, 3]
    x = torch.randn(1, sum(lengths), 32, dtype=torch.float64)
    doc = _doc_ids([lengths])
    out = layer(x, doc)
    start = 0
    for n in lengths:
        torch.testing.assert_close(out[:, start : start + n], layer(x[:, start : start + n]))
        start += n
    # Without document ids the row is one document: later positions read earlier ones.
    assert not torch.allclose(layer(x)[:, lengths[0] :], out[:, lengths[0] :])


def test_layer_equals_hugging_face_qwen3_next_layer():
    """Same parameter names as transformers' Qwen3NextGatedDeltaNet, and its layouts once conv1d
    is reordered (models/hybrid_hf.py): a state dict copied across gives the same output and
    input gradient (no documents)."""
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    from models.hybrid_hf import conv_to_hf

    layer = _layer(chunk_size=64)
    config = Qwen3NextConfig(
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    theirs = hf.Qwen3NextGatedDeltaNet(config, layer_idx=0).double()
    state = layer.state_dict()
    # Our conv1d channels are grouped by key head (for tensor parallelism), theirs by q/k/v.
    state["conv1d.weight"] = conv_to_hf(state["conv1d.weight"], 2, (8, 8, 2 * 6))
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    x = torch.randn(2, 70, 32, dtype=torch.float64, requires_grad=True)
    ours = layer(x)
    (grad,) = torch.autograd.grad(ours.square().sum(), x)
    ref = theirs(x)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), x)
    # transformers runs its chunked rule in fp32 whatever the input dtype: fp32 agreement.
    for a, b in ((ours, ref), (grad, ref_grad)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())
