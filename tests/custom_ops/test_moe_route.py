"""Tests of graphtrain::moe_route: weights, indices, counts, aux sums, logsumexp, the balance
losses' plain top-k counts and d logits against float64 torch.

The oracle is the MoE spec's router pseudo-code written with plain torch ops in float64, with
top-k taken by repeated argmax (torch.argmax returns the first maximum: the lower-index
tie-break, independently of the op's stable sort). Gradients are compared with fp64 autograd
through that oracle, for a random grad_output, and torch.autograd.gradcheck runs on the op in
fp64. CPU runs the op's pure-torch path; the Triton kernels run under TRITON_INTERPRET=1 in a
child process (the interpreter is chosen when the kernels are defined, at import), in fp32.
GPU tests (marker gpu) check fp32 tightly, bf16 logits, and CUDA-graph capture.
"""

from __future__ import annotations

import sys
import time
import zlib

import pytest
import torch
import triton

from graphtrain.custom_ops import moe_route as mr

# name -> (E, top_k, options, bias): every score function / normalisation / scale, with and
# without bias and groups; group sizes that are not powers of two, one expert per group.
CASES = {
    "softmax": (24, 3, {}, False),
    "softmax bias": (24, 3, {}, True),
    "softmax normalize scale": (24, 4, dict(normalize=True, route_scale=2.5), False),
    "softmax post": (24, 3, dict(pre_softmax=False), False),
    "softmax post bias groups": (
        30,
        4,
        dict(pre_softmax=False, num_groups=5, topk_groups=2, route_scale=0.5),
        True,
    ),
    "softmax groups bias": (32, 4, dict(num_groups=4, topk_groups=2), True),
    "sigmoid": (20, 2, dict(score_func="sigmoid"), False),
    "sigmoid normalize scale": (
        20,
        4,
        dict(score_func="sigmoid", normalize=True, route_scale=2.5),
        False,
    ),
    "sigmoid groups bias normalize scale (DeepSeek-V3)": (
        48,
        6,
        dict(score_func="sigmoid", num_groups=8, topk_groups=3, normalize=True, route_scale=2.5),
        True,
    ),
    "sigmoid groups max (DeepSeek-V3 without bias)": (
        36,
        5,
        dict(score_func="sigmoid", num_groups=6, topk_groups=2, normalize=True, group_score="max"),
        False,
    ),
    "softmax one expert per group": (6, 2, dict(num_groups=6, topk_groups=3), True),
    "all groups kept": (16, 5, dict(num_groups=4, topk_groups=4, normalize=True), True),
}


def first_max_topk(values, k):
    """Indices of the k largest per row, descending, ties to the lower index."""
    values = values.clone()
    picks = []
    for _ in range(k):
        i = values.argmax(dim=-1, keepdim=True)  # the first maximum
        picks.append(i)
        values.scatter_(1, i, float("-inf"))  # k <= the finite entries: never picked again
    return torch.cat(picks, dim=1)


