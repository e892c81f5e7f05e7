"""moe_route: the Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1 in the tests).

What
    _moe_route_fwd_kernel   one program per block of BLOCK_T tokens over a [BLOCK_T, G_PAD,
        EPG_PAD] register tile: scores, bias, group scores, the kept groups and the k best
        experts by iterative max + lowest index among the max; weights, indices, one int64
        atomic histogram add per expert; per-program partial sums of the aux probabilities,
        the logsumexp and the plain top-k histogram when asked
    _moe_route_bwd_kernel   one program per block of tokens over a [BLOCK_T, E_PAD] tile:
        d weights (and d aux_sums, d lse) -> d logits
    How and why (tile shapes, tie-break, no float atomics): docs/design/moe_route.md.

Numerics
    fp32 from the logits; ties to the lower expert/group index, as the reference. Integer
    atomics only: counts and sums are the same on every run.
"""

import triton
import triton.language as tl


@triton.jit
def _take_best(avail, sel, eid, E: tl.constexpr):
    """One step of the top-k over a [BLOCK_T, G_PAD, EPG_PAD] tile: each row's largest `sel`
    still available (the lowest expert id among equal maxima), and `avail` without it."""
    cand = tl.where(avail, sel, float("-inf"))
    best = tl.max(tl.max(cand, 2), 1)
    is_best = avail & (cand == best[:, None, None])
    pick = tl.min(tl.min(tl.where(is_best, eid, E), 2), 1)
    return pick, avail & (eid != pick[:, None, None])


