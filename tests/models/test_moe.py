import json
import math
import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import poisoned_model

import graphtrain.compile  # noqa: F401  (lets torch.compile trace fp32 grouped GEMMs)
import models.moe as moe
from graphtrain.metrics.flops import training_flops
from models import MODEL_PRESETS, build_model
from models.moe import GroupedExperts, MoEConfig, MoEGPT, Router, active_params, routed_experts

SMALL = MoEConfig(
    vocab_size=64,
    dim=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    ffn_dim=32,
    max_seq_len=32,
    num_experts=8,
    top_k=2,
    moe_ffn_dim=16,
    seq_aux_loss_coef=0.0,
)
DEBUG = MODEL_PRESETS["moe-debug"]


def make_router(cfg: MoEConfig, seed: int = 0) -> Router:
    torch.manual_seed(seed)
    router = Router(cfg)
    router.init_weights(0.5)  # large logits: well-separated scores
    return router


# ------------------------------------------------------------------------------------------
# Config, presets, construction


def test_config_errors_name_values():
    cases = [
        ({"top_k": 9}, "model.top_k=9 exceeds model.num_experts=8"),
        ({"num_groups": 3}, "model.num_experts=8 is not divisible by model.num_groups=3"),
        ({"num_groups": 4, "topk_groups": 5}, "model.topk_groups=5 exceeds model.num_groups=4"),
        (
            {"num_groups": 4, "topk_groups": 1, "top_k": 3},
            "model.top_k=3 exceeds the 1 kept groups of 2 experts",
        ),
        (
            {"score_func": "tanh"},
            "model.score_func must be one of ('softmax', 'sigmoid'), got 'tanh'",
        ),
        ({"moe_ffn_dim": 20}, "model.moe_ffn_dim=20 must be a multiple of 8"),
        ({"first_k_dense": 3}, "model.first_k_dense=3 leaves no MoE layer in model.num_layers=2"),
        ({"first_k_dense": 2}, "model.first_k_dense=2 leaves no MoE layer in model.num_layers=2"),
        ({"z_loss_coef": -1.0}, "model.z_loss_coef must be >= 0 (0 turns it off), got -1.0"),
        ({"route_scale": 0.0}, "model.route_scale must be > 0, got 0.0"),
        ({"num_experts": 0}, "model.num_experts must be >= 1, got 0"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            replace(SMALL, **change)
    with pytest.raises(ValueError, match=re.escape("model.num_layers must be >= 1, got 0")):
        replace(SMALL, num_layers=0)  # the dense checks run too


def test_presets_and_parameter_names():
    counts = {}
    for name in ("moe-debug", "moe-tiny", "moe-1b"):
        with torch.device("meta"):
            model = build_model(MODEL_PRESETS[name])
        assert isinstance(model, MoEGPT)
        counts[name] = sum(p.numel() for p in model.parameters())
    assert counts == {"moe-debug": 245_184, "moe-tiny": 10_887_424, "moe-1b": 1_046_041_600}
    assert MODEL_PRESETS["moe-tiny"].vocab_size == MODEL_PRESETS["tiny"].vocab_size
    cfg = MODEL_PRESETS["moe-1b"]
    assert (cfg.num_experts, cfg.top_k, cfg.num_shared_experts) == (64, 6, 2)

    model = poisoned_model(DEBUG)
    keys = set(model.state_dict())
    assert "layers.0.feed_forward.w1.weight" in keys  # first_k_dense=1: a dense block
    assert {
        "layers.1.moe.router.gate.weight",
        "layers.1.moe.router.expert_bias",
        "layers.1.moe.experts.w1",
        "layers.1.moe.experts.w2",
        "layers.1.moe.experts.w3",
        "layers.1.moe.shared_experts.w1.weight",
    } <= keys
    assert not any(k.endswith(("step_counts", "aux_loss_scale")) for k in keys)  # not saved
    assert [name for name, _ in model.routers()] == ["layers.1", "layers.2"]


def test_every_parameter_and_buffer_is_initialized_and_seeded():
    a, b, c = (
        poisoned_model(DEBUG, seed=1),
        poisoned_model(DEBUG, seed=1),
        poisoned_model(DEBUG, seed=2),
    )
    for name, t in [*a.named_parameters(), *a.named_buffers()]:
        assert torch.isfinite(t).all(), f"{name} not initialized"
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), n
        if pa.ndim > 1:
            assert not torch.equal(pa, pc), n
    for _, router in a.routers():
        assert not router.expert_bias.any() and not router.step_counts.any()
        assert router.aux_loss_scale.item() == 1.0


def test_active_params_counts_the_weights_a_token_meets():
    model = poisoned_model(DEBUG)
    cfg = DEBUG
    total = 0
    for name, p in model.named_parameters():
        if name == "tok_embeddings.weight" or p.ndim == 1:
            continue  # a lookup and the norms: no matmul
        share = cfg.top_k / cfg.num_experts if ".moe.experts." in name else 1
        total += p.numel() * share
    assert active_params(cfg) == total
    # MoE layers of one routed expert as wide as the dense FFN, no shared expert: a token meets
    # the dense model's weights plus a router gate of dim x 1 per MoE layer, so 6 * active_params
    # per token is the dense model's training FLOPs plus those gates'.
    dense = replace(
        cfg,
        num_experts=1,
        top_k=1,
        num_shared_experts=0,
        moe_ffn_dim=cfg.ffn_dim,
        num_groups=1,
        topk_groups=1,
    )
    gates = (cfg.num_layers - cfg.first_k_dense) * cfg.dim
    assert gates > 0
    flops = training_flops(
        dim=cfg.dim,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        ffn_dim=cfg.ffn_dim,
        vocab_size=cfg.vocab_size,
        num_tokens=100,
        num_attention_pairs=0,
    )
    assert flops == 6 * (active_params(dense) - gates) * 100


# ------------------------------------------------------------------------------------------
# Router against a float64 recomputation


def route_ref(cfg: MoEConfig, logits: torch.Tensor, bias: torch.Tensor | None, B: int):
    """Per token, in float64, with Python sorts (ties: lower index). Returns weights, indices,
    counts and the auxiliary losses, whose counts are DeepSeek-V3's f_i: each token's top-k of
    its scores, without the bias and the group limit."""
    logits = logits.double()
    T, E = logits.shape
    k, L = cfg.top_k, T // B
    if cfg.score_func == "sigmoid":
        scores = logits.sigmoid()
    elif cfg.pre_softmax:
        scores = logits.softmax(-1)
    else:
        scores = logits
    sel = scores + (bias.double() if bias is not None else 0.0)
    weights, indices, plain = [], [], []
    for t in range(T):
        plain.append(sorted(range(E), key=lambda e: (-scores[t, e].item(), e))[:k])
        s = sel[t].tolist()
        allowed = list(range(E))
        if cfg.num_groups > 1:
            n = E // cfg.num_groups
            top2 = [
                sum(sorted(s[g * n : (g + 1) * n], reverse=True)[:2]) for g in range(cfg.num_groups)
            ]
            kept = sorted(range(cfg.num_groups), key=lambda g: (-top2[g], g))[: cfg.topk_groups]
            allowed = [e for e in range(E) if e // n in kept]
        chosen = sorted(allowed, key=lambda e: (-s[e], e))[:k]
        w = scores[t, chosen]
        if cfg.score_func == "softmax" and not cfg.pre_softmax:
            w = w.softmax(0)
        elif cfg.normalize_weights:
            w = w / w.sum()
        weights.append(w * cfg.route_scale)
        indices.append(chosen)
    weights, indices = torch.stack(weights), torch.tensor(indices)
    counts = torch.bincount(indices.flatten(), minlength=E)
    plain = torch.tensor(plain)
    plain_counts = torch.bincount(plain.flatten(), minlength=E)
    if cfg.score_func == "sigmoid":
        p = scores / scores.sum(-1, keepdim=True)
    else:
        p = logits.softmax(-1)
    aux = {}
    if cfg.aux_loss_coef:
        aux["aux"] = cfg.aux_loss_coef * E / (k * T * T) * (p.sum(0) * plain_counts).sum()
    if cfg.seq_aux_loss_coef:
        per_seq = []
        for b in range(B):
            c = torch.bincount(plain[b * L : (b + 1) * L].flatten(), minlength=E)
            per_seq.append(E / (k * L * L) * (p[b * L : (b + 1) * L].sum(0) * c).sum())
        aux["seq_aux"] = cfg.seq_aux_loss_coef * torch.stack(per_seq).mean()
    if cfg.global_aux_loss_coef:  # one micro-batch, one rank
        aux["global_aux"] = (
            cfg.global_aux_loss_coef * E / (k * T * T) * (p.sum(0) * plain_counts).sum()
        )
    if cfg.z_loss_coef:
        aux["z"] = cfg.z_loss_coef * (torch.logsumexp(logits, -1) ** 2).mean()
    return weights, indices, counts, aux


ALL_AUX = {
    "aux_loss_coef": 0.1,
    "seq_aux_loss_coef": 0.2,
    "global_aux_loss_coef": 0.3,
    "z_loss_coef": 0.01,
}
ROUTER_CASES = {
    "softmax-pre": dict(score_func="softmax", expert_bias=False, normalize_weights=False),
    "softmax-pre-normalized-scaled": dict(
        score_func="softmax", expert_bias=False, top_k=3, route_scale=2.0
    ),
    "softmax-post": dict(score_func="softmax", pre_softmax=False, expert_bias=False),
    "softmax-bias-groups-of-one": dict(score_func="softmax", num_groups=8, topk_groups=3),
    "sigmoid": dict(score_func="sigmoid", expert_bias=False, normalize_weights=False),
    "sigmoid-bias-groups-normalized-scaled": dict(
        score_func="sigmoid", num_groups=4, topk_groups=2, top_k=3, route_scale=2.5
    ),
}


@pytest.mark.parametrize("case", ROUTER_CASES)
def test_router_matches_float64_reference(case):
    cfg = replace(SMALL, **ROUTER_CASES[case], **ALL_AUX)
    router = make_router(cfg)
    if router.expert_bias is not None:
        router.expert_bias.copy_(torch.linspace(-0.3, 0.3, cfg.num_experts))
    x = torch.randn(3, 8, cfg.dim)
    weights, indices, counts, total = router(x)
    ref_w, ref_i, ref_c, ref_aux = route_ref(
        cfg, router.gate(x.flatten(0, 1)), router.expert_bias, B=3
    )
    assert torch.equal(indices, ref_i)
    assert torch.equal(counts, ref_c)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.double(), ref_w, rtol=1e-5, atol=1e-6)
    assert router.last_aux.keys() == ref_aux.keys() == {"aux", "seq_aux", "global_aux", "z"}
    for name, value in ref_aux.items():
        torch.testing.assert_close(router.last_aux[name].double(), value, rtol=1e-5, atol=0)
    torch.testing.assert_close(total, sum(router.last_aux.values()))
    torch.testing.assert_close(router.last_counts, counts.float())


@pytest.mark.parametrize(
    "case", ["softmax-bias-groups-of-one", "sigmoid-bias-groups-normalized-scaled"]
)
def test_balance_losses_count_the_plain_top_k(case):
    """A bias that sends every token to experts 0 and 1 (a balanced dispatch would do the same:
    the bias no longer follows the scores) leaves the aux, seq_aux and global_aux losses and
    their gate gradient those of the plain top-k of the scores (DeepSeek-V3's f_i, Megatron's
    aux routing map), checked against float64 autograd; counted over the dispatch they differ."""
    cfg = replace(SMALL, **ROUTER_CASES[case], **ALL_AUX)
    router = make_router(cfg)
    router.expert_bias.copy_(torch.tensor([50.0, 50.0] + [0.0] * (cfg.num_experts - 2)))
    x = torch.randn(3, 8, cfg.dim)
    _, indices, counts, total = router(x)
    assert ((indices == 0).any(-1) & (indices == 1).any(-1)).all()  # the biased dispatch
    (grad,) = torch.autograd.grad(total, router.gate.weight)
    w64 = router.gate.weight.detach().double().requires_grad_(True)
    _, _, _, ref_aux = route_ref(cfg, x.flatten(0, 1).double() @ w64.T, router.expert_bias, B=3)
    for name, value in ref_aux.items():
        torch.testing.assert_close(router.last_aux[name].double(), value, rtol=1e-5, atol=0)
    (ref_grad,) = torch.autograd.grad(sum(ref_aux.values()), w64)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-7)
    # The same losses over the dispatch counts are other numbers: the test tells them apart.
    logits = router.gate(x.flatten(0, 1)).double()
    scores = logits.sigmoid() if cfg.score_func == "sigmoid" else logits.softmax(-1)
    p = scores / scores.sum(-1, keepdim=True)
    E, T, k = cfg.num_experts, 24, cfg.top_k
    dispatch_aux = cfg.aux_loss_coef * E / (k * T * T) * (p.sum(0) * counts).sum()
    assert not torch.isclose(dispatch_aux, ref_aux["aux"], rtol=1e-4)  # checked above to 1e-5