def spec_router_f64(
    logits,
    bias,
    top_k,
    *,
    score_func="softmax",
    pre_softmax=True,
    num_groups=1,
    topk_groups=1,
    normalize=False,
    route_scale=1.0,
    group_score="top2",
    aux_seq_len=0,
    return_lse=False,
    count_plain=False,
):
    """The spec's router pseudo-code, in float64 (logits keep their autograd history), the
    per-sequence sums of the aux losses' probabilities as models/moe.py computes them, the
    z-loss's logsumexp, and per sequence the tokens that have each expert in the top-k of
    their scores without bias or group limit (DeepSeek-V3's f_i count)."""
    logits = logits.double()
    if score_func == "softmax" and pre_softmax:
        scores = torch.softmax(logits, dim=-1)
    elif score_func == "softmax":
        scores = logits
    else:
        scores = torch.sigmoid(logits)
    sel = scores.detach()
    if bias is not None:
        sel = sel + bias.double()
    T, E = sel.shape
    if num_groups > 1:
        grouped = sel.view(T, num_groups, E // num_groups)
        if group_score == "max" or grouped.shape[-1] == 1:
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = first_max_topk(group_scores, topk_groups)
        dropped = torch.ones(T, num_groups, dtype=torch.bool).scatter(1, kept, False)
        sel = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(T, E)
    indices = first_max_topk(sel, top_k)
    weights = scores.gather(1, indices)
    if score_func == "softmax" and not pre_softmax:
        weights = weights.softmax(dim=-1)
    elif normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * route_scale
    counts = torch.bincount(indices.flatten(), minlength=E)
    if score_func == "sigmoid":
        p = scores / scores.sum(-1, keepdim=True)
    else:
        p = torch.softmax(logits, dim=-1)
    aux_sums = p.view(-1, aux_seq_len, E).sum(1) if aux_seq_len else p.new_zeros(0, E)
    lse = torch.logsumexp(logits, dim=-1) if return_lse else logits.new_zeros(0)
    plain_counts = logits.new_zeros(0, E)
    if count_plain:
        plain = first_max_topk(scores.detach(), top_k)  # no bias, no groups
        hits = torch.zeros(T, E, dtype=torch.float64).scatter(1, plain, 1.0)
        plain_counts = hits.view(-1, aux_seq_len, E).sum(1)
    return weights, indices, counts, aux_sums, lse, plain_counts


def make_inputs(seed, T, E, with_bias, *, ties=False, dtype=torch.float32):
    """Fresh random logits (and bias); ties=True: values on a coarse grid, many exact ties,
    including rows where every logit is equal and groups with identical contents."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        logits = torch.randint(-2, 3, (T, E), generator=g).double() * 0.5
        logits[::4] = 0.25  # every expert and every group tied
        logits[1::4, E // 2 :] = logits[1::4, : E // 2]  # the two halves tied
        bias = (torch.randint(-1, 2, (E,), generator=g).double() * 0.25) if with_bias else None
    else:
        logits = torch.randn(T, E, generator=g, dtype=torch.float64) * 2
        bias = torch.randn(E, generator=g, dtype=torch.float64) * 0.1 if with_bias else None
    bias_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return logits.to(dtype), None if bias is None else bias.to(bias_dtype)


def grad_logits(fn, logits, grad_seed):
    """(weights, indices, counts, aux sums, lse, plain counts, d logits) of fn(logits) for
    random gradients of the weights and (when there are any) of the aux sums and the lse."""
    x = logits.detach().clone().requires_grad_(True)
    weights, indices, counts, aux_sums, lse, plain_counts = fn(x)
    g = torch.Generator().manual_seed(grad_seed)
    outs, grads = [weights], []
    for extra in (aux_sums, lse):
        if extra.numel():
            outs.append(extra)
    for out in outs:
        go = torch.randn(out.shape, generator=g, dtype=torch.float64)
        grads.append(go.to(out.device, out.dtype))
    (gx,) = torch.autograd.grad(outs, (x,), grads)
    return weights.detach(), indices, counts, aux_sums.detach(), lse.detach(), plain_counts, gx


def assert_close(actual, expected, tol, what=""):
    """max |a - e| <= tol * max |e| (relative to the tensor's scale, not per element)."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    if not expected.numel():
        return
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual - expected).abs().max()
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:.1e} x scale {scale:.3e}"


