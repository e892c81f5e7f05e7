"""Multi-token prediction (models/mtp.py) on dense and MoE models: the loss of packed rows against
a per-document float64 reference, depth 0 unchanged, gradients, acceptance."""

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from graphtrain.attention import document_causal_mask
from graphtrain.data.packing import pack_rows
from models import MODEL_PRESETS, GPTConfig, build_model

EOS = 1
# Vocabulary small enough that a random model's top-1 is sometimes right: acceptance checks
# compare numbers that are not all zero.
DENSE = GPTConfig(
    vocab_size=13, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48, max_seq_len=64
)
MOE = dataclasses.replace(MODEL_PRESETS["moe-debug"], vocab_size=13, max_seq_len=64)


def build(cfg: GPTConfig, seed: int = 0, dtype=torch.float32):
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():  # whatever init_weights forgets stays NaN
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(float("nan"))
    model.init_weights(seed=seed)
    return model.to(dtype)


def packed_rows(doc_lengths: list[list[int]], seed: int = 0):
    """Rows of documents of the given lengths (eos included in each length), as the loader
    packs them: a row of T + 1 tokens, its last document cut by the row's end."""
    rng = np.random.default_rng(seed)
    rows = []
    for lengths in doc_lengths:
        row = []
        for n in lengths:
            row += [*rng.integers(2, 13, n - 1), EOS]
        rows.append(row)
    width = min(len(r) for r in rows)
    return pack_rows(np.array([r[:width] for r in rows]), EOS)


def reference_loss(model, td) -> tuple[torch.Tensor, list[tuple[float, float]]]:
    """The model's loss computed document by document in float64 with explicit shifts: every
    document alone (positions from 0, plain causal attention), its depth-k embeddings taken
    only from its own tokens. Returns the loss and, per depth 0 (the main head) to D, (mean CE,
    acceptance)."""
    cfg = model.cfg
    D = cfg.mtp_depth
    sums, hits, counts = [0.0] * (D + 1), [0] * (D + 1), [0] * (D + 1)

    def score(k: int, logits: torch.Tensor, label: torch.Tensor) -> None:
        ok = label != -100
        sums[k] += F.cross_entropy(logits[ok], label[ok], reduction="sum").item()
        hits[k] += int((logits[ok].argmax(-1) == label[ok]).sum())
        counts[k] += int(ok.sum())

    for x_row, y_row, d_row in zip(td["input_ids"], td["labels"], td["document_ids"], strict=True):
        for doc in d_row.unique():
            x, y = x_row[d_row == doc], y_row[d_row == doc]  # (L,)
            L = len(x)
            rope = model.rope[torch.arange(L)][None]
            h = model.tok_embeddings(x[None])
            for layer in model.layers.values():
                h = layer(h, rope, None)
            score(0, model.output(model.norm(h))[0], y)
            for k in range(1, D + 1):
                m = model.mtp_layers[str(k - 1)]
                n = max(L - k, 0)  # positions whose token k ahead is in this document
                emb = torch.zeros(L, cfg.dim, dtype=h.dtype)
                emb[:n] = model.tok_embeddings(x[k:])  # the token k ahead
                label = torch.full((L,), -100)
                label[:n] = y[k:]  # the token k + 1 ahead (or -100 after the eos)
                e = m.enorm(emb) * (torch.arange(L) < n)[:, None]
                inp = torch.cat([e, m.hnorm(h[0])], -1) @ m.eh_proj.weight.T
                h = m.block(inp[None], rope, None)
                score(k, model.output(model.norm(h))[0], label)
    per_depth = [(s / n, h / n) for s, h, n in zip(sums, hits, counts, strict=True)]
    loss = per_depth[0][0] + cfg.mtp_loss_scale / D * sum(ce for ce, _ in per_depth[1:])
    return torch.tensor(loss, dtype=torch.float64), per_depth


def run(model, td, stats=None):
    mask = document_causal_mask(td["document_ids"])
    return model(
        td["input_ids"],
        td["labels"],
        td["position_ids"],
        mask,
        document_ids=td["document_ids"],
        stats=stats,
    )


# Documents of 1 to 17 tokens, several shorter than D + 1 = 4, the last ones cut by the row end.
DOCS = [[1, 3, 17, 2, 9, 4, 1, 12], [6, 2, 25, 3, 1, 20]]