@pytest.mark.parametrize("case", ROUTER_CASES)
def test_router_ties_go_to_the_lower_index(case):
    cfg = replace(SMALL, **ROUTER_CASES[case])
    router = make_router(cfg)
    with torch.no_grad():  # experts 1, 4 and 6 share a gate row: exactly equal scores
        router.gate.weight[4] = router.gate.weight[1]
        router.gate.weight[6] = router.gate.weight[1]
    x = torch.randn(4, 8, cfg.dim)
    x[0] = 0  # every logit 0: all experts and all groups tie
    _, indices, _, _ = router(x)
    _, ref_i, _, _ = route_ref(cfg, router.gate(x.flatten(0, 1)), router.expert_bias, B=4)
    assert torch.equal(indices, ref_i)
    assert indices[0].tolist() == list(range(cfg.top_k))


def test_bias_changes_selection_never_weights():
    cfg = replace(SMALL, score_func="sigmoid", normalize_weights=False, expert_bias=True)
    router = make_router(cfg)
    x = torch.randn(2, 8, cfg.dim)
    _, i0, _, _ = router(x)
    router.expert_bias[5] = 10.0  # every token now picks expert 5
    w1, i1, _, _ = router(x)
    assert (i1 == 5).any(-1).all() and not torch.equal(i0, i1)
    scores = torch.sigmoid(router.gate(x.flatten(0, 1)).float())
    torch.testing.assert_close(w1, scores.gather(1, i1), rtol=0, atol=0)
    assert w1.max() < 1.0  # the +10 is not in the weights


