"""graphtrain.balance on one process: counts and aux losses gathered around micro-batches, the
expert-bias update as an optimizer step pre-hook, statistics for the step's log line."""

import torch

from graphtrain.balance import install_router_balance
from graphtrain.parallel import ParallelDims
from models import MODEL_PRESETS, build_model

CFG = MODEL_PRESETS["moe-debug"]
RATE = 0.01


def setup():
    torch.manual_seed(0)
    model = build_model(CFG)
    model.init_weights(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    balance = install_router_balance(
        model, optimizer, None, ParallelDims(world_size=1), bias_update_rate=RATE
    )
    return model, optimizer, balance


def tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (2, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def test_bias_moves_in_the_optimizer_step_pre_hook():
    model, optimizer, balance = setup()
    routers = [router for _, router in model.routers()]
    counts = [torch.zeros(CFG.num_experts) for _ in routers]
    plain = [torch.zeros(CFG.num_experts) for _ in routers]  # global_aux's plain top-k counts
    aux = {}
    for seed, weight in ((1, 0.25), (2, 0.75)):
        with balance.micro_batch(weight):
            assert all(r.aux_loss_scale.item() == weight for r in routers)
            loss = model(*tokens(seed))
            (loss * weight).backward()
        for c, pc, r in zip(counts, plain, routers, strict=True):
            c += r.last_counts
            pc += r.last_plain_counts
            for name, value in r.last_aux.items():
                aux[name] = aux.get(name, 0.0) + value * weight
    assert all(torch.equal(r.step_counts, c) for r, c in zip(routers, counts, strict=True))
    assert all(torch.equal(r.step_plain_counts, c) for r, c in zip(routers, plain, strict=True))
    # Every token counts k experts either way; the bias and the group limit move which.
    assert all(c.sum() == 2 * 2 * 16 * CFG.top_k for c in plain)
    bias_before = [r.expert_bias.clone() for r in routers]

    optimizer.step()  # the pre-hook: statistics, then the bias update

    stats = balance.statistics()
    for (name, r), c, b in zip(model.routers(), counts, bias_before, strict=True):
        assert torch.equal(r.expert_bias, b + RATE * torch.sign(c.mean() - c))
        assert not r.step_counts.any() and not r.step_plain_counts.any()
        assert torch.equal(
            stats[f"moe/{name}/load_max_over_mean"], c.max() / c.mean().clamp(min=1e-9)
        )
        assert torch.equal(stats[f"moe/{name}/bias_absmax"], b.abs().max())
    assert aux.keys() == {"aux", "seq_aux", "global_aux", "z"}
    for name, value in aux.items():
        assert torch.equal(stats[f"moe/{name}_loss"], value)


def test_a_step_without_micro_batches_changes_nothing():
    """DCP's optimizer-state initialisation runs optimizer.step() before any training."""
    model, optimizer, balance = setup()
    with torch.no_grad():
        for _, r in model.routers():
            r.expert_bias.copy_(torch.linspace(-1, 1, CFG.num_experts))
    before = [r.expert_bias.clone() for _, r in model.routers()]
    optimizer.step()
    assert all(
        torch.equal(r.expert_bias, b) for (_, r), b in zip(model.routers(), before, strict=True)
    )
    assert balance.statistics() == {}


def test_dense_models_get_no_balance():
    model = build_model(MODEL_PRESETS["debug"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    dims = ParallelDims(world_size=1)
    assert install_router_balance(model, optimizer, None, dims, bias_update_rate=RATE) is None


def test_non_finite_router_tokens_are_a_running_total_across_steps():
    # A NaN routed at a step between two log steps must still be there at the next log step
    # (the trainer stops on any count): the per-layer count keeps adding up over the steps.
    model, optimizer, balance = setup()
    (first, _), (name, router) = model.routers()
    x, y = tokens(1)
    for step in range(3):
        if step == 1:  # only this step routes a NaN logit (expert 3, every token)
            with torch.no_grad():
                router.gate.weight[3, 5] = float("nan")
        with balance.micro_batch(1.0):
            model(x, y)
        if step == 1:
            with torch.no_grad():
                router.gate.weight[3, 5] = 0.0
        optimizer.step()
        stats = balance.statistics()
        want = 0 if step == 0 else x.numel()
        assert stats[f"moe/{name}/nonfinite_router_tokens"].item() == want, step
        assert stats[f"moe/{first}/nonfinite_router_tokens"].item() == 0
