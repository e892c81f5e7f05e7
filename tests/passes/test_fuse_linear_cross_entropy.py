"""Tests of the fuse_linear_cross_entropy pass: where it fuses, where it must not, and that the
rewritten graph's loss and gradients equal the unrewritten one.

Graphs come from Dynamo through graphtrain's own backend (inner="aot_eager", dumps on), so the
tests read what the pass did from the dump, as a user of `graphtrain inspect` would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import pass_step
from torch import nn

from graphtrain.compile import apply_compile, backend
from models.gpt import GPT, PRESETS

OP = "graphtrain.linear_cross_entropy.default"
CE = "torch.nn.functional.cross_entropy"
PASS = "fuse_linear_cross_entropy"
B, T, H, V = 2, 7, 12, 37  # odd sizes: T * B = 14 tokens


def _pass_step(dump: Path) -> dict:
    return pass_step(dump, PASS)


def _run(
    fn: Callable, args: tuple, dump: Path | None, passes: tuple[str, ...] = (), params: tuple = ()
) -> tuple:
    """Outputs, and gradients of the tensor args needing them and of `params` (module weights).

    dump=None runs fn eagerly (the unrewritten computation); otherwise compiled through
    graphtrain's backend with dumps.
    """
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    if dump is not None:
        torch._dynamo.reset()
        fn = torch.compile(
            fn,
            backend=backend(passes=list(passes), inner="aot_eager", dump_dir=dump),
            fullgraph=True,
        )
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum(o.float().sum() for o in outs if o.is_floating_point())
    wrt = [a for a in leaves if a.requires_grad] + list(params)
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)  # the nn.Linear forms ignore w
    return tuple(o.detach() for o in outs), tuple(g for g in grads if g is not None)


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(dtype).requires_grad_(True)
    t = torch.randint(0, V, (B, T), generator=g)
    t[0, :3] = -100
    t[1, 2] = 3
    return h, w, t


_HEAD = nn.Linear(H, V, bias=False)
_HEAD_BIAS = nn.Linear(H, V, bias=True)
_HEAD_T = nn.Parameter(torch.randn(H, V) / H**0.5)  # stored [H, V]: h @ W, no transpose
_CLASS_WEIGHTS = torch.rand(V) + 0.5

# name -> (fn(h, w, t), modules whose parameters get gradients)
FUSED = {
    "F.linear + view": (
        lambda h, w, t: F.cross_entropy(F.linear(h, w).view(-1, V), t.view(-1)),
        (),
    ),
    "torch.flatten": (
        lambda h, w, t: F.cross_entropy(torch.flatten(F.linear(h, w), 0, 1), t.flatten()),
        (),
    ),
    "nn.Linear + flatten + float (the model's form)": (
        lambda h, w, t: F.cross_entropy(
            _HEAD(h).flatten(0, 1).float(), t.flatten(0, 1), ignore_index=-100
        ),
        tuple(_HEAD.parameters()),
    ),
    "h @ w.T + .to(float32) + reshape, sum": (
        lambda h, w, t: F.cross_entropy(
            (h @ w.T).to(torch.float32).reshape(-1, V), t.reshape(-1), reduction="sum"
        ),
        (),
    ),
    "torch.matmul(h, w.t()), keywords, none": (
        lambda h, w, t: F.cross_entropy(
            torch.matmul(h, w.t()).view(B * T, V),
            t.clamp_min(0).view(-1),
            ignore_index=3,
            label_smoothing=0.1,
            reduction="none",
        ),
        (),
    ),
    "torch.reshape, positional options": (
        lambda h, w, t: F.cross_entropy(
            torch.reshape(F.linear(h, w), (-1, V)),
            t.clamp_min(0).view(-1),
            None,
            None,
            3,
            None,
            "mean",
            0.2,
        ),
        (),
    ),
    "nn.CrossEntropyLoss module": (
        lambda h, w, t: nn.CrossEntropyLoss(label_smoothing=0.1)(
            F.linear(h, w).flatten(0, 1), t.flatten()
        ),
        (),
    ),
    "2-D hidden, rest of the graph kept": (
        lambda h, w, t: (
            F.cross_entropy(F.linear(h.flatten(0, 1), w).float(), torch.flatten(t))
            + 0.01 * h.pow(2).mean()
        ),
        (),
    ),
}

UNFUSED = {
    "logits returned": (
        lambda h, w, t: (F.cross_entropy((lg := F.linear(h, w)).view(-1, V), t.view(-1)), lg),
        "graph output",
    ),
    # (an argmax accuracy on the logits folds into the op's statistics: see the tests below)
    "argmax predictions returned": (
        lambda h, w, t: (
            F.cross_entropy((lg := F.linear(h, w)).view(-1, V), t.view(-1)),
            lg.argmax(-1),
        ),
        "argmax",
    ),
    "z-loss by hand": (
        lambda h, w, t: (
            F.cross_entropy((lg := F.linear(h, w).view(-1, V)), t.view(-1))
            + 1e-4 * torch.logsumexp(lg, -1).pow(2).mean()
        ),
        "logsumexp",
    ),
    "class weights": (
        lambda h, w, t: F.cross_entropy(
            F.linear(h, w).view(-1, V), t.view(-1), weight=_CLASS_WEIGHTS
        ),
        "class weights",
    ),
    "bias on the head": (
        lambda h, w, t: F.cross_entropy(_HEAD_BIAS(h).view(-1, V), t.view(-1)),
        "bias",
    ),
    "matmul without a transposed weight": (
        lambda h, w, t: F.cross_entropy((h @ _HEAD_T).view(-1, V), t.view(-1)),
        "transposed",
    ),
    "cast to float64": (
        lambda h, w, t: F.cross_entropy(F.linear(h, w).double().view(-1, V), t.view(-1)),
        "double",
    ),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_fuses_once_and_matches(name, tmp_path):
    fn, params = FUSED[name]
    args = _inputs()
    out, grads = _run(fn, args, tmp_path, params=params)
    step = _pass_step(tmp_path)
    assert step["op_counts"].get(OP) == 1, step
    assert CE not in step["op_counts"], step
    assert any("replaced" in n for n in step["notes"]), step["notes"]
    ref_out, ref_grads = _run(fn, args, None, params=params)  # eager: the unrewritten computation
    for a, b in zip(out + grads, ref_out + ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", list(UNFUSED))
def test_leaves_graph_unchanged(name, tmp_path):
    fn, reason = UNFUSED[name]
    params = tuple(_HEAD_BIAS.parameters()) if "bias" in name else ()
    args = _inputs()
    out, grads = _run(fn, args, tmp_path, params=params)
    step = _pass_step(tmp_path)
    assert OP not in step["op_counts"], step
    assert step.get("op_diff") == {}, step  # nothing changed
    assert any(reason in n for n in step["notes"]), step["notes"]
    ref_out, ref_grads = _run(fn, args, None, params=params)
    for a, b in zip(out + grads, ref_out + ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bf16_logits_without_upcast_keep_their_dtype(tmp_path):
    """CE on bf16 logits: the fused op computes in fp32 and the loss is cast back to bf16."""
    args = _inputs(torch.bfloat16)

    def fn(h, w, t):
        return F.cross_entropy(F.linear(h, w).view(-1, V), t.view(-1))

    out, grads = _run(fn, args, tmp_path)
    assert _pass_step(tmp_path)["op_counts"].get(OP) == 1
    ref_out, ref_grads = _run(fn, args, None)
    assert out[0].dtype == torch.bfloat16
    torch.testing.assert_close(out[0].float(), ref_out[0].float(), rtol=1e-2, atol=1e-2)
    for a, b in zip(grads, ref_grads, strict=True):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


def test_autocast_head_is_fused_with_explicit_casts(tmp_path):
    """Under autocast the head runs in bf16 on fp32 operands: the pass casts h and W to bf16
    explicitly, and loss and fp32 gradients equal autocast's unfused computation."""
    args = _inputs()

    def fn(h, w, t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(F.linear(h, w).float().view(-1, V), t.view(-1))

    out, grads = _run(fn, args, tmp_path)
    step = _pass_step(tmp_path)
    assert step["op_counts"].get(OP) == 1, step
    ref_out, ref_grads = _run(fn, args, None)
    assert out[0].dtype == ref_out[0].dtype == torch.float32
    # Both compute the logits from the same bf16 operands; the fused op's fp32 softmax and
    # accumulations differ from eager's only by bf16 rounding of the logits' consumers.
    torch.testing.assert_close(out[0], ref_out[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(grads, ref_grads, strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_disabled_pass_changes_nothing(tmp_path):
    fn, _ = FUSED["F.linear + view"]
    _run(fn, _inputs(), tmp_path, passes=("-" + PASS,))
    (summary,) = list(tmp_path.glob("*/summary.json"))
    labels = [s["label"] for s in json.loads(summary.read_text())]
    assert PASS not in labels


def test_no_cross_entropy_is_a_quiet_note(tmp_path):
    _run(lambda h, w, t: F.linear(h, w).sum(), _inputs(), tmp_path)
    step = _pass_step(tmp_path)
    assert step["notes"] == ["no cross_entropy in this graph: nothing to fuse"]
    assert step["op_diff"] == {}


def test_dtensor_head_left_unchanged(one_rank_group, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    h, w, t = _inputs()
    h_d = distribute_tensor(h.detach()[0], mesh, [Replicate()])
    w_d = distribute_tensor(w.detach(), mesh, [Shard(0)])
    t_d = distribute_tensor(t[0], mesh, [Replicate()])

    def fn(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)

    torch._dynamo.reset()
    compiled = torch.compile(
        fn, backend=backend(inner="aot_eager", dump_dir=tmp_path), fullgraph=True
    )
    out = compiled(h_d, w_d, t_d)
    step = _pass_step(tmp_path)
    assert OP not in step["op_counts"]
    assert any("DTensor" in n for n in step["notes"]), step["notes"]
    torch.testing.assert_close(out.full_tensor(), fn(h_d, w_d, t_d).full_tensor())


def _train(passes: list[str], dump: Path | None, steps: int = 20) -> list[float]:
    torch.manual_seed(0)
    model = GPT(PRESETS["debug"])
    model.init_weights(seed=0)
    apply_compile(model, passes=passes, inner="aot_eager", dump_dir=dump)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(
        0, model.cfg.vocab_size, (4, 2, 33), generator=torch.Generator().manual_seed(1)
    )
    losses = []
    for step in range(steps):
        tokens = data[step % 4]
        labels = tokens[:, 1:].clone()
        labels[0, :5] = -100  # some ignored targets, as packed documents have
        loss = model(tokens[:, :-1], labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # test only: a host sync per step is fine here
    return losses


def test_debug_model_trains_the_same_with_and_without_the_pass(tmp_path):
    """Requirement 3: same loss curve (fp32, CPU) within 1e-5 relative, and the dump shows it.

    Tolerance: the fused op sums the softmax and the gradients in another order (chunked, fp32);
    over 20 AdamW steps the curves agree to about 2e-7 relative, 1e-5 leaves room for other
    BLAS builds while still catching any real error (a wrong gradient moves the loss by > 1e-2).
    """
    fused = _train([], tmp_path)
    plain = _train(["-" + PASS], None)
    for a, b in zip(fused, plain, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (fused, plain)
    assert fused[-1] < fused[0] - 1.0  # it learns
    head = json.loads((tmp_path / "head_loss-0" / "summary.json").read_text())
    (step,) = [s for s in head if s["label"] == PASS]
    assert step["op_counts"].get(OP) == 1 and CE not in step["op_counts"]
    assert (
        "graphtrain.linear_cross_entropy" in (tmp_path / "head_loss-0" / step["file"]).read_text()
    )
    block = json.loads((tmp_path / "block-0" / "summary.json").read_text())
    (step,) = [s for s in block if s["label"] == PASS]
    assert step["notes"] == ["no cross_entropy in this graph: nothing to fuse"]


@pytest.mark.slow
def test_tensor_parallel_head_uses_the_vocab_parallel_op(corpus, tmp_path):
    """tp=2 (gloo): the vocab-sharded head's chain (linear -> redistribute -> to_local -> loss)
    becomes graphtrain.linear_cross_entropy_vocab_parallel on the local shards, and training
    follows the unfused run (fp32; reduction order only)."""
    from conftest import job, rank_jobs

    common = ("--parallel.tp=2", "--training.steps=4", "--metrics.log_interval=1")
    on, off = rank_jobs(
        2,
        [
            job(corpus, tmp_path / "on", *common, "--compile.dump_graphs=true"),
            job(corpus, tmp_path / "off", *common, f"--compile.passes=-{PASS}"),
        ],
    )
    on, off = ([m for m in run if "loss" in m] for run in (on, off))
    assert len(on) == len(off) == 4
    for a, b in zip(on, off, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    (step,) = [
        s
        for s in json.loads((tmp_path / "on/run/graphs/head_loss-0/summary.json").read_text())
        if s["label"] == PASS
    ]
    assert step["op_counts"].get("graphtrain.linear_cross_entropy_vocab_parallel.default") == 1
    assert CE not in step["op_counts"]


def _compiled_notes(fn, args, tmp_path, options: dict) -> tuple[list[str], tuple]:
    """The pass's notes and the compiled outputs/gradients with these pass options."""
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    torch._dynamo.reset()
    compiled = torch.compile(
        fn,
        backend=backend(inner="aot_eager", dump_dir=tmp_path, pass_options=options),
        fullgraph=True,
    )
    out = compiled(*leaves)
    grads = torch.autograd.grad(out, [a for a in leaves if a.requires_grad])
    return _pass_step(tmp_path)["notes"], (out.detach(), *grads)


@pytest.mark.parametrize(
    "options,mode,why",
    [
        ({}, "fast", "auto: fast mode's"),  # default: a quarter of the free memory fits
        ({"lce_memory_budget": 1 << 30}, "fast", "fits the budget of 1.00 GiB"),
        ({"lce_memory_budget": 100}, "low_memory", "exceeds the budget"),
        ({"lce_mode": "fast", "lce_memory_budget": 100}, "fast", "fast as configured"),
        ({"lce_mode": "low_memory"}, "low_memory", "compile.lce_mode = 'low_memory'"),
    ],
)
def test_mode_chosen_from_the_budget(options, mode, why, tmp_path):
    """auto picks low-memory mode when fast mode's extra bytes exceed the budget and fast
    otherwise; the note says which and why; both give the unrewritten loss and gradients."""
    fn, _ = FUSED["F.linear + view"]
    args = _inputs()
    notes, got = _compiled_notes(fn, args, tmp_path / "c", options)
    (note,) = [n for n in notes if "replaced" in n]
    assert f"mode={mode!r}" in note and why in note, note
    want_out, want_grads = _run(fn, args, None)
    for a, b in zip(got, want_out + want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    "device,options,mode,why",
    [
        ("cuda", {"lce_memory_budget": 4 << 30}, None, "Inductor's unfused loss (3.91 GiB"),
        ("cuda", {"lce_memory_budget": 3 << 30}, "fast", "fast mode's 0.49 GiB extra"),
        ("cuda", {"lce_mode": "fast", "lce_memory_budget": 4 << 30}, "fast", "fits the budget"),
        ("cpu", {"lce_memory_budget": 4 << 30}, "fast", "fast mode's 0.49 GiB extra"),
    ],
)
def test_auto_leaves_the_loss_unfused_on_cuda_where_it_fits(device, options, mode, why):
    """The 1b head (8192 tokens x 2048 x 128256, bf16 logits, fp32 weight) on fake CUDA tensors:
    auto leaves it to Inductor when the unfused logits and their gradient (2 x 2 bytes per
    logit: 3.91 GiB) fit the budget, and takes fast mode when they do not; an explicit mode
    and the CPU keep the fused op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import graphtrain.passes.linear_cross_entropy as lce_pass

    graph = torch.fx.Graph()
    hidden, weight, target = (graph.placeholder(n) for n in ("h", "w", "t"))
    graph.output(None)
    with FakeTensorMode():
        hidden.meta["example_value"] = torch.empty(
            2, 4096, 2048, device=device, dtype=torch.bfloat16
        )
        weight.meta["example_value"] = torch.empty(128256, 2048, device=device)
    m = lce_pass._Match(hidden, weight, target, [], None, -100, 0.0, "mean", torch.bfloat16)
    got, note = lce_pass._choose_mode(options, m, torch.fx.GraphModule({}, graph))
    assert (got if got is None else got["mode"]) == mode and why in note, (got, note)


def test_autocast_fast_mode_takes_the_fp32_weight(tmp_path):
    """Under autocast, fast mode gets the fp32 master weight itself (no cast node before the
    op) and its fp32 gradient equals autocast's unfused computation up to bf16 rounding."""

    def fn(h, w, t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(F.linear(h, w).float().view(-1, V), t.view(-1))

    args = _inputs()
    notes, got = _compiled_notes(fn, args, tmp_path, {"lce_mode": "fast"})
    assert any("mode='fast'" in n for n in notes), notes
    code = next(tmp_path.glob(f"*/*_{PASS}.txt")).read_text()
    call = next(line for line in code.splitlines() if "graphtrain.linear_cross_entropy" in line)
    assert "default(to, l_w_, " in call, call  # h cast to bf16, W as it is (fp32)
    want_out, want_grads = _run(fn, args, None)
    torch.testing.assert_close(got[0], want_out[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(got[1:], want_grads, strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


class _HeadWithAccuracy(nn.Module):
    """A plain-torch head that also reports top-1 accuracy on the same logits."""

    def __init__(self, spelling: str):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.output = nn.Linear(H, V, bias=False)
        self.spelling = spelling

    def forward(self, h, labels):
        logits = self.output(self.norm(h))  # (B, T, V)
        flat, flat_labels = logits.view(-1, V), labels.view(-1)
        if self.spelling == "accuracy first":
            acc = (flat.argmax(dim=-1) == flat_labels).float().mean()
            return F.cross_entropy(flat.float(), flat_labels), acc
        loss = F.cross_entropy(flat.float(), flat_labels)
        mask = labels != -100
        if self.spelling == "masked sum":
            acc = ((logits.argmax(-1) == labels) & mask).sum()
        else:  # "masked mean over counted"
            acc = ((torch.argmax(logits, -1) == labels) * mask).float().sum() / mask.sum()
        return loss, acc


@pytest.mark.parametrize("spelling", ["masked sum", "masked mean over counted", "accuracy first"])
def test_plain_accuracy_folds_into_the_op_statistics(spelling, tmp_path):
    """The argmax accuracy on the fused logits is read from the op's top-1 count: no argmax
    and no logits left; the value equals the plain computation (random logits: no ties), and
    loss and gradients equal the unrewritten model's."""
    torch.manual_seed(3)
    model = _HeadWithAccuracy(spelling)
    h, _, t = _inputs()
    with torch.no_grad():  # make some predictions right so the count is not trivially 0
        pred = model.output(model.norm(h)).argmax(-1)
        t[:, ::2] = pred[:, ::2]
        t[0, :3] = -100

    def run(fn):
        x = h.detach().clone().requires_grad_(True)
        loss, acc = fn(x, t)
        grads = torch.autograd.grad(loss, [x, *model.parameters()])
        return loss.detach(), acc, grads

    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend=backend(inner="aot_eager", dump_dir=tmp_path), fullgraph=True
    )
    loss, acc, grads = run(compiled)
    step = _pass_step(tmp_path)
    counts = step["op_counts"]
    assert counts.get("graphtrain.linear_cross_entropy_with_stats.default") == 1, step
    assert CE not in counts and not any("argmax" in k for k in counts), counts
    assert any("top-1 count" in n for n in step["notes"]), step["notes"]
    want_loss, want_acc, want_grads = run(model)
    assert 0 < float(want_acc) and acc.dtype == want_acc.dtype
    assert torch.equal(acc, want_acc), (acc, want_acc)
    torch.testing.assert_close(loss, want_loss, rtol=2e-5, atol=2e-6)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


def test_invalid_target_gives_nan_loss_not_a_wrong_one(tmp_path):
    """A target outside [0, V) (not ignore_index) reaches the fused op: the loss is NaN, so the
    trainer's non-finite check stops the run at that step (eager torch raises instead)."""
    fn, _ = FUSED["F.linear + view"]
    h, w, t = _inputs()
    t[1, 4] = V  # one past the vocab
    (out,), _ = _run(fn, (h, w, t), tmp_path)
    assert _pass_step(tmp_path)["op_counts"].get(OP) == 1
    assert torch.isnan(out)
    with pytest.raises(IndexError):
        fn(h, w, t)