def test_router_buffers_stay_fp32_under_bf16_casts():
    model = poisoned_model(DEBUG)
    _, router = model.routers()[0]
    bias = torch.linspace(-1e-3, 1e-3, DEBUG.num_experts) + 1.0  # not representable in bf16
    router.expert_bias.copy_(bias)
    router.step_counts.fill_(257.0)
    model.bfloat16()
    assert router.gate.weight.dtype == torch.bfloat16
    for buf in (router.expert_bias, router.step_counts, router.aux_loss_scale):
        assert buf.dtype == torch.float32
    assert torch.equal(router.expert_bias, bias) and (router.step_counts == 257).all()
    model.to(torch.float16)
    assert torch.equal(router.expert_bias, bias)
    assert model.state_dict()["layers.1.moe.router.expert_bias"].dtype == torch.float32


def test_update_bias_moves_towards_balance_and_resets_counts():
    router = make_router(replace(SMALL, expert_bias=True))
    router.step_counts.copy_(torch.tensor([10.0, 0, 4, 4, 4, 4, 4, 2]))  # mean 4
    router.update_bias(0.01)
    expected = 0.01 * torch.tensor([-1.0, 1, 0, 0, 0, 0, 0, 1])
    assert torch.equal(router.expert_bias, expected)
    assert not router.step_counts.any()
    # The accumulated counts of a step; rate 0 and a bias-free router only reset.
    x = torch.randn(2, 8, SMALL.dim)
    router(x)
    router.accumulate_counts()
    router(x)
    router.accumulate_counts()
    assert torch.equal(router.step_counts, 2 * router.last_counts)
    router.update_bias(0.0)
    assert torch.equal(router.expert_bias, expected) and not router.step_counts.any()
    plain = make_router(replace(SMALL, expert_bias=False))
    plain.step_counts.fill_(3.0)
    plain.update_bias(0.01)
    assert plain.expert_bias is None and not plain.step_counts.any()


