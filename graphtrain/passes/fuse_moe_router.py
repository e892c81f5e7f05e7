"""Pass fuse_moe_router: the plain MoE router sub-graph -> graphtrain::moe_route.

What
    In the Dynamo graph (pre-grad, torch IR) it finds the routing sub-graph from the router
    logits to the routing weights and expert indices (and, when present, the tokens-per-expert
    counts) and replaces it with one graphtrain.moe_route(logits, bias, top_k, ...) node. It
    starts from each top-k (or descending sort) over a 2-D tensor, the last one first, and reads
    backwards and forwards by meaning rather than by spelling (the shapes of the recorded fake
    values decide what a reshape does; the canonicalize pass has already brought method calls,
    reshapes and casts to one spelling and dropped no-op casts such as Megatron's
    softmax(...).type_as(logits) of fp32 logits):
        scores     softmax(logits, -1) (F.softmax / torch.softmax / .softmax, dtype=float32 of
                   bf16 logits allowed) / sigmoid(logits) / the logits themselves when the
                   weights are softmax-ed after the top-k (pre_softmax=False)
        selection  scores (+ bias [E], any operand order, .detach() anywhere on this path)
        groups     sel viewed [T, G, E/G] (view / reshape / unflatten); group score = its max
                   (amax, max(dim).values) or top-2 sum (topk(2)[0].sum(-1), also topk(min(2,
                   E/G)) as models/moe.py writes it); the topk_groups
                   best groups by topk or a descending sort sliced [:, :n]; the mask built by
                   scatter into a constant [T, G] tensor (ones + False = drop mask, zeros + True
                   = keep mask, in place or not, any bool/float dtype), negated by ~ /
                   logical_not / == 0, cast, and broadcast either as [T, G, 1] onto the grouped
                   view or expanded and reshaped to [T, E]; masked_fill(-inf), then flattened
        top-k      topk(sel, k, -1) (sorted or not) or a descending sort/argsort sliced [:, :k]
        weights    scores.gather(1, indices) (torch.gather, dim 1 or -1), or the top-k values
                   themselves when they are the scores (no bias, no detach); then optionally
                   softmax (after top-k), or w / w.sum(-1, keepdim=True) (+ 1e-20), in place
                   (DeepSeek's `weights /= ...`) or not; then optionally * a constant scale
        counts     bincount(indices.flatten(), minlength=E), histc(indices.float() (flattened
                   or not), bins=E, min=0, max=E or E-1), zeros(E).scatter_add(0, flat, ones) /
                   index_add; each replaced by the op's counts cast to its dtype
        aux sums   the load-balancing losses' sums of their probabilities p (softmax(logits):
                   the scores themselves or a softmax of the logits of its own; for sigmoid
                   scores / scores.sum(-1, keepdim=True)): p.sum(0) over the tokens and
                   p.view(B, L, E).sum(1) per sequence (view / reshape / unflatten), fp32,
                   after the top-k; they become aux_sums.sum(0) and aux_sums of the op with
                   aux_seq_len=L (T when there are only token sums). models/moe.py's aux,
                   seq_aux and global_aux losses read only these and the plain counts.
        plain counts what those losses count (DeepSeek-V3's f_i, Megatron-Core's aux routing
                   map): a top-k (or descending sort [:, :k]) of the same scores with the same
                   k, no bias, no group limit (or the expert top-k itself when the router has
                   neither), scattered as ones into zeros [T, E] (scatter(1, idx, 1), not in
                   place), summed over the tokens (.sum(0)) and/or per sequence
                   (.view(B, L, E).sum(1), L the aux sums' own when they have one), after the
                   expert top-k; they become the op's plain_counts (count_plain=True) summed
                   over dim 0, or the rows, cast to their dtype, and the extra top-k goes.
        lse        the router z-loss's logsumexp(logits, -1) (torch / method spelling, dim -1
                   or 1, keepdim or not), of the op's logits or of their fp32 cast, fp32,
                   before or after the top-k (Megatron takes it before routing): it becomes
                   the op's lse (return_lse=True) and the op moves up to the first of them.
    This covers the MoE spec's router (every option), DeepSeek-V3's public inference
    Gate.forward (whose group score without bias is the max: the op's group_score="max") and a
    plain softmax top-k router (probs.topk(k) with or without renormalisation).

Why
    The fused op reads the logits once and writes weights, indices, counts, the aux sums and
    the logsumexp in one kernel, with its own backward; the plain router is a dozen kernels and
    several passes over [T, E], and the aux losses' softmax, the z-loss's logsumexp and their
    backwards more.

What stays
    Only the op's outputs are rewired (the weights at the end of the matched chain, the
    indices, the counts, the aux sums, the logsumexps); every matched node that is still used
    elsewhere (the scores' row max, the top-k values, the mask, ...) is kept, the others are
    erased. A chain that stops early is still right: e.g. a normalisation with another
    epsilon is not absorbed and stays in the graph, applied to the op's weights.

Refusals (the graph is left as it was and ctx.note says why)
    a top-k whose indices feed no weights (a top-k accuracy, sampling: nothing to fuse); scores
    that are neither softmax nor sigmoid of the logits unless softmax-ed after the top-k;
    scores computed in bf16/fp16 (the op computes in fp32: cast the logits first); masking
    with anything but -inf (Hugging Face's masked_fill(~mask, 0.0) differs whenever a kept
    score is negative); a bias that is not an fp32 [E] tensor; a mask or view the pass cannot
    prove to be the group layout; an in-place op whose changed tensor is read afterwards by
    a node outside the router, or an in-place op outside the router on its tensors between
    two of its reads; a top-k beyond the experts of the kept groups (the op's argument checks);
    symbolic shapes; more experts than the Triton kernel's tile (4096, padded per group).
    Every refusal is noted, except for a group selection that an attempt at its router read
    (that router's note says what happened).

Invariant and numerics (preserves_numerics=False)
    Indices, counts and plain counts are exactly the graph's when no two scores are equal; on
    exact ties the op takes the lower expert (and group) index, as a stable descending sort
    does (models/moe.py), where torch.topk's choice is unspecified. sorted=False top-k indices
    come back sorted (a valid order). The weights, aux sums and logsumexps
    equal the graph's up to rounding: on CPU the op's reference computes the same torch ops
    (bitwise equal weights for the spec's code), its backward is a closed form (agrees to a few
    ulps); the CUDA kernels sum the softmax in another order. w / w.sum() is taken as the op's
    w / (w.sum() + 1e-20): identical in fp32 unless the k weights sum below 1.7e-13 (only
    sigmoid logits all below about -29), where the op gives 0 instead of 0/0 = NaN.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Node

import graphtrain.custom_ops.moe_route as moe_route_op
from graphtrain.passes import fx
from graphtrain.passes.fx import Refuse
from graphtrain.passes.moe_router_selection import SelectionMatcher
from graphtrain.passes.registry import PassContext, register_pass

_OP = torch.ops.graphtrain.moe_route.default


@dataclass
class _Router:
    anchor: Node  # the expert top-k (or sort): the op goes right before it
    logits: Node
    bias: Node | None
    top_k: int
    options: dict[str, Any]
    indices: list[Node]  # nodes whose uses become the op's indices
    weights: Node  # the node whose uses become the op's weights
    counts: list[Node]  # nodes whose uses become the op's counts (cast to their dtype)
    token_sums: list[Node]  # p.sum(0): become aux_sums.sum(0)
    seq_sums: list[Node]  # p.view(B, L, E).sum(1): become aux_sums
    lse: list[Node]  # logsumexp(logits, -1): become the op's lse
    plain_token: list[Node]  # the plain top-k's map .sum(0): become plain_counts.sum(0)
    plain_seq: list[Node]  # its .view(B, L, E).sum(1): become plain_counts
    at: Node  # the op goes right before this node: the anchor or an earlier logsumexp
    nodes: set[Node]  # every node of the sub-graph

    @property
    def rewired(self) -> set[Node]:
        """The nodes whose readers get the op's outputs."""
        return {
            self.weights,
            *self.indices,
            *self.counts,
            *self.token_sums,
            *self.seq_sums,
            *self.lse,
            *self.plain_token,
            *self.plain_seq,
        }