def check_against_oracle(
    fn,
    name,
    *,
    T,
    dtype,
    tol,
    ties=False,
    near_ties=0.0,
    aux_seq_len=0,
    return_lse=False,
    count_plain=False,
):
    """fn(logits, bias, top_k, **opts) -> (weights, indices, counts, aux sums, lse, plain
    counts), forward and d logits (through the weights, the aux sums and the lse).

    near_ties > 0: up to that fraction of the rows may choose other experts (two scores within
    fp32 rounding of each other, computed in another order than torch's); values are then
    compared on the other rows. 0: exact (the CPU runs on fixed seeds).
    """
    E, k, opts, with_bias = CASES[name]
    seed = zlib.crc32(repr((name, T, dtype, ties, aux_seq_len, return_lse)).encode()) % 10_000
    logits, bias = make_inputs(seed, T, E, with_bias, ties=ties, dtype=dtype)
    opts = {**opts, "aux_seq_len": aux_seq_len, "return_lse": return_lse}
    if count_plain:
        opts["count_plain"] = True
    w, i, c, a, lse, pc, gx = grad_logits(lambda x: fn(x, bias, k, **opts), logits, seed + 1)
    rw, ri, rc, ra, rlse, rpc, rgx = grad_logits(
        lambda x: spec_router_f64(x, bias, k, **opts), logits.double(), seed + 1
    )
    # The aux sums and the lse do not depend on the choice of experts: compared on every row.
    assert a.dtype == lse.dtype == w.dtype
    assert_close(a, ra, tol, f"{name} aux sums")
    assert_close(lse, rlse, tol, f"{name} lse")
    assert pc.dtype == w.dtype and pc.shape == rpc.shape, (pc.dtype, pc.shape, rpc.shape)
    if near_ties:  # a near tie may move one count; every token still counts k experts
        assert torch.equal(pc.sum(1), rpc.sum(1)), f"{name}: plain counts per sequence"
        assert (pc - rpc).abs().sum() <= 2 * near_ties * T * k, f"{name}: plain counts"
    else:
        assert torch.equal(pc, rpc.to(pc.dtype)), f"{name}: plain counts\n{pc}\n{rpc}"
    if near_ties:
        same = (i == ri).all(dim=-1)
        assert same.float().mean() >= 1 - near_ties, f"{name}: {(~same).sum()} rows differ"
        assert torch.equal(c, torch.bincount(i.flatten(), minlength=E)), f"{name}: counts"
        w, rw, gx, rgx, i, ri = (t[same] for t in (w, rw, gx, rgx, i, ri))
    else:
        assert torch.equal(c, rc), f"{name}: counts differ"
    assert torch.equal(i, ri), f"{name}: indices differ\n{i}\n{ri}"
    assert i.dtype == c.dtype == torch.int64 and c.shape == (E,)
    assert w.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert gx.dtype == dtype
    assert_close(w, rw, tol, f"{name} weights")
    assert_close(gx, rgx, tol, f"{name} d logits")


def op(logits, bias, top_k, **opts):
    return torch.ops.graphtrain.moe_route(logits, bias, top_k, **opts)


# ------------------------------------------------------------------------------------------
# the op on CPU (its pure-torch path)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_op_matches_float64(name, dtype, tol):
    check_against_oracle(op, name, T=37, dtype=dtype, tol=tol)
    check_against_oracle(op, name, T=36, dtype=dtype, tol=tol, aux_seq_len=12)
    check_against_oracle(op, name, T=36, dtype=dtype, tol=tol, aux_seq_len=12, return_lse=True)
    check_against_oracle(op, name, T=36, dtype=dtype, tol=tol, aux_seq_len=6, count_plain=True)


@pytest.mark.parametrize("name", list(CASES))
def test_exact_ties_go_to_the_lower_index(name):
    check_against_oracle(op, name, T=23, dtype=torch.float32, tol=2e-6, ties=True)
    check_against_oracle(
        op, name, T=24, dtype=torch.float32, tol=2e-6, ties=True, aux_seq_len=8, count_plain=True
    )


def test_plain_counts_ignore_bias_and_groups():
    """A bias that moves every token's dispatch to experts 0 and 1 leaves the plain counts at the
    top-k of the scores (DeepSeek-V3 / Megatron-Core's f_i): spelled out on a small case."""
    logits = torch.tensor([[3.0, 0.0, 2.0, 1.0], [0.0, 1.0, 3.0, 2.0], [2.0, 3.0, 0.0, 1.0]])
    bias = torch.tensor([10.0, 10.0, 0.0, 0.0])
    for options in (dict(), dict(num_groups=2, topk_groups=1)):
        out = op(logits, bias, 2, score_func="sigmoid", aux_seq_len=3, count_plain=True, **options)
        assert out[1].sort(dim=1).values.tolist() == [[0, 1]] * 3  # the biased dispatch
        assert out[5].tolist() == [[2.0, 1.0, 2.0, 1.0]]  # top-2 of the scores: {0,2} {2,3} {0,1}
    # Groups alone (no bias): token 0's best expert (0) is in the group with the lower
    # top-2 sum of sigmoid scores (0.95 + 0.01 < 2 * 0.88), so its dispatch goes to expert 2.
    logits[0] = torch.tensor([3.0, -5.0, 2.0, 2.0])
    opts = dict(score_func="sigmoid", aux_seq_len=3, count_plain=True)
    out = op(logits, None, 1, num_groups=2, topk_groups=1, **opts)
    assert out[5].tolist() == [[1.0, 1.0, 1.0, 0.0]]  # top-1 of the scores: 0, 2, 1
    assert out[2].tolist() == [0, 1, 2, 0]  # the group-limited dispatch: 2, 2, 1