def test_global_aux_over_micro_batches_and_ranks():
    cfg = replace(SMALL, aux_loss_coef=0.5, global_aux_loss_coef=0.5)
    router = make_router(cfg)
    x1, x2 = torch.randn(2, 8, cfg.dim), torch.randn(3, 8, cfg.dim)
    router(x1)
    torch.testing.assert_close(router.last_aux["global_aux"], router.last_aux["aux"])
    router.accumulate_counts()
    counts1 = router.last_counts.clone()

    # A second micro-batch; a reducer standing for 2 ranks that saw the same counts.
    router.reduce_counts = lambda c: 2 * c
    _, _, counts2, _ = router(x2)
    assert torch.equal(router.last_counts, 2 * counts2.float())
    logits = router.gate(x2.flatten(0, 1)).double()
    s = logits.sigmoid()
    p = s / s.sum(-1, keepdim=True)
    gcounts = counts1.double() + 2 * counts2.double()
    E, k, T = cfg.num_experts, cfg.top_k, 24
    expected = 0.5 * E / (k * T * (gcounts.sum() / k)) * (p.sum(0) * gcounts).sum()
    torch.testing.assert_close(router.last_aux["global_aux"].double(), expected, rtol=1e-5, atol=0)
    assert not torch.allclose(router.last_aux["global_aux"], router.last_aux["aux"])


