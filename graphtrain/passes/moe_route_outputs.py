"""How fuse_moe_router reads a router's outputs: from the expert top-k forward to the weights,
the tokens per expert, the aux losses' sums, the balance losses' plain counts and the z-loss's
logsumexps.

Not a pass: the second half of fuse_moe_router's matcher (moe_route_selection.py reads the
selection side). The spellings it reads are listed in docs/design/moe_route.md. Every method
that finds the graph is not what the op computes raises Refuse with the reason, or leaves the
node out (it then stays in the graph, applied to the op's outputs).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from graphtrain.custom_ops.moe_route import NORMALIZE_EPS
from graphtrain.passes import fx
from graphtrain.passes.fx import Refuse
from graphtrain.passes.moe_route_selection import SelectionMatcher


class OutputMatcher(SelectionMatcher):
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
                if eps != NORMALIZE_EPS:
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