@triton.jit
def _moe_route_fwd_kernel(
    logits_ptr,  # [T, E] fp32/bf16/fp16, row stride stride_t, unit column stride
    bias_ptr,  # [E] fp32 (not read without HAS_BIAS)
    weights_ptr,  # [T, K] fp32 out
    indices_ptr,  # [T, K] int64 out
    counts_ptr,  # [E] int64, zeroed by the caller; every program adds its histogram
    aux_ptr,  # [programs, E] fp32 out: each program's sum of p (not written without AUX)
    lse_ptr,  # [T] fp32 out: logsumexp of the logits (not written without LSE)
    plain_ptr,  # [programs, E] fp32 out: each program's plain top-k histogram (PLAIN > 0)
    T,
    SEQ_LEN,  # tokens per sequence: a program's rows stay in one (T without AUX)
    BLOCKS_PER_SEQ,
    stride_t,
    route_scale,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E: tl.constexpr,
    G: tl.constexpr,  # groups (1: no group limit)
    EPG: tl.constexpr,  # experts per tile row: E / G with groups
    G_PAD: tl.constexpr,  # tile rows, a power of 2
    EPG_PAD: tl.constexpr,  # tile columns, a power of 2 >= EPG
    TOPK_GROUPS: tl.constexpr,
    SCORE: tl.constexpr,  # 0 softmax before top-k, 1 softmax after top-k, 2 sigmoid
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    GROUP_MAX: tl.constexpr,  # group score = max instead of the top-2 sum
    AUX: tl.constexpr,  # write the partial sums of the aux probabilities
    LSE: tl.constexpr,  # write the logsumexp of each row
    PLAIN: tl.constexpr,  # plain top-k histogram: 0 none, 1 the dispatch's, 2 its own top-k
    BLOCK_T: tl.constexpr,
):
    # The experts as a [1, G_PAD, EPG_PAD] grid: row g, slot j is expert g * EPG + j.
    g = tl.arange(0, G_PAD)[None, :, None]
    j = tl.arange(0, EPG_PAD)[None, None, :]
    eid = g * EPG + j
    e_ok = (j < EPG) & (eid < E)
    # The same grid without the token axis, for the per-expert outputs.
    g2 = tl.arange(0, G_PAD)[:, None]
    j2 = tl.arange(0, EPG_PAD)[None, :]
    e2 = g2 * EPG + j2
    e2_ok = (j2 < EPG) & (e2 < E)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + eid, mask=e_ok, other=0.0)
    kcol = tl.arange(0, K_PAD)[None, :]
    k_ok = kcol < K
    gcol = tl.arange(0, G_PAD)[None, :]
    pid = tl.program_id(0)
    if AUX:
        in_seq = (pid % BLOCKS_PER_SEQ) * BLOCK_T + tl.arange(0, BLOCK_T)
        rows = (pid // BLOCKS_PER_SEQ) * SEQ_LEN + in_seq
        row_ok = (in_seq < SEQ_LEN) & (rows < T)
    else:  # the plain grid (the general one cost 14% on the H100 for sigmoid with groups)
        rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
    row_off = rows.to(tl.int64) * stride_t
    # Rows past T (or past their sequence) read zeros (finite arithmetic); nothing of theirs
    # is stored or counted.
    x = tl.load(
        logits_ptr + row_off[:, None, None] + eid,
        mask=row_ok[:, None, None] & e_ok,
        other=0.0,
    ).to(tl.float32)
    if SCORE == 0 or (SCORE == 1 and AUX) or LSE:
        m = tl.max(tl.max(tl.where(e_ok, x, float("-inf")), 2), 1)
        ex = tl.where(e_ok, tl.exp(x - m[:, None, None]), 0.0)
        s = tl.sum(tl.sum(ex, 2), 1)
        probs = ex / s[:, None, None]
    if LSE:
        tl.store(lse_ptr + rows, m + tl.log(s), mask=row_ok)
    if SCORE == 0:
        scores = probs
    elif SCORE == 2:
        scores = tl.sigmoid(x)
    else:
        scores = x
    if AUX:
        if SCORE == 2:
            s_ok = tl.where(e_ok, scores, 0.0)
            probs = s_ok / tl.sum(tl.sum(s_ok, 2), 1)[:, None, None]
        partial = tl.sum(tl.where(row_ok[:, None, None] & e_ok, probs, 0.0), 0)
        tl.store(aux_ptr + pid.to(tl.int64) * E + e2, partial, mask=e2_ok)
    if HAS_BIAS:
        sel = scores + bias
    else:
        sel = scores
    sel = tl.where(e_ok, sel, float("-inf"))

    if G > 1 and TOPK_GROUPS < G:
        top1 = tl.max(sel, 2)  # [BLOCK_T, G_PAD]
        if GROUP_MAX or EPG == 1:
            group_score = top1
        else:
            # Second best: the max without the first slot holding the best.
            first = tl.min(tl.where(sel == top1[:, :, None], j, EPG_PAD), 2)
            top2 = tl.max(tl.where(j == first[:, :, None], float("-inf"), sel), 2)
            group_score = top1 + top2
        g_avail = tl.broadcast_to(gcol < G, (BLOCK_T, G_PAD))
        keep = tl.broadcast_to(gcol < 0, (BLOCK_T, G_PAD))
        for _ in tl.static_range(TOPK_GROUPS):
            cand = tl.where(g_avail, group_score, float("-inf"))
            best = tl.max(cand, 1)
            pick = tl.min(tl.where(g_avail & (cand == best[:, None]), gcol, G_PAD), 1)
            hit = gcol == pick[:, None]
            keep = keep | hit
            g_avail = g_avail & (gcol != pick[:, None])
        sel = tl.where(keep[:, :, None], sel, float("-inf"))

    # Top-k by iterative max; among equal maxima the lowest expert id (the reference's
    # stable sort). `avail` (not a -inf marker) keeps a -inf sel choosable, as in the sort.
    avail = tl.broadcast_to(e_ok, (BLOCK_T, G_PAD, EPG_PAD))
    w = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    idx = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for i in tl.static_range(K):
        pick, avail = _take_best(avail, sel, eid, E)
        # The weight from the chosen logit itself: the tile's arithmetic, no reduction.
        logit = tl.load(logits_ptr + row_off + pick, mask=row_ok & (pick < E), other=0.0).to(
            tl.float32
        )
        if SCORE == 0:
            wi = tl.exp(logit - m) / s
        elif SCORE == 2:
            wi = tl.sigmoid(logit)
        else:
            wi = logit
        w = tl.where(kcol == i, wi[:, None], w)
        idx = tl.where(kcol == i, pick[:, None], idx)
    chosen = e_ok & ~avail & row_ok[:, None, None]
    hist = tl.sum(chosen.to(tl.int32), 0)  # [G_PAD, EPG_PAD]: this block's tokens per expert

    if SCORE == 1:
        wv = tl.where(k_ok, w, float("-inf"))
        we = tl.exp(wv - tl.max(wv, 1)[:, None])
        w = we / tl.sum(we, 1)[:, None]
    elif NORMALIZE:
        w = w / (tl.sum(tl.where(k_ok, w, 0.0), 1)[:, None] + 1e-20)
    w = w * route_scale
    out = rows.to(tl.int64)[:, None] * K + kcol
    out_ok = row_ok[:, None] & k_ok
    tl.store(weights_ptr + out, w, mask=out_ok)
    tl.store(indices_ptr + out, idx.to(tl.int64), mask=out_ok)

    tl.atomic_add(counts_ptr + e2, hist.to(tl.int64), mask=e2_ok)

    if PLAIN == 2:
        # The balance losses' top-k: the unbiased scores of every expert, same tie-break.
        plain_avail = tl.broadcast_to(e_ok, (BLOCK_T, G_PAD, EPG_PAD))
        plain_sel = tl.where(e_ok, scores, float("-inf"))
        for _ in tl.static_range(K):
            pick, plain_avail = _take_best(plain_avail, plain_sel, eid, E)
        plain = e_ok & ~plain_avail & row_ok[:, None, None]
        plain_hist = tl.sum(plain.to(tl.float32), 0)
        tl.store(plain_ptr + pid.to(tl.int64) * E + e2, plain_hist, mask=e2_ok)
    elif PLAIN == 1:
        tl.store(plain_ptr + pid.to(tl.int64) * E + e2, hist.to(tl.float32), mask=e2_ok)


@triton.jit
def _moe_route_bwd_kernel(
    grad_w_ptr,  # [T, K] d weights, contiguous
    grad_aux_ptr,  # [T / SEQ_LEN, E] d aux_sums, contiguous (not read without AUX)
    grad_lse_ptr,  # [T] d lse (not read without LSE)
    logits_ptr,  # [T, E], row stride stride_t, unit column stride
    indices_ptr,  # [T, K] int64, contiguous
    dlogits_ptr,  # [T, E] out (logits' dtype), contiguous
    T,
    E,
    SEQ_LEN,
    stride_t,
    route_scale,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    SCORE: tl.constexpr,
    NORMALIZE: tl.constexpr,
    AUX: tl.constexpr,
    LSE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    row_off = rows64 * stride_t
    cols = tl.arange(0, BLOCK_E)[None, :]
    c_ok = cols < E
    kcol = tl.arange(0, K_PAD)[None, :]
    k_in = kcol < K
    k_ok = row_ok[:, None] & k_in
    idx = tl.load(indices_ptr + rows64[:, None] * K + kcol, mask=k_ok, other=0)
    g = tl.load(grad_w_ptr + rows64[:, None] * K + kcol, mask=k_ok, other=0.0).to(tl.float32)
    g = g * route_scale
    picked = tl.load(logits_ptr + row_off[:, None] + idx, mask=k_ok, other=0.0).to(tl.float32)
    if SCORE == 0 or AUX or LSE:
        x = tl.load(
            logits_ptr + row_off[:, None] + cols, mask=row_ok[:, None] & c_ok, other=0.0
        ).to(tl.float32)
    if SCORE == 0 or (SCORE == 1 and AUX) or LSE:
        xm = tl.where(c_ok, x, float("-inf"))
        m = tl.max(xm, 1)[:, None]
        ex = tl.exp(xm - m)
        s = tl.sum(ex, 1)[:, None]
        p = ex / s  # softmax over all experts
    if AUX:
        seq = (rows // SEQ_LEN).to(tl.int64)
        g_aux = tl.load(
            grad_aux_ptr + seq[:, None] * E + cols, mask=row_ok[:, None] & c_ok, other=0.0
        ).to(tl.float32)
    if SCORE == 0:
        picked = tl.exp(picked - m) / s
    elif SCORE == 2:
        picked = tl.sigmoid(picked)
    # d weights -> d of the picked scores.
    # (Rows past T hold zeros: finite arithmetic, nothing stored.)
    if SCORE == 1:
        wv = tl.where(k_in, picked, float("-inf"))
        we = tl.exp(wv - tl.max(wv, 1)[:, None])
        w = we / tl.sum(we, 1)[:, None]
        d = w * (g - tl.sum(g * w, 1)[:, None])
    elif NORMALIZE:
        denom = tl.sum(tl.where(k_in, picked, 0.0), 1)[:, None] + 1e-20
        d = (g - tl.sum(tl.where(k_in, g * picked, 0.0), 1)[:, None] / denom) / denom
    else:
        d = g
    d = tl.where(k_in, d, 0.0)
    if SCORE == 2:
        d = d * picked * (1.0 - picked)
    # Scatter into the row: the k chosen experts are distinct.
    d_scores = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for i in tl.static_range(K):
        at = kcol == i
        col_i = tl.sum(tl.where(at, idx, 0), 1)
        d_i = tl.sum(tl.where(at, d, 0.0), 1)
        d_scores += tl.where(cols == col_i[:, None], d_i[:, None], 0.0)
    if SCORE == 0 and AUX:
        # softmax backward: p * (dP - sum_e p dP), dP = dS + d aux probabilities (= p).
        d_scores += g_aux
        d_scores = p * (d_scores - tl.sum(p * d_scores, 1)[:, None])
    elif SCORE == 0:
        # The same with dP = dS: the sum only over the k picked experts.
        d_scores = p * (d_scores - tl.sum(d * picked, 1)[:, None])
    elif SCORE == 1 and AUX:
        # The aux probabilities are softmax(logits), apart from the scores (the logits).
        d_scores += p * (g_aux - tl.sum(p * g_aux, 1)[:, None])
    elif AUX:
        # Sigmoid: p = s / sum(s), taken back through s to the logits.
        sg = tl.where(c_ok, tl.sigmoid(x), 0.0)
        total = tl.sum(sg, 1)[:, None]
        d_s = (g_aux - tl.sum(g_aux * sg, 1)[:, None] / total) / total
        d_scores += d_s * sg * (1.0 - sg)
    if LSE:  # d logsumexp(x) / dx = softmax(x)
        g_lse = tl.load(grad_lse_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        d_scores += g_lse[:, None] * p
    tl.store(
        dlogits_ptr + rows64[:, None] * E + cols,
        d_scores.to(dlogits_ptr.dtype.element_ty),
        mask=row_ok[:, None] & c_ok,
    )