class _Matcher(SelectionMatcher):
    """Reads one router around a top-k anchor (the selection side in SelectionMatcher, the
    outputs here); raises Refuse with the reason otherwise."""

    # ---- the aux losses' sums ---------------------------------------------------------------

    def aux_sums(
        self, anchor: Node, logits: Node, scores: Node, score_func: str, pre_softmax: bool
    ) -> tuple[int, list[Node], list[Node]]:
        """(aux_seq_len, token sums, sequence sums) of the aux probabilities p: sums over the
        tokens (p.sum(0)) and per sequence (p.view(B, L, E).sum(1)) that come after the
        top-k (where the op's outputs exist), fp32, without keepdim."""
        T, E = fx.shape(logits)
        if score_func == "sigmoid":  # p = scores / scores.sum(-1, keepdim=True)
            probs = [
                u
                for u in scores.users
                if (c := fx.is_call(u, "div")) is not None
                and not c.inplace
                and c.args[0] is scores
                and (total := fx.is_call(c.args[1], "sum")) is not None
                and total.args[0] is scores
                and fx.last_dim(total.arg(1, "dim"), 2)
                and total.arg(2, "keepdim", False)
                and total.kwargs.get("dtype") is None
            ]
        else:  # p = softmax(logits): the scores themselves, or a softmax of their own
            probs = [scores] if pre_softmax else []
            probs += [
                u
                for u in logits.users
                if u is not scores
                and (c := fx.is_call(u, "softmax")) is not None
                and fx.last_dim(c.arg(1, "dim"), 2)
                and c.arg(2, "dtype") in (None, torch.float32)
            ]
        order = {n: i for i, n in enumerate(anchor.graph.nodes)}
        token, per_seq, seq_len = [], [], 0
        for p in probs:
            if fx.dtype(p) != torch.float32 or fx.shape(p) != (T, E):
                continue
            t, q, views, seq_len = self._map_sums(p, T, E, order[anchor], seq_len)
            if t or q:
                token += t
                per_seq += q
                self.take(p, *t, *views, *q)
        if score_func == "sigmoid":  # the row sums of the folded p's go with them
            self.take(*(p.args[1] for p in probs if p in self.nodes))
        if not token and not per_seq:
            return 0, [], []
        return seq_len or T, token, per_seq

    # ---- the balance losses' plain top-k counts ---------------------------------------------

    def plain_counts(
        self, anchor: Node, scores: Node, indices: list[Node], k: int, reuse: bool, seq_len: int
    ) -> tuple[int, list[Node], list[Node]]:
        """(L, token sums, sequence sums) of the ones scattered at the plain top-k of `scores`
        (another top-k of them with the same k; the expert top-k's `indices` when `reuse`, the
        router having no bias and no group limit). seq_len: the aux sums' L (0: any)."""
        T, E = fx.shape(scores)
        order = {n: i for i, n in enumerate(anchor.graph.nodes)}
        found: list[tuple[SelectionMatcher | None, list[Node]]] = [(None, indices)] if reuse else []
        for u in scores.users:
            if u is anchor or fx.is_call(u, "topk", "sort", "argsort") is None:
                continue
            sub = SelectionMatcher()
            try:
                x, kk, idx, _ = sub.selection(u)
            except Refuse:
                continue
            if x is scores and kk == k and idx and order[u] > order[anchor]:
                found.append((sub, idx))
        token, per_seq = [], []
        for sub, idx in found:
            used = False
            for i in idx:
                for c in (fx.is_call(u, "scatter") for u in i.users):
                    if c is None:
                        continue
                    zeros = fx.call(c.args[0])
                    value = c.arg(3, "value", c.kwargs.get("src"))
                    if (
                        c.inplace
                        or c.arg(2, "index") is not i
                        or c.arg(1, "dim") not in (1, -1)
                        or "reduce" in c.kwargs
                        or zeros is None
                        or fx.FILLS.get(zeros.name) != 0
                        or fx.shape(c.node) != (T, E)
                        or fx.dtype(c.node) != torch.float32
                        or isinstance(value, bool)
                        or value != 1
                    ):
                        continue
                    t, q, views, L = self._map_sums(c.node, T, E, order[anchor], seq_len)
                    if t or q:
                        seq_len, used = L, True
                        token += t
                        per_seq += q
                        self.take(c.node, zeros.node, *t, *q, *views)
            if used and sub is not None:
                self.take(*sub.nodes)
        if not token and not per_seq:
            return 0, [], []
        return seq_len or T, token, per_seq

    @staticmethod
    def _map_sums(
        hits: Node, T: int, E: int, after: int, seq_len: int
    ) -> tuple[list[Node], list[Node], list[Node], int]:
        """(token sums, sequence sums, their [B, L, E] views, L) of a [T, E] map: fp32 sums
        without keepdim after position `after`; L must be seq_len unless that is 0."""
        order = {n: i for i, n in enumerate(hits.graph.nodes)}

        def is_sum(node: Node, dim: int, shape: tuple) -> bool:
            c = fx.is_call(node, "sum")
            return (
                c is not None
                and c.arg(1, "dim") in (dim, (dim,), [dim])
                and not c.arg(2, "keepdim", False)
                and c.kwargs.get("dtype") is None
                and fx.shape(node) == shape
                and order[node] > after
            )

        token, per_seq, views = [], [], []
        for u in hits.users:
            if is_sum(u, 0, (E,)):
                token.append(u)
                continue
            c = fx.call(u)
            view = fx.shape(u)
            if c is None or not fx.is_reinterpret(c) or view is None or len(view) != 3:
                continue
            B, L = view[0], view[1]
            if B * L != T or view[2] != E or (seq_len and L != seq_len):
                continue
            sums = [v for v in u.users if is_sum(v, 1, (B, E))]
            if sums:
                seq_len = L
                per_seq += sums
                views.append(u)
        return token, per_seq, views, seq_len

    # ---- the z-loss's logsumexp ------------------------------------------------------------

    def logsumexps(self, anchor: Node, logits: Node, bias: Node | None) -> tuple[list[Node], Node]:
        """(logsumexp(logits, -1) nodes, the node the op goes before): fp32 over the last dim,
        of the logits or of their fp32 cast, anywhere after the bias exists (the op then moves
        up to the first of them)."""
        T, E = fx.shape(logits)
        sources = [logits] + [
            u
            for u in logits.users
            if fx.cast_dtype(u) == torch.float32
            and u.args[0] is logits
            and fx.shape(u) == (T, E)
            and fx.val(u).device == fx.val(logits).device
        ]
        order = {n: i for i, n in enumerate(anchor.graph.nodes)}
        after = order[bias] if bias is not None else -1
        found = []
        for src in sources:
            for c in fx.uses(src, "logsumexp"):
                if (
                    c.arg(1, "dim") in (-1, 1, (-1,), (1,), [-1], [1])
                    and fx.dtype(c.node) == torch.float32
                    and fx.shape(c.node) in ((T,), (T, 1))
                    and order[c.node] > after
                ):
                    found.append(c.node)
                    if src is not logits:
                        self.take(src)
        self.take(*found)
        return found, min([anchor, *found], key=order.__getitem__)

    # ---- weights and counts ---------------------------------------------------------------

    def weights(
        self, scores: Node, indices: list[Node], values: list[Node], values_are_scores: bool
    ) -> Node:
        """The first weights node: scores.gather(1, indices), or the top-k values."""
        for c in fx.uses(scores, "gather"):
            if (
                c.arg(1, "dim") in (1, -1)
                and any(c.arg(2, "index") is i for i in indices)
                and not c.kwargs.get("sparse_grad", False)
                and not c.inplace
            ):
                self.take(c.node)
                return c.node
        used = [v for v in values if v.users]
        if values_are_scores and used:
            return used[0]
        raise Refuse(
            "no routing weights: the indices feed no scores.gather(1, indices) and the top-k "
            "values are not the scores (nothing to fuse, e.g. a top-k accuracy)"
        )

    def weight_chain(self, w: Node, post_softmax: bool) -> tuple[Node, bool, float]:
        """(last weights node, normalize, route_scale) following the weights forward."""
        normalize, scale = False, 1.0
        if post_softmax:
            nxt = [
                u
                for u in w.users
                if (c := fx.is_call(u, "softmax")) and fx.last_dim(c.arg(1, "dim"), 2)
            ]
            c = fx.call(nxt[0]) if len(nxt) == 1 else None
            if (
                c is None
                or c.arg(2, "dtype") not in (None, torch.float32)
                or fx.dtype(c.node) != torch.float32
            ):
                raise Refuse(
                    "the weights are the raw logits: neither softmax/sigmoid before the top-k "
                    "nor a float32 softmax after it"
                )
            self.take(c.node)
            w = c.node
        else:
            step = self.normalization(w)
            if step is not None:
                w, normalize = step, True
        step = self.scaling(w)
        if step is not None:
            w, scale = step
        return w, normalize, scale

    def normalization(self, w: Node) -> Node | None:
        """w / (w.sum(-1, keepdim=True) [+ 1e-20]) as a user of w, or None."""
        for u in w.users:
            c = fx.is_call(u, "div")
            if c is None or c.args[0] is not w or len(c.args) != 2 or c.kwargs:
                continue
            pattern, denom = [], c.args[1]
            add = fx.is_call(denom, "add")
            if add is not None and not add.inplace and len(add.args) == 2 and not add.kwargs:
                a, b = add.args
                eps, denom = (b, a) if isinstance(b, float) else (a, b)
                if eps != moe_route_op.NORMALIZE_EPS:
                    return None
                pattern.append(add.node)
            s = fx.is_call(denom, "sum")
            if (
                s is None
                or s.args[0] is not w
                or not fx.last_dim(s.arg(1, "dim"), 2)
                or not s.arg(2, "keepdim", False)
                or s.arg(3, "dtype") is not None
            ):
                return None
            if c.inplace and set(w.users) != {u, s.node}:
                return None  # an in-place divide whose input is read elsewhere
            self.take(u, s.node, *pattern)
            return u
        return None

    def scaling(self, w: Node) -> tuple[Node, float] | None:
        """w * constant as a user of w, or None."""
        for u in w.users:
            c = fx.is_call(u, "mul")
            if c is None or len(c.args) != 2 or c.kwargs:
                continue
            a, b = c.args
            scale = b if a is w else a if b is w and not c.inplace else None
            if isinstance(scale, bool) or not isinstance(scale, int | float):
                continue
            if c.inplace and set(w.users) != {u}:
                return None
            self.take(u)
            return u, float(scale)
        return None

    def counts(self, indices: list[Node], T: int, E: int, k: int) -> list[Node]:
        """Nodes computing tokens per expert from the indices."""
        found = []
        sources = list(indices)  # the indices, flattened to [T * k] and/or cast to float
        for node in sources:
            for u in node.users:
                c = fx.call(u)
                if c is None or u in sources or c.args[0] is not node:
                    continue
                flat = fx.is_reinterpret(c) and fx.shape(u) == (T * k,)
                if flat or (fx.cast_dtype(u) is not None and fx.shape(u) == fx.shape(node)):
                    sources.append(u)
        for src in sources:
            is_flat = fx.shape(src) == (T * k,)
            for u in src.users:
                c = fx.call(u)
                if c is None or (c.args[0] is not src and c.arg(2, "index") is not src):
                    continue
                if (
                    c.name == "bincount"
                    and is_flat
                    and c.arg(1, "weights") is None
                    and c.arg(2, "minlength", 0) == E
                    and fx.dtype(src) == torch.int64
                ):
                    found.append(self.counting(u, src, indices))
                elif (
                    c.name == "histc"
                    and c.arg(1, "bins", 100) == E
                    and c.arg(2, "min", 0) == 0
                    and c.arg(3, "max", 0) in (E, E - 1)
                ):
                    found.append(self.counting(u, src, indices))
                elif (
                    c.name in ("scatter_add", "index_add")
                    and is_flat
                    and self.ones_into_zeros(c, src, E)
                ):
                    found.append(self.counting(u, src, indices))
        return found

    def counting(self, node: Node, flat: Node, indices: list[Node]) -> Node:
        # The flattening / casting nodes between the indices and `flat`.
        n = flat
        while n not in indices:
            self.take(n)
            n = n.args[0]
        self.take(node)
        return node

    def ones_into_zeros(self, c: fx.Call, flat: Node, E: int) -> bool:
        zeros, ones = fx.call(c.args[0]), fx.call(c.arg(3, "source", c.kwargs.get("src")))
        ok = (
            c.arg(1, "dim") in (0, -1)
            and c.arg(2, "index") is flat
            and zeros is not None
            and fx.FILLS.get(zeros.name, None) == 0
            and fx.shape(zeros.node) == (E,)
            and ones is not None
            and fx.FILLS.get(ones.name, None) == 1
            and fx.shape(ones.node) == fx.shape(flat)
            and "alpha" not in c.kwargs
        )
        if ok and c.inplace and set(zeros.node.users) != {c.node}:
            return False
        if ok:
            self.take(zeros.node, ones.node)
        return ok