def test_tie_order_spelled_out():
    """Every logit equal: experts 0..k-1 in order; groups: the first topk_groups groups."""
    logits = torch.zeros(3, 8)
    _, indices, counts, _, _, _ = op(logits, None, 3)
    assert indices.tolist() == [[0, 1, 2]] * 3 and counts.tolist() == [3, 3, 3, 0, 0, 0, 0, 0]
    bias = torch.tensor([0.0, 0, 0, 0, 0, 1, 0, 1])  # group 2 (experts 4, 5) and 3 tie at 1
    indices = op(logits, bias, 3, num_groups=4, topk_groups=2)[1]
    assert indices.tolist() == [[5, 7, 4]] * 3  # groups 2 and 3 kept; 4 before 6 on the tie


@pytest.mark.parametrize(
    "name",
    [
        "softmax normalize scale",
        "softmax post",
        "sigmoid groups bias normalize scale (DeepSeek-V3)",
    ],
)
def test_gradcheck_float64(name):
    """Through the weights, the aux sums (two sequences of 3 tokens) and the lse."""
    E, k, opts, with_bias = CASES[name]
    logits, bias = make_inputs(7, 6, E, with_bias, dtype=torch.float64)
    x = logits.requires_grad_(True)

    def differentiable(x):
        weights, _, _, aux_sums, lse, _ = op(x, bias, k, **opts, aux_seq_len=3, return_lse=True)
        return weights, aux_sums, lse

    assert torch.autograd.gradcheck(differentiable, (x,))


def test_low_precision_logits_compute_in_float32():
    """bf16 logits give exactly what fp32 logits with the same values give."""
    E, k, opts, with_bias = CASES["sigmoid groups bias normalize scale (DeepSeek-V3)"]
    logits, bias = make_inputs(3, 29, E, with_bias, dtype=torch.bfloat16)
    opts = {**opts, "aux_seq_len": 29, "return_lse": True}
    w, i, c, a, lse, _, gx = grad_logits(lambda x: op(x, bias, k, **opts), logits, 4)
    rw, ri, rc, ra, rlse, _, rgx = grad_logits(lambda x: op(x, bias, k, **opts), logits.float(), 4)
    assert w.dtype == a.dtype == lse.dtype == torch.float32 and gx.dtype == torch.bfloat16
    assert torch.equal(w, rw) and torch.equal(i, ri) and torch.equal(c, rc) and torch.equal(a, ra)
    assert torch.equal(lse, rlse) and torch.equal(gx, rgx.bfloat16())


def test_only_weights_carry_gradient():
    logits, bias = make_inputs(5, 9, 16, True)
    x = logits.requires_grad_(True)
    b = bias.clone().requires_grad_(True)
    opts = dict(num_groups=4, topk_groups=2, aux_seq_len=3, return_lse=True, count_plain=True)
    weights, indices, counts, aux_sums, lse, plain_counts = op(x, b, 2, **opts)
    assert weights.requires_grad and aux_sums.requires_grad and lse.requires_grad
    assert not indices.requires_grad and not counts.requires_grad
    assert not plain_counts.requires_grad
    gx, gb = torch.autograd.grad(weights.sum(), (x, b), allow_unused=True, retain_graph=True)
    assert gx is not None and gb is None
    # The aux sums alone (the weights get no gradient): d logits from them only.
    (ga,) = torch.autograd.grad(aux_sums.square().sum(), (x,), retain_graph=True)
    (ra,) = torch.autograd.grad(torch.softmax(x, -1).view(3, 3, 16).sum(1).square().sum(), (x,))
    assert_close(ga, ra, 2e-6, "d logits from the aux sums alone")
    # The lse alone: the z-loss's gradient.
    (gz,) = torch.autograd.grad(lse.square().mean(), (x,))
    (rz,) = torch.autograd.grad(torch.logsumexp(x, -1).square().mean(), (x,))
    assert_close(gz, rz, 2e-6, "d logits from the lse alone")
    with torch.no_grad():
        w2 = op(x, b, 2, num_groups=4, topk_groups=2)[0]
    assert torch.equal(w2, weights.detach())