# ------------------------------------------------------------------------------------------
# Auxiliary loss gradients


@pytest.mark.parametrize(
    "coef", ["aux_loss_coef", "seq_aux_loss_coef", "global_aux_loss_coef", "z_loss_coef"]
)
def test_injected_aux_gradient_equals_explicit_loss(coef, monkeypatch):
    off = dict.fromkeys(
        ("aux_loss_coef", "seq_aux_loss_coef", "global_aux_loss_coef", "z_loss_coef"), 0.0
    )
    cfg = replace(DEBUG, **{**off, coef: 0.5})
    model = poisoned_model(cfg)
    model.set_aux_loss_scale(0.25)
    x = torch.randint(0, cfg.vocab_size, (2, 12))
    y = torch.randint(0, cfg.vocab_size, (2, 12))
    loss = model(x, y)
    loss.backward()
    injected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    recorded = []

    def explicit(out, aux, scale):
        recorded.append(aux)
        return out

    monkeypatch.setattr(moe.AuxLossInjector, "apply", explicit)
    plain = model(x, y)
    assert torch.equal(plain, loss)  # the returned loss is the plain cross-entropy
    assert len(recorded) == 2
    (plain + 0.25 * sum(recorded)).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(injected[name], p.grad, rtol=1e-5, atol=1e-8, msg=name)
    # The aux loss did reach the gate: without it the gate gradient differs.
    gate = "layers.1.moe.router.gate.weight"
    model.zero_grad()
    plain = model(x, y)
    plain.backward()
    assert not torch.allclose(injected[gate], model.get_parameter(gate).grad)


# ------------------------------------------------------------------------------------------
# Experts


def experts_ref(experts: GroupedExperts, x, weights, indices):
    """A loop over experts, each on the tokens routed to it."""
    out = torch.zeros_like(x)
    for e in range(experts.w1.shape[0]):
        token, slot = (indices == e).nonzero(as_tuple=True)
        h = F.silu(x[token] @ experts.w1[e].T) * (x[token] @ experts.w3[e].T)
        out = out.index_add(0, token, (h @ experts.w2[e].T) * weights[token, slot, None])
    return out


def test_grouped_experts_match_a_loop_with_empty_experts():
    torch.manual_seed(0)
    E, T, k, D, Fd = 6, 20, 2, 16, 24
    experts = GroupedExperts(E, D, Fd)
    experts.init_weights(0.2, 0.1)
    used = torch.tensor([0, 1, 3, 4])  # experts 2 and 5 get no token
    indices = torch.stack([used[torch.randperm(4)[:k]] for _ in range(T)])
    counts = torch.bincount(indices.flatten(), minlength=E)
    assert counts[2] == counts[5] == 0
    x = torch.randn(T, D, requires_grad=True)
    weights = torch.rand(T, k, requires_grad=True)
    out = routed_experts(experts, x, weights, indices, counts)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = [t.grad.clone() for t in (x, weights, experts.w1, experts.w2, experts.w3)]
    for t in (x, weights, experts.w1, experts.w2, experts.w3):
        t.grad = None
    ref = experts_ref(experts, x, weights, indices)
    ref.backward(grad)
    torch.testing.assert_close(out, ref)
    for name, g, t in zip(
        ("x", "weights", "w1", "w2", "w3"),
        got,
        (x, weights, experts.w1, experts.w2, experts.w3),
        strict=True,
    ):
        torch.testing.assert_close(g, t.grad, msg=name)
    assert not got[2][[2, 5]].any()  # no token, no gradient