def _match(m: _Matcher, anchor: Node) -> _Router:
    """The router around `anchor`, read by `m` (whose nodes say how far it got on a Refuse)."""
    sel_final, k, indices, values = m.selection(anchor)
    shape = fx.shape(sel_final)
    if shape is None or len(shape) != 2 or not all(isinstance(d, int) for d in shape):
        raise Refuse(f"the top-k input {sel_final.name} is not a static [T, E] tensor ({shape})")
    T, E = shape
    if not indices:
        raise Refuse("its indices are not used")
    sel, groups = m.group_limit(sel_final, T, E)
    scores, bias = m.biased(sel, T, E)
    logits, score_func, pre_softmax = m.score_function(scores, T, E)
    values_are_scores = bias is None and not m.detached
    w0 = m.weights(scores, indices, values, values_are_scores)
    weights, normalize, route_scale = m.weight_chain(w0, post_softmax=not pre_softmax)
    counts = m.counts(indices, T, E, k)
    aux_seq_len, token_sums, seq_sums = m.aux_sums(anchor, logits, scores, score_func, pre_softmax)
    reuse = bias is None and groups.get("topk_groups", 1) >= groups.get("num_groups", 1)
    seq_len = aux_seq_len if seq_sums else 0
    plain_len, plain_token, plain_seq = m.plain_counts(anchor, scores, indices, k, reuse, seq_len)
    if plain_len:
        aux_seq_len = plain_len if plain_seq else (aux_seq_len or plain_len)
    lse, at = m.logsumexps(anchor, logits, bias)
    options = dict(
        score_func=score_func,
        pre_softmax=pre_softmax,
        num_groups=groups.get("num_groups", 1),
        topk_groups=groups.get("topk_groups", 1),
        normalize=normalize,
        route_scale=route_scale,
        group_score=groups.get("group_score", "top2"),
        aux_seq_len=aux_seq_len,
        return_lse=bool(lse),
        count_plain=bool(plain_len),
    )
    for node in (logits, bias):
        if node is not None and not isinstance(fx.val(node), FakeTensor):
            raise Refuse(
                f"{node.name} is a {type(fx.val(node)).__name__}, not a plain tensor (a DTensor "
                "under tensor or expert parallelism): the op is not wired for tensor subclasses"
            )
    try:  # the op's own checks, so that the rewrite cannot fail half-way
        moe_route_op.check_route_args(fx.val(logits), fx.val(bias), k, **options)
    except ValueError as e:
        raise Refuse(str(e)) from None
    if not moe_route_op.triton_supports(fx.val(logits), options["num_groups"]):
        raise Refuse(
            f"E={E} experts in {options['num_groups']} group(s) do not fit the kernel's tile "
            "(4096 experts, each group padded to a power of 2)"
        )
    if scores is logits:
        m.nodes.discard(logits)
    return _Router(
        anchor,
        logits,
        bias,
        k,
        options,
        indices,
        weights,
        counts,
        token_sums,
        seq_sums,
        lse,
        plain_token,
        plain_seq,
        at,
        m.nodes,
    )


