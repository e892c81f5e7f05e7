"""AdamWBF16: torch AdamW's update (fp32 states: to 1e-6), bf16 moments close to fp32 AdamW over
the first steps, and a state-dict round trip that keeps the moments bf16."""

import pytest
import torch

from graphtrain.optim import AdamWBF16, build_optimizer


def _run(make_opt, steps=5):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37, 19)), torch.nn.Parameter(torch.randn(19))]
    opt = make_opt(params)
    for i in range(steps):
        torch.manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _bf16(dtype):
    return lambda params: AdamWBF16(
        params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, state_dtype=dtype
    )


def test_fp32_states_give_torch_adamw():
    ref, _ = _run(_adamw)
    got, _ = _run(_bf16(torch.float32))
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_bf16_states_follow_fp32_adamw_over_the_first_steps():
    """Tolerance: an update (about lr = 1e-2 in size) changes by the bf16 rounding of the moments,
    at most about 2**-8 relative (m and sqrt(v) each up to 2**-9), so after 5 steps the parameters
    differ by at most 5 * 1e-2 * 2**-8 ~ 2e-4 (observed: 1.5e-4)."""
    start, _ = _run(lambda p: _adamw(p), steps=0)
    ref, _ = _run(_adamw)
    got, opt = _run(_bf16(torch.bfloat16))
    for a, b, s in zip(ref, got, start, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-4)
        assert (b - s).abs().max() > 1e-2  # the parameters did move
    state = opt.state[got[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert opt.state_bytes() == (37 * 19 + 19) * 2 * 2  # half of fp32's


def test_state_dict_round_trip_keeps_bf16():
    params, opt = _run(_bf16(torch.bfloat16))
    saved = opt.state_dict()
    fresh = _bf16(torch.bfloat16)([torch.nn.Parameter(p.detach().clone()) for p in params])
    fresh.load_state_dict(saved)
    for old, new in zip(params, fresh.param_groups[0]["params"], strict=True):
        s, t = opt.state[old], fresh.state[new]
        assert t["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(t["exp_avg"], s["exp_avg"]) and torch.equal(t["step"], s["step"])


def test_build_optimizer_picks_it():
    model = torch.nn.Linear(4, 4)
    assert isinstance(
        build_optimizer(
            model,
            lr=1e-3,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.1,
            no_decay_patterns=[],
            state_dtype="bfloat16",
        ),
        AdamWBF16,
    )
    with pytest.raises(ValueError, match="state_dtype"):
        build_optimizer(
            model,
            lr=1e-3,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.1,
            no_decay_patterns=[],
            state_dtype="float16",
        )
