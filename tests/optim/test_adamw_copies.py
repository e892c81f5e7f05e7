"""AdamWCopies: torch.optim.AdamW's steps bit for bit on CPU (its kernel there is torch's foreach
ops), the working copies written by the step, state dicts that resume across a switch from and to
torch's AdamW, bf16 moments as AdamWBF16, refusals, and build_optimizer's choice."""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from graphtrain.optim import (
    AdamWBF16,
    AdamWCopies,
    WorkingWeights,
    build_optimizer,
    clip_grad_norm_,
    describe_optimizer,
)
from graphtrain.optim.optimizer import _choose_implementation

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def _params(strided=True):
    """The last one strided (a transposed view), where asked: AdamWCopies gives it torch's
    foreach ops, not the kernel. (torch 2.13's fused CPU AdamW updates such a parameter wrongly:
    0.08 away from its foreach AdamW after 6 steps here; the fused tests leave it contiguous.)"""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen) for shape in ((37, 19), (19,), (3, 5))]
    return [nn.Parameter(p) for p in params[:2]] + [
        nn.Parameter(params[2].t() if strided else params[2].t().contiguous())
    ]


def _groups(params):
    return [
        {"params": params[:1] + params[2:], "weight_decay": 0.1},
        {"params": params[1:2], "weight_decay": 0.0},
    ]


def _torch(params, **kw):
    return torch.optim.AdamW(_groups(params), **HYPER, weight_decay=0.1, **kw)


def _copies(params, state_dtype=torch.float32):
    return AdamWCopies(_groups(params), **HYPER, weight_decay=0.1, state_dtype=state_dtype)


def _train(opt, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_steps_equal_torch_adamw_bitwise():
    ref, got = _params(), _params()
    _train(_torch(ref, foreach=True), ref, 4, seed=1)
    _train(_copies(got), got, 4, seed=1)
    assert _same(ref, got)


def test_clipping_in_the_step_equals_clipping_then_torch_adamw_bitwise():
    """clip_grad_norm_(scale=opt.scale_grads_in_step), as TrainStep calls it: the same norm, the
    gradients left as they were, and after the steps the parameters of torch's AdamW on
    gradients clipped in place; a step without a new coefficient does not reuse the last one."""
    ref, got = _params(), _params()
    ref_opt, opt = _torch(ref, foreach=True), _copies(got)
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        for p, q in zip(ref, got, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        max_norm = 1.0 if step < 3 else 0.0  # step 3: no clipping, no coefficient
        ref_norm = clip_grad_norm_(ref, max_norm)
        norm = clip_grad_norm_(got, max_norm, scale=opt.scale_grads_in_step)
        assert torch.equal(norm, ref_norm) and (step == 3 or ref_norm > 1.5)  # it did clip
        assert step == 3 or not _same([p.grad for p in ref], [q.grad for q in got])
        ref_opt.step()
        opt.step()
        assert _same(ref, got), step


def test_bf16_moments_equal_adamw_bf16():
    """The same maths as AdamWBF16 (moments widened, updated in fp32, stored rounded). AdamWBF16
    orders the last operations differently from torch's foreach ones (observed: 10 of 737
    parameters a few fp32 ulps apart): parameters within fp32 rounding, moments bitwise."""
    ref, got = _params(), _params()
    ref_opt = AdamWBF16(_groups(ref), **HYPER, weight_decay=0.1)
    opt = _copies(got, torch.bfloat16)
    _train(ref_opt, ref, 3, seed=2)
    _train(opt, got, 3, seed=2)
    for p, q in zip(ref, got, strict=True):
        torch.testing.assert_close(q, p, rtol=2**-19, atol=1e-2 * 2**-19)
        assert torch.equal(ref_opt.state[p]["exp_avg"], opt.state[q]["exp_avg"])
        assert opt.state[q]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(ref_opt.state[p]["exp_avg_sq"], opt.state[q]["exp_avg_sq"])


def test_step_writes_attached_copies():
    params = _params()
    opt = _copies(params)
    copies = [nn.Parameter(p.detach().to(torch.bfloat16)) for p in params[:2]]
    opt.attach_working_copies(params[:2], copies)
    params[1].grad = torch.randn(params[1].shape)  # params[0] has no gradient: skipped, unchanged
    before, copy_before = params[0].detach().clone(), copies[1].detach().clone()
    opt.step()
    assert torch.equal(params[0], before)
    assert not torch.equal(copies[1], copy_before)  # the step moved it
    assert torch.equal(copies[1], params[1].detach().to(torch.bfloat16))
    _train(opt, params, 2, seed=3)
    assert _same(copies, [p.detach().to(torch.bfloat16) for p in params[:2]])
    with pytest.raises(ValueError, match="not among the optimizer's params"):
        opt.attach_working_copies([nn.Parameter(torch.zeros(2))], [torch.zeros(2)])


def test_working_weights_hand_the_refresh_to_the_step():
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))
    masters = [model[0].weight, model[1].weight]
    opt = build_optimizer(
        model, **HYPER, weight_decay=0.1, no_decay_patterns=[], implementation="graphtrain"
    )
    weights = WorkingWeights(model, masters, torch.bfloat16)
    weights.refresh_in(opt)
    with weights.installed(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(5, 6)).float().square().sum().backward()
    opt.step()
    with torch.no_grad():
        model[1].weight.add_(1.0)  # a change outside the step: refresh() no longer copies it
    weights.refresh()
    assert torch.equal(weights.copies[0], masters[0].detach().to(torch.bfloat16))
    assert torch.equal(weights.copies[1], (masters[1].detach() - 1.0).to(torch.bfloat16))