# torch._grouped_mm has no float64 kernel: the MoE model runs in float32, where the packed and
# per-document runs differ by rounding only (~1e-6; a wrong position moves the loss ~1e-2).
@pytest.mark.parametrize(
    "cfg, dtype, rtol",
    [(DENSE, torch.float64, 2e-6), (MOE, torch.float32, 2e-5)],
    ids=["dense", "moe"],
)
@torch.no_grad()
def test_packed_loss_and_acceptance_match_per_document_reference(cfg, dtype, rtol):
    cfg = dataclasses.replace(cfg, mtp_depth=3, mtp_loss_scale=0.3)
    model = build(cfg, dtype=dtype)
    td = packed_rows(DOCS)
    stats = {}
    loss = run(model, td, stats)
    ref, per_depth = reference_loss(model, td)
    # The head casts the logits to fp32 (models.gpt.GPT.head_loss): the loss carries fp32
    # rounding (~1e-7); one wrongly shifted or counted position would move it by ~1e-2.
    torch.testing.assert_close(loss.double(), ref, rtol=rtol, atol=0)
    assert sorted(stats) == sorted(
        f"mtp/{what}_{k}" for what in ("loss", "acceptance") for k in (0, 1, 2, 3)
    )
    for k, (ce, acceptance) in enumerate(per_depth):
        assert not stats[f"mtp/loss_{k}"].requires_grad
        assert stats[f"mtp/loss_{k}"].item() == pytest.approx(ce, rel=rtol)
        assert stats[f"mtp/acceptance_{k}"].item() == pytest.approx(acceptance, rel=1e-6)
    assert any(a > 0 for _, a in per_depth), "acceptance 0 everywhere checks nothing"


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_depth_zero_is_the_model_without_mtp(cfg):
    """mtp_depth=0 has no MTP parameter, and a model with MTP has the same trunk parameters
    (init draws) and, with mtp_loss_scale=0, bitwise the same loss."""
    td = packed_rows(DOCS)
    plain = build(cfg)
    assert not any("mtp" in n for n in plain.state_dict())
    with_mtp = build(dataclasses.replace(cfg, mtp_depth=2, mtp_loss_scale=0.0))
    trunk = dict(with_mtp.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(p, trunk[name]), name
    assert torch.equal(run(plain, td), run(with_mtp, td))
    assert torch.equal(
        run(plain, td),
        plain(
            td["input_ids"],
            td["labels"],
            td["position_ids"],
            document_causal_mask(td["document_ids"]),
        ),
    )


def test_every_depth_sends_gradients_to_embedding_head_and_trunk():
    cfg = dataclasses.replace(DENSE, mtp_depth=2)
    model = build(cfg)
    td = packed_rows(DOCS)
    depth_losses = []
    head_loss = model.head_loss

    def recording_head_loss(h, labels, count_hits=False):
        out = head_loss(h, labels, count_hits)
        depth_losses.append(out)
        return out

    model.head_loss = recording_head_loss
    run(model, td)
    assert len(depth_losses) == 3  # main, depth 1, depth 2
    shared = {
        "embedding": model.tok_embeddings.weight,
        "head": model.output.weight,
        "final norm": model.norm.weight,
        "trunk": model.layers["0"].attention.wq.weight,
    }
    for k in (1, 2):
        own = dict(model.mtp_layers[str(k - 1)].named_parameters())
        later = list(model.mtp_layers[str(k)].parameters()) if k < 2 else []
        params = [*shared.values(), *own.values(), *later]
        grads = torch.autograd.grad(depth_losses[k], params, retain_graph=True, allow_unused=True)
        for name, g in zip([*shared, *own, *("later",) * len(later)], grads, strict=True):
            if name == "later":
                assert g is None or not g.any(), f"depth {k} reaches a later depth"
            else:
                assert g is not None and g.abs().sum() > 0, f"depth {k}: no gradient to {name}"


def test_config_errors_name_values():
    with pytest.raises(ValueError, match=r"mtp_depth.*-1"):
        dataclasses.replace(DENSE, mtp_depth=-1)
    with pytest.raises(ValueError, match=r"mtp_loss_scale.*-0\.5"):
        dataclasses.replace(DENSE, mtp_loss_scale=-0.5)


# ---------------------------------------------------------------------------------------------
# Compiled: the MTP regions and the shared head_loss region (graphtrain.compile.apply_compile).


def _train(model, td, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for _ in range(steps):
        stats = {}
        loss = run(model, td, stats)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append((loss.detach(), stats))
    return out


def test_compiled_equals_eager_bitwise_over_three_steps(tmp_path):
    """D=2, packed rows, stats on: backend graphtrain (aot_eager, numerics-preserving passes)
    gives the losses and per-depth stats of the same regions compiled without graphtrain's
    passes bit for bit over three steps, and eager's bit for bit at the first step; each depth
    is a region of its own.

    Eager only to float32 rounding after an optimizer step: the trunk's and each depth's hidden
    state feed two regions (the next depth and the head), and autograd adds the gradient
    contributions of their uses in another order when a region is one node (the uses inside
    it summed in its graph) than op by op, so the weights may differ in the last bit (torch
    2.11: mtp/loss_1 one ulp off at the second step; torch 2.13: gradients off by ~1e-11 that
    happen to round alike). The region's own forward and backward are bitwise eager's."""
    from graphtrain.compile import apply_compile
    from graphtrain.passes import all_passes

    cfg = dataclasses.replace(DENSE, mtp_depth=2)
    td = packed_rows(DOCS)
    eager = _train(build(cfg), td)
    runs = []
    for keep in (False, True):
        torch._dynamo.reset()
        switches = [("+" if keep and p.preserves_numerics else "-") + p.name for p in all_passes()]
        model = build(cfg)
        apply_compile(model, passes=switches, inner="aot_eager", dump_dir=tmp_path / str(keep))
        runs.append(_train(model, td))
    plain, compiled = runs
    for (a, sa), (b, sb) in zip(plain, compiled, strict=True):
        assert torch.equal(a, b), (a.item(), b.item())
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    for step, ((a, sa), (b, sb)) in enumerate(zip(eager, compiled, strict=True)):
        rtol = 0 if step == 0 else 1e-5
        torch.testing.assert_close(b, a, rtol=rtol, atol=0)
        assert sa.keys() == sb.keys()
        for k in sa:
            torch.testing.assert_close(sb[k], sa[k], rtol=rtol, atol=0, msg=f"{k} at step {step}")
    assert (tmp_path / "True/mtp_1-0").is_dir() and (tmp_path / "True/mtp_2-0").is_dir()
    # One head graph for the main head and both depths: every head call of a step with stats
    # counts hits (the main head's too), so the head region compiles once, not twice.
    assert [p.name for p in (tmp_path / "True").glob("head_loss-*")] == ["head_loss-0"]
    torch._dynamo.reset()


def test_fused_cross_entropy_replaces_every_depths_head(tmp_path):
    """With the default passes every head (main and D=2 depths) runs the fused linear +
    cross-entropy op: the head_loss graph holds it and a forward calls it 1 + D times; the
    loss stays within the pass's stated tolerance of eager."""
    from graphtrain.compile import apply_compile

    torch._dynamo.reset()
    cfg = dataclasses.replace(DENSE, mtp_depth=2)
    td = packed_rows(DOCS)
    eager = run(build(cfg), td)
    model = build(cfg)
    apply_compile(model, inner="aot_eager", dump_dir=tmp_path)
    run(model, td)  # compiles (a dispatch mode would stop Dynamo; the profiler does not)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = run(model, td)
    # After AOT autograd the forward graph calls the op's forward half (its backward is saved).
    fused = [e.name for e in prof.events() if e.name.startswith("graphtrain::linear_cross_entropy")]
    assert len(fused) == 3, fused
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=0)
    loss.backward()
    assert model.mtp_layers["1"].eh_proj.weight.grad.abs().sum() > 0
    # One head_loss graph serves every head (same shapes): the pass fused its one head there.
    (summary,) = tmp_path.glob("head_loss-*/summary.json")
    (step,) = [
        s for s in json.loads(summary.read_text()) if s["label"] == "fuse_linear_cross_entropy"
    ]
    assert step["op_diff"].get("graphtrain.linear_cross_entropy.default") == 1, step
    # Per-depth statistics compiled (the fused op's own top-1 count where the pass folds the
    # argmax into it) equal eager argmax accuracy on materialised logits (same weights: no
    # optimizer step was taken).
    want, got = {}, {}
    run(build(cfg), td, want)
    run(model, td, got)
    assert want.keys() == got.keys()
    for k in (0, 1, 2):  # the main head's (depth 0) and the depths'
        # Exact: a top-1 flip would need two logits within rounding of each other.
        assert got[f"mtp/acceptance_{k}"] == want[f"mtp/acceptance_{k}"], k
        torch.testing.assert_close(got[f"mtp/loss_{k}"], want[f"mtp/loss_{k}"], rtol=1e-5, atol=0)
    assert any(want[f"mtp/acceptance_{k}"] > 0 for k in (1, 2))
    # ... and that count is the op's: the heads asked for hits compiled to the with-stats op,
    # no argmax over materialised logits left.
    diffs = [
        s["op_diff"]
        for summary in tmp_path.glob("head_loss-*/summary.json")
        for s in json.loads(summary.read_text())
        if s["label"] == "fuse_linear_cross_entropy"
    ]
    assert any(d.get("graphtrain.linear_cross_entropy_with_stats.default") == 1 for d in diffs)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_cuda_graphed_mtp_regions_train_as_the_ungraphed_ones():
    """Inductor on CUDA: the MTP regions captured as CUDA graphs (cudagraph trees hold
    recordings afterwards) and three training steps give the losses of the same regions compiled
    without graphs."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    from graphtrain.compile import apply_compile

    cfg = dataclasses.replace(DENSE, vocab_size=512, mtp_depth=2)
    td = packed_rows(DOCS).to("cuda")
    runs = []
    for graphed in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = build(cfg).cuda()
        apply_compile(model, inner="inductor", cudagraph_mtp=graphed, device_type="cuda")
        runs.append(_train(model, td, steps=3))
    assert counters["inductor"]["cudagraph_skips"] == 0
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and manager.roots, "no CUDA graph was recorded"
    for (a, sa), (b, sb) in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
        for key in sa:
            torch.testing.assert_close(sa[key], sb[key], rtol=1e-6, atol=0)
    torch._dynamo.reset()


@pytest.mark.slow  # a subprocess importing triton, then a compile: ~40 s on 2 busy cores
def test_benchmark_cpu_smoke():
    """benchmarks/mtp.py imports and its graphtrain row equals eager on a tiny layer."""
    from conftest import run_benchmark_smoke

    run_benchmark_smoke("mtp.py", "cpu smoke: eager and graphtrain agree bit for bit")