def _rewrite(gm: torch.fx.GraphModule, r: _Router) -> tuple[Node, list[str]]:
    graph = gm.graph
    with graph.inserting_before(r.at):
        route = fx.emit(
            graph, "call_function", _OP, (r.logits, r.bias, r.top_k), r.options, like=r.anchor
        )
        parts = [
            fx.emit(graph, "call_function", operator.getitem, (route, i), like=r.anchor)
            for i in range(len(fx.val(route)))
        ]
    weights, indices, counts, aux_sums, lse, plain_counts = parts
    r.weights.replace_all_uses_with(weights)
    for node in r.indices:
        node.replace_all_uses_with(indices)
    for node in r.seq_sums:
        node.replace_all_uses_with(aux_sums)
    for node in r.token_sums:
        _replace(graph, node, torch.sum, (aux_sums, 0))
    for node in r.plain_seq:  # fp32, as the op's (the matcher checked)
        node.replace_all_uses_with(plain_counts)
    for node in r.plain_token:
        _replace(graph, node, torch.sum, (plain_counts, 0))
    for node in r.lse:
        if fx.shape(node) != fx.shape(lse):  # keepdim=True: [T, 1]
            _replace(graph, node, torch.unsqueeze, (lse, -1))
        else:
            node.replace_all_uses_with(lse)
    for node in r.counts:
        if fx.dtype(node) != torch.int64:
            _replace(graph, node, "to", (counts, fx.dtype(node)))
        else:
            node.replace_all_uses_with(counts)
    # Erase the sub-graph back to front; what is still used elsewhere stays.
    order = {n: i for i, n in enumerate(graph.nodes)}
    kept = []
    for node in sorted(r.nodes, key=order.__getitem__, reverse=True):
        if node.users:
            kept.append(node.name)
        else:
            graph.erase_node(node)
    return route, sorted(kept)