def test_empty_batch():
    for aux_seq_len, return_lse in ((0, False), (4, True)):
        weights, indices, counts, aux_sums, lse, plain_counts = op(
            torch.zeros(0, 8),
            None,
            2,
            aux_seq_len=aux_seq_len,
            return_lse=return_lse,
            count_plain=return_lse,
        )
        assert weights.shape == (0, 2) and indices.shape == (0, 2) and counts.tolist() == [0] * 8
        assert aux_sums.shape == (0, 8) and lse.shape == (0,) and plain_counts.shape == (0, 8)


BAD_ARGS = [
    (dict(score_func="relu"), "score_func"),
    (dict(score_func="sigmoid", pre_softmax=False), "pre_softmax"),
    (dict(num_groups=3), "num_groups=3"),
    (dict(num_groups=0), "num_groups=0"),
    (dict(num_groups=4, topk_groups=5), "topk_groups=5"),
    (dict(num_groups=4, topk_groups=0), "topk_groups=0"),
    (dict(top_k=5, num_groups=4, topk_groups=2), "top_k=5"),
    (dict(top_k=0), "top_k=0"),
    (dict(group_score="mean"), "group_score"),
    (dict(route_scale=float("nan")), "route_scale"),
    (
        dict(aux_seq_len=3),
        r"aux_seq_len=3 must be 0 \(no aux sums\) or divide the number of tokens T=4",
    ),
    (dict(aux_seq_len=-2), "aux_seq_len=-2"),
    (dict(count_plain=True), "count_plain=True needs aux_seq_len > 0"),
    (dict(bias=torch.zeros(7)), r"\[E\]=\[8\]"),
    (dict(bias=torch.zeros(8, dtype=torch.bfloat16)), "bias must be float32"),
    (dict(logits=torch.zeros(2, 3, 8)), r"\[T, E\]"),
    (dict(logits=torch.zeros(4, 8, dtype=torch.int64)), "torch.int64"),
]


@pytest.mark.parametrize("change,match", BAD_ARGS)
def test_bad_arguments_raise(change, match):
    args = {**dict(logits=torch.zeros(4, 8), bias=None, top_k=2), **change}
    logits, bias, top_k = args.pop("logits"), args.pop("bias"), args.pop("top_k")
    with pytest.raises(ValueError, match=match):
        op(logits, bias, top_k, **args)
    with torch._subclasses.FakeTensorMode() as mode, pytest.raises(ValueError, match=match):
        fake = mode.from_tensor(logits)
        op(fake, None if bias is None else mode.from_tensor(bias), top_k, **args)


@pytest.mark.parametrize(
    "name", ["softmax groups bias", "softmax post", "sigmoid groups max (DeepSeek-V3 without bias)"]
)
def test_opcheck(name):
    E, k, opts, with_bias = CASES[name]
    logits, bias = make_inputs(11, 14, E, with_bias)
    for aux_seq_len, return_lse in ((0, False), (7, True)):
        torch.library.opcheck(
            torch.ops.graphtrain.moe_route.default,
            (logits.requires_grad_(True), bias, k),
            {
                **opts,
                "aux_seq_len": aux_seq_len,
                "return_lse": return_lse,
                "count_plain": return_lse,
            },
        )
    indices = op(logits, bias, k, **opts)[1]
    bwd_opts = dict(
        score_func=opts.get("score_func", "softmax"),
        pre_softmax=opts.get("pre_softmax", True),
        normalize=opts.get("normalize", False),
        route_scale=opts.get("route_scale", 1.0),
        aux_seq_len=7,
    )
    for grad_aux, grad_lse in ((None, None), (torch.randn(2, E), torch.randn(14))):
        torch.library.opcheck(
            torch.ops.graphtrain.moe_route_backward.default,
            (torch.randn(14, k), grad_aux, grad_lse, logits.detach(), indices),
            bwd_opts,
        )