def test_moe_under_bf16_autocast_is_close_to_fp32():
    model = poisoned_model(DEBUG)
    x = torch.randint(0, DEBUG.vocab_size, (2, 16))
    y = torch.randint(0, DEBUG.vocab_size, (2, 16))
    ref = model(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, y)
    loss.backward()
    assert abs(loss.item() - ref.item()) < 0.02
    assert torch.isfinite(model.layers["1"].moe.experts.w1.grad).all()


def test_force_balance_routes_uniformly_with_gradient_to_the_gate():
    cfg = replace(SMALL, force_balance=True)
    router = make_router(cfg)
    # Tokens all alike: the gate alone would send every one to the same two experts.
    x = torch.randn(cfg.dim).expand(16, 128, cfg.dim)
    weights, _, counts, _ = router(x)
    expected = x.shape[0] * x.shape[1] * cfg.top_k / cfg.num_experts  # 512 per expert
    assert (counts - expected).abs().max() < 0.15 * expected
    (weights * torch.arange(cfg.top_k)).sum().backward()
    assert router.gate.weight.grad.abs().sum() > 0
    router.eval()  # evaluation routes by the gate again
    assert router(x)[2].max() == x.shape[0] * x.shape[1]


# ------------------------------------------------------------------------------------------
# Training and compile


def test_moe_debug_trains_on_random_tokens():
    model = poisoned_model(DEBUG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    x = torch.randint(0, DEBUG.vocab_size, (4, 32))
    y = torch.roll(x, -1, dims=1)
    losses = []
    for _ in range(12):
        model.set_aux_loss_scale(1.0)
        loss = model(x, y)
        loss.backward()
        for _, router in model.routers():
            router.accumulate_counts()
        opt.step()
        opt.zero_grad()
        for _, router in model.routers():
            router.update_bias(DEBUG.bias_update_rate)
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(DEBUG.vocab_size), abs=1.0)
    assert losses[-1] < losses[0] - 1.0
    assert any(router.expert_bias.any() for _, router in model.routers())


def test_compiled_loss_equals_eager():
    eager = poisoned_model(DEBUG)
    compiled = poisoned_model(DEBUG)
    x = torch.randint(0, DEBUG.vocab_size, (2, 16))
    y = torch.randint(0, DEBUG.vocab_size, (2, 16))
    loss = eager(x, y)
    loss.backward()
    step = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    closs = step(x, y)
    closs.backward()
    assert torch.equal(closs, loss)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-9, msg=name)
    for (_, r), (_, rc) in zip(eager.routers(), compiled.routers(), strict=True):
        assert torch.equal(r.last_counts, rc.last_counts)
        assert r.last_aux.keys() == rc.last_aux.keys()


def test_non_finite_router_logits_are_counted_per_layer(tmp_path):
    """A NaN in one router's gate: that layer counts every token as non-finitely routed, the
    layer before it none; eager and compiled per block through graphtrain's backend (each
    router fused into moe_route) alike, and the count is an int64 device tensor (no host sync
    in the forward)."""
    from graphtrain.compile import apply_compile

    x = torch.randint(0, DEBUG.vocab_size, (2, 16))
    y = torch.randint(0, DEBUG.vocab_size, (2, 16))
    for compiled in (False, True):
        model = poisoned_model(DEBUG)
        (first, _), (name, router) = model.routers()
        with torch.no_grad():
            router.gate.weight[3, 5] = float("nan")  # expert 3's logit is NaN for every token
        if compiled:
            torch._dynamo.reset()  # compile here (and dump), not reuse an earlier test's code
            apply_compile(model, inner="aot_eager", dump_dir=tmp_path)
        assert model(x, y).isnan()
        counts = {n: r.last_nonfinite for n, r in model.routers()}
        assert all(isinstance(c, torch.Tensor) and c.dtype == torch.int64 for c in counts.values())
        assert {n: int(c) for n, c in counts.items()} == {first: 0, name: x.numel()}, compiled
    # Both MoE blocks run the one graph compiled for the first: the router fused once in it.
    fused = [json.loads(s.read_text())[-1]["op_counts"] for s in tmp_path.glob("*/summary.json")]
    assert [
        ops["graphtrain.moe_route.default"]
        for ops in fused
        if "graphtrain.moe_route.default" in ops
    ] == [1]
