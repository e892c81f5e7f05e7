"""build_optimizer: weight-decay groups, tied weights, implementation choice, one AdamW step."""

import copy

import pytest
import torch
from torch import nn

from graphtrain.optim import build_optimizer

PATTERNS = ["*norm*", "*bias", "tok_embeddings.*"]


class Toy(nn.Module):
    def __init__(self, tied: bool = True):
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)  # weight decays, bias does not (pattern and 1-D)
        self.norm_proj = nn.Linear(8, 8, bias=False)  # 2-D, excluded by "*norm*"
        self.scale = nn.Parameter(torch.ones(8))  # 1-D, no pattern: still no decay
        self.frozen = nn.Parameter(torch.ones(8, 8), requires_grad=False)
        self.output = nn.Linear(8, 10, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, idx):
        h = self.tok_embeddings(idx)
        h = self.norm_proj(torch.tanh(self.proj(h))) * self.scale
        return self.output(h)


def group_names(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return [sorted(names[id(p)] for p in g["params"]) for g in opt.param_groups]


def make(model, **kwargs):
    kwargs = (
        dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, no_decay_patterns=PATTERNS)
        | kwargs
    )
    return build_optimizer(model, **kwargs)


def test_groups_tied():
    model = Toy(tied=True)
    opt = make(model)
    decay, no_decay = group_names(model, opt)
    assert decay == ["proj.weight"]
    # The tied embedding/output weight appears once; the frozen parameter not at all.
    assert no_decay == ["norm_proj.weight", "proj.bias", "scale", "tok_embeddings.weight"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in opt.param_groups) == 5


def test_groups_untied():
    model = Toy(tied=False)
    decay, no_decay = group_names(model, make(model))
    assert decay == ["output.weight", "proj.weight"]
    assert no_decay == ["norm_proj.weight", "proj.bias", "scale", "tok_embeddings.weight"]


def test_tied_weight_matches_any_of_its_names():
    # named_parameters() reports the tied weight as "tok_embeddings.weight" only; a pattern on
    # its other name must still exclude it.
    model = Toy(tied=True)
    decay, no_decay = group_names(model, make(model, no_decay_patterns=["output.*"]))
    assert "tok_embeddings.weight" in no_decay
    assert decay == ["norm_proj.weight", "proj.weight"]


def test_implementations():
    model = Toy()
    assert make(model, implementation="fused").defaults["fused"] is True
    foreach = make(model, implementation="foreach")
    assert foreach.defaults["foreach"] is True and not foreach.defaults["fused"]
    # CPU has a fused AdamW kernel in every supported torch (>= 2.4).
    assert make(model, implementation="auto").defaults["fused"] is True
    with pytest.raises(ValueError, match="'fast'"):
        make(model, implementation="fast")


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_step_equals_torch_adamw(implementation):
    torch.manual_seed(0)
    model = Toy(tied=True)
    ref_model = copy.deepcopy(model)
    opt = make(model, implementation=implementation)
    ref_params = dict(ref_model.named_parameters())
    ref_opt = torch.optim.AdamW(
        [
            {"params": [ref_params["proj.weight"]], "weight_decay": 0.1},
            {
                "params": [
                    ref_params[n]
                    for n in ("tok_embeddings.weight", "proj.bias", "norm_proj.weight", "scale")
                ],
                "weight_decay": 0.0,
            },
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    idx = torch.randint(0, 10, (3, 5))
    for _ in range(3):
        for m, o in ((model, opt), (ref_model, ref_opt)):
            o.zero_grad()
            m(idx).square().mean().backward()
            o.step()
    for (name, p), (_, ref) in zip(
        model.named_parameters(), ref_model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, ref, msg=name)