@pytest.mark.parametrize("fused", [False, True])
def test_state_dict_resumes_across_the_switch(fused):
    """torch AdamW (foreach or fused) -> AdamWCopies -> torch AdamW, against torch AdamW
    throughout: bitwise with foreach; fused (its own kernel) within fp32 rounding."""
    ref, got = _params(strided=not fused), _params(strided=not fused)
    ref_opt = _torch(ref, foreach=not fused, fused=fused)
    _train(ref_opt, ref, 6, seed=4)

    first = _torch(got, foreach=not fused, fused=fused)
    _train(first, got, 2, seed=4)
    middle = _copies(got)
    middle.load_state_dict(first.state_dict())
    assert all(s["step"].device.type == "cpu" for s in middle.state.values())
    # The generator restarts: continue the same gradient sequence by skipping 2 steps' draws.
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        for p in got:
            torch.randn(p.shape, generator=gen)
    for opt, steps in ((middle, 2), (_torch(got, foreach=not fused, fused=fused), 2)):
        if opt is not middle:
            opt.load_state_dict(middle.state_dict())
        for _ in range(steps):
            for p in got:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
    if fused:
        for a, b in zip(ref, got, strict=True):
            torch.testing.assert_close(b, a, rtol=2**-19, atol=1e-2 * 2**-19)
    else:
        assert _same(ref, got)
    assert opt.state[got[0]]["step"].item() == 6


def test_refusals():
    params = _params()
    opt = _copies(params)
    opt.param_groups[0]["amsgrad"] = True  # as a loaded torch checkpoint could carry
    _train_one = lambda: _train(opt, params, 1, seed=5)  # noqa: E731
    with pytest.raises(ValueError, match="amsgrad=True"):
        _train_one()
    opt.param_groups[0]["amsgrad"] = False
    opt.param_groups[0]["lr"] = torch.tensor(1e-2)  # a CPU tensor lr is read without a sync
    _train_one()
    with pytest.raises(ValueError, match="fp32 parameters"):
        AdamWCopies([nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], **HYPER, weight_decay=0)
    with pytest.raises(ValueError, match="state_dtype"):
        AdamWCopies(_params(), **HYPER, weight_decay=0, state_dtype=torch.float16)


def test_build_optimizer_choice():
    model = nn.Linear(4, 4)
    make = lambda **kw: build_optimizer(  # noqa: E731
        model, **HYPER, weight_decay=0.1, no_decay_patterns=[], **kw
    )
    assert isinstance(make(implementation="graphtrain"), AdamWCopies)
    opt = make(implementation="graphtrain", state_dtype="bfloat16")
    assert isinstance(opt, AdamWCopies) and opt.state_dtype == torch.bfloat16
    # "auto" keeps torch's AdamW on CPU, and takes ours for fp32 CUDA parameters (measured
    # faster there; fake CUDA tensors: no GPU needed to make the choice).
    assert type(make()) is torch.optim.AdamW
    assert isinstance(make(state_dtype="bfloat16"), AdamWBF16)
    with FakeTensorMode():
        fp32, bf16 = torch.empty(4, 4, device="cuda"), torch.empty(4, device="cuda").bfloat16()
    assert _choose_implementation([fp32, fp32], "auto") == "graphtrain"
    assert _choose_implementation([fp32, bf16], "auto") == "fused"
    # What the start banner says of each.
    assert describe_optimizer(make(implementation="graphtrain")) == (
        "AdamWCopies (graphtrain's kernel)"
    )
    assert describe_optimizer(make()) == "torch AdamW, fused"
    assert describe_optimizer(make(implementation="foreach")) == "torch AdamW, foreach"
    assert describe_optimizer(make(state_dtype="bfloat16")) == "AdamWBF16"