def test_compiled_matches_eager():
    """fullgraph torch.compile (aot_eager): the op stays one node and its backward is traced."""
    E, k, opts, with_bias = CASES["sigmoid groups bias normalize scale (DeepSeek-V3)"]
    logits, bias = make_inputs(17, 21, E, with_bias)

    def f(x):
        weights, indices, counts, aux_sums, lse, plain_counts = op(
            x * 2, bias, k, **opts, aux_seq_len=7, return_lse=True, count_plain=True
        )
        return weights * 3, indices, counts, aux_sums, lse, plain_counts

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for a, b in zip(grad_logits(compiled, logits, 1), grad_logits(f, logits, 1), strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------
# the Triton kernels, under the interpreter (fp32, tiny shapes)
# ------------------------------------------------------------------------------------------


def _triton_op(logits, bias, top_k, **opts):
    """The CUDA path's forward and backward kernels, wired like autograd wires the op."""

    class Route(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            outs = mr.moe_route_triton(x, bias, top_k, **opts)
            ctx.save_for_backward(x, outs[1])
            ctx.mark_non_differentiable(outs[1], outs[2], outs[5])
            return outs

        @staticmethod
        def backward(
            ctx, grad_weights, _grad_indices, _grad_counts, grad_aux_sums, grad_lse, _grad_plain
        ):
            x, indices = ctx.saved_tensors
            return mr.moe_route_backward_triton(
                grad_weights,
                grad_aux_sums,
                grad_lse if opts["return_lse"] else None,
                x,
                indices,
                score_func=opts.get("score_func", "softmax"),
                pre_softmax=opts.get("pre_softmax", True),
                normalize=opts.get("normalize", False),
                route_scale=opts.get("route_scale", 1.0),
                aux_seq_len=opts["aux_seq_len"],
            )

    return Route.apply(logits)


def _interpreter_checks() -> None:
    """Run in a child with TRITON_INTERPRET=1: both kernels on CPU, fp32, against the oracle."""
    assert mr._interpreting()
    for name in CASES:
        t0 = time.time()
        for ties in (False, True):  # T = 37: not a multiple of any block
            check_against_oracle(_triton_op, name, T=37, dtype=torch.float32, tol=2e-6, ties=ties)
        # Sequences of 12 tokens: each program's block ends at its sequence's end; the lse.
        check_against_oracle(
            _triton_op, name, T=36, dtype=torch.float32, tol=2e-6, aux_seq_len=12, return_lse=True
        )
        # The balance losses' plain top-k counts, with ties (sequences of 9: blocks end inside).
        for ties in (False, True):
            check_against_oracle(
                _triton_op,
                name,
                T=27,
                dtype=torch.float32,
                tol=2e-6,
                ties=ties,
                aux_seq_len=9,
                count_plain=True,
            )
        print(f"interpreter {name} ok in {time.time() - t0:.1f}s")
    # Strided logits (a column slice of a wider buffer) and E beyond the tile of one warp; its
    # sequences of 19 tokens span several blocks of 4, the last one partly.
    wide = torch.randn(57, 300)
    logits = wide[:, :260]
    opts = dict(num_groups=4, topk_groups=2, aux_seq_len=19, return_lse=True, count_plain=True)
    w, i, c, a, lse, pc = mr.moe_route_triton(logits, None, 8, **opts)
    rw, ri, rc, ra, rlse, rpc = spec_router_f64(logits, None, 8, **opts)
    assert torch.equal(i, ri) and torch.equal(c, rc) and torch.equal(pc, rpc.float())
    assert not torch.equal(pc.sum(0), c.float())  # the group limit moves the dispatch
    assert_close(w, rw, 2e-6, "strided")
    assert_close(a, ra, 2e-6, "strided aux sums")
    assert_close(lse, rlse, 2e-6, "strided lse")
    print("interpreter strided ok")


def test_triton_kernels_under_interpreter():
    if mr._interpreting():
        _interpreter_checks()
        return
    from conftest import run_interpreter_checks  # not at the top: this file also runs as a script

    run_interpreter_checks(__file__, "interpreter strided ok")


def _compile_for_sm90(
    kernel, types: dict[str, str], constexprs: dict[str, object], num_warps: int = 4
) -> None:
    """Compile `kernel` to a Hopper cubin (Triton's NVIDIA backend and its ptxas), no GPU, and
    check that ptxas spills no register (a spill is a local-memory round trip per element)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton_aot import _ptxas  # the ptxas report of the kernel compile test

    signature = {**types, **dict.fromkeys(constexprs, "constexpr")}
    assert list(signature) == kernel.arg_names, "the test's argument list is out of date"
    index = {name: (i,) for i, name in enumerate(kernel.arg_names)}
    src = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={index[name]: value for name, value in constexprs.items()},
    )
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )
    assert compiled.asm["cubin"]
    report = _ptxas(compiled.asm["ptx"], 90)
    spills = (report["spill_stores"], report["spill_loads"])
    assert spills == (0, 0), f"{kernel.fn.__name__} {constexprs}: {report}"


@pytest.mark.parametrize("extras", [False, True])
@pytest.mark.parametrize(
    "dtype,score,groups,E,K",
    [
        ("bf16", "sigmoid", 8, 256, 8),
        ("fp32", "softmax", 1, 256, 8),
        ("fp16", "post", 1, 256, 8),
        ("fp32", "sigmoid", 8, 64, 6),  # moe-1b's router
        ("bf16", "sigmoid", 8, 2048, 8),  # a row wider than the tile (one token a program)
    ],
)
def test_kernels_compile_for_hopper(dtype, score, groups, E, K, extras):
    """The CUDA codegen (which the interpreter skips) accepts both kernels, on a CPU machine,
    at the launchers' block sizes and warps, without register spills: the benchmark's 256
    experts, top-8, moe-1b's 64, top-6, and 2048, with and without the aux sums and the lse.
    The releases spill in different places (on the earlier tiles 3.6 failed the 2048 row with
    the extras, 3.9 the 256 row): run it with each."""
    code = {"softmax": mr._SOFTMAX_PRE, "post": mr._SOFTMAX_POST, "sigmoid": mr._SIGMOID}[score]
    g_pad, epg, epg_pad = mr._tile(E, groups)
    _compile_for_sm90(
        mr._moe_route_fwd_kernel,
        {
            "logits_ptr": f"*{dtype}",
            "bias_ptr": "*fp32",
            "weights_ptr": "*fp32",
            "indices_ptr": "*i64",
            "counts_ptr": "*i64",
            "aux_ptr": "*fp32",
            "lse_ptr": "*fp32",
            "plain_ptr": "*fp32",
            "T": "i32",
            "SEQ_LEN": "i32",
            "BLOCKS_PER_SEQ": "i32",
            "stride_t": "i32",
            "route_scale": "fp32",
        },
        dict(
            K=K,
            K_PAD=triton.next_power_of_2(K),
            E=E,
            G=groups,
            EPG=epg,
            G_PAD=g_pad,
            EPG_PAD=epg_pad,
            TOPK_GROUPS=max(1, groups // 2),
            SCORE=code,
            HAS_BIAS=True,
            NORMALIZE=True,
            GROUP_MAX=False,
            AUX=extras,
            LSE=extras,
            PLAIN=2 if extras else 0,
            BLOCK_T=mr._FWD_TILE // (g_pad * epg_pad),
        ),
        num_warps=mr._FWD_WARPS,
    )
    block_t, block_e, warps = mr._bwd_config(code, 65536, E, extras=extras)
    _compile_for_sm90(
        mr._moe_route_bwd_kernel,
        {
            "grad_w_ptr": "*fp32",
            "grad_aux_ptr": "*fp32",
            "grad_lse_ptr": "*fp32",
            "logits_ptr": f"*{dtype}",
            "indices_ptr": "*i64",
            "dlogits_ptr": f"*{dtype}",
            "T": "i32",
            "E": "i32",
            "SEQ_LEN": "i32",
            "stride_t": "i32",
            "route_scale": "fp32",
        },
        dict(
            K=K,
            K_PAD=triton.next_power_of_2(K),
            SCORE=code,
            NORMALIZE=True,
            AUX=extras,
            LSE=extras,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
        ),
        num_warps=warps,
    )


# ------------------------------------------------------------------------------------------
# GPU (skipped on CPU): fp32 tightly, bf16 logits, CUDA-graph capture
# ------------------------------------------------------------------------------------------


def _cuda(fn):
    def run(logits, bias, top_k, **opts):
        out = fn(logits.cuda(), None if bias is None else bias.cuda(), top_k, **opts)
        return tuple(t.cpu() for t in out)

    return run


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_matches_float64(name):
    check_against_oracle(_cuda(op), name, T=1000, dtype=torch.float32, tol=2e-6, near_ties=2e-3)
    check_against_oracle(_cuda(op), name, T=1000, dtype=torch.float32, tol=2e-6, ties=True)
    check_against_oracle(
        _cuda(op),
        name,
        T=1000,
        dtype=torch.float32,
        tol=2e-6,
        near_ties=2e-3,
        aux_seq_len=200,
        return_lse=True,
        count_plain=True,
    )


@pytest.mark.gpu
def test_cuda_deepseek_shape_bf16():
    """256 experts, 8 groups, top-4 groups, top-8, bf16 logits: the fp32 computation of them."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(4096, 256, device="cuda", generator=g).bfloat16()
    bias = torch.randn(256, device="cuda", generator=g) * 0.01
    opts = dict(score_func="sigmoid", num_groups=8, topk_groups=4, normalize=True, route_scale=2.5)
    opts.update(aux_seq_len=1024, return_lse=True, count_plain=True)
    w, i, c, a, lse, pc, gx = grad_logits(lambda x: op(x, bias, 8, **opts), logits, 1)
    rw, ri, _, ra, rlse, rpc, rgx = grad_logits(
        lambda x: mr.moe_route_ref(x.float(), bias, 8, **opts), logits, 1
    )
    assert_close(a, ra, 2e-6, "aux sums")
    assert_close(lse, rlse, 2e-6, "lse")
    assert torch.equal(pc.sum(1), rpc.sum(1)) and (pc - rpc).abs().sum() <= 16, "plain counts"
    assert torch.equal(c, torch.bincount(i.flatten(), minlength=256))
    same = (i == ri).all(dim=-1)  # near ties (within fp32 rounding) may be ordered otherwise
    assert same.float().mean() > 0.999, (~same).sum()
    assert torch.equal(i[same], ri[same])
    assert_close(w[same], rw[same], 2e-6, "weights")
    assert_close(gx[same].float(), rgx[same].float(), 1e-2, "d logits (bf16)")


@pytest.mark.gpu
def test_cuda_graph_capture():
    """No host sync: forward + backward capture into a CUDA graph and replay correctly."""
    logits = torch.randn(2048, 256, device="cuda").requires_grad_(True)
    bias = torch.randn(256, device="cuda") * 0.01
    opts = dict(score_func="sigmoid", num_groups=8, topk_groups=4, normalize=True)

    def step():
        weights, indices, counts, aux_sums, lse, _ = op(
            logits, bias, 8, **opts, aux_seq_len=512, return_lse=True
        )
        grads = (torch.ones_like(weights), torch.ones_like(aux_sums), torch.ones_like(lse))
        (gx,) = torch.autograd.grad((weights, aux_sums, lse), (logits,), grads)
        return weights.detach(), indices, counts, aux_sums.detach(), lse.detach(), gx

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: Triton compilation happens here
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, step(), strict=True):
        assert torch.equal(a, b)


def test_benchmark_cpu_smoke():
    """benchmarks/moe_router.py imports, and its plain routers, the op and the pass agree."""
    from conftest import run_benchmark_smoke  # not at the top: this file also runs as a script

    run_benchmark_smoke(
        "moe_router.py", "cpu smoke softmax-aux-z: eager, graphtrain-op and graphtrain-pass agree"
    )


if __name__ == "__main__":
    if "--interpreter-checks" in sys.argv:
        _interpreter_checks()