def _replace(graph: torch.fx.Graph, node: Node, target: Any, args: tuple) -> None:
    """The uses of `node` read target(*args) instead (a reduction or cast of an op output)."""
    op = "call_method" if isinstance(target, str) else "call_function"
    with graph.inserting_before(node):
        node.replace_all_uses_with(fx.emit(graph, op, target, args))


def _candidates(gm: torch.fx.GraphModule) -> list[Node]:
    """Top-k / descending sorts over a 2-D tensor."""
    return [
        n
        for n in gm.graph.nodes
        if (c := fx.is_call(n, "topk", "sort", "argsort"))
        and len(fx.shape(c.arg(0, "input")) or ()) == 2
    ]


@register_pass(
    "fuse_moe_router",
    stage="pre_grad",
    default_on=True,
    preserves_numerics=False,
)
def fuse_moe_router_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Replace the plain MoE router (scores, group limit, top-k, weights, counts) with
    graphtrain::moe_route."""
    anchors = _candidates(gm)
    if not anchors:
        ctx.note("no top-k over 2-D scores in this graph: no router to fuse")
        return gm
    # Last first: a router's expert top-k comes after its group top-k, which goes with it.
    # A top-k that an earlier attempt read as a router's group selection gets no note of its
    # own (that router's note says what happened), nor does one that a router took with it (the
    # balance losses' plain top-k, refused on its own as it feeds no weights); every other
    # refusal is noted.
    notes: list[tuple[int, Node | None, str]] = []
    erased: set[Node] = set()
    claimed: set[Node] = set()
    for position, anchor in reversed(list(enumerate(anchors))):
        if anchor in erased:
            continue
        m = _Matcher()
        try:
            r = _match(m, anchor)
            inputs = {r.logits} | ({r.bias} if r.bias is not None else set())
            fx.check_mutations(gm.graph, r.nodes, r.rewired, inputs, r.at)
        except Refuse as why:
            if anchor not in claimed:
                notes.append((position, anchor, f"left {anchor.name} unchanged: {why}"))
            claimed |= m.nodes
            continue
        claimed |= r.nodes
        route, kept = _rewrite(gm, r)
        erased |= {n for n in r.nodes if n.name not in kept}
        options = ", ".join(f"{k}={v!r}" for k, v in r.options.items())
        bias = r.bias.name if r.bias is not None else None
        notes.append(
            (
                position,
                None,
                f"replaced the router ending in {anchor.name} with {route.name} = "
                f"graphtrain.moe_route(logits={r.logits.name}, bias={bias}, top_k={r.top_k}, "
                f"{options}); counts from {len(r.counts)} node(s)"
                + (f"; kept (used elsewhere): {', '.join(kept)}" if kept else ""),
            )
        )
    for _, anchor, note in sorted(notes, key=lambda n: n[0]):
        if anchor is None or anchor not in erased:
            ctx.note(note)
    return fx.finish(gm, bool(erased))
