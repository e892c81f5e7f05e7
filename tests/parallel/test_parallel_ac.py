"""Activation checkpointing, single process: Llama names kept, same loss and gradients, fewer
bytes saved for backward; eager and compiled (compile first, then AC, as parallelize_model does),
dense, MoE (whose compiled blocks get the MoE passes' custom ops) and hybrid (Gated DeltaNet
blocks). Under FSDP and TP it runs in test_parallel_train.py."""

from __future__ import annotations

import pytest
import torch

from graphtrain.compile import apply_compile
from graphtrain.parallel import apply_ac
from models import MODEL_PRESETS, build_model


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Every model here compiles its own blocks; start each test from an empty Dynamo cache.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run(ac_mode: str, compiled: bool, preset: str = "debug"):
    """(model, loss, grads by name, bytes saved for backward outside checkpointed regions)."""
    cfg = MODEL_PRESETS[preset]
    model = build_model(cfg)
    model.init_weights(seed=0)
    if compiled:
        # The first call compiles inside the checkpoint: the passes must not save tensors then.
        apply_compile(model, inner="aot_eager")
    apply_ac(model, ac_mode)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    # Checkpointed regions install their own (inner) hooks: what reaches this one is what
    # stays alive until backward.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, labels=x)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return model, loss.detach(), grads, saved


# Hybrid eager only: its compiled blocks are checkpointed the same way, and compiling them costs
# ~40 s here.
@pytest.mark.parametrize(
    ("preset", "compiled"),
    [(p, c) for p in ("debug", "moe-debug") for c in (False, True)] + [("hybrid-debug", False)],
)
def test_full_ac_same_numbers_less_memory(compiled, preset):
    plain, loss, grads, saved = run("none", compiled, preset)
    model, ac_loss, ac_grads, ac_saved = run("full", compiled, preset)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    # Recompute runs the same ops on the same inputs: bitwise equal on CPU.
    assert torch.equal(ac_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(ac_grads[name], grad), name
    # The blocks' activations are gone; only the embedding/head ones remain (measured: ~30%).
    assert ac_saved < 0.5 * saved


def test_none_is_a_no_op():
    model = build_model(MODEL_PRESETS["debug"])
    apply_ac(model, "none")
    assert all(block._compiled_call_impl is None for block in model.layers.values())


def test_unknown_mode():
    with pytest.raises(ValueError, match=r"must be one of \('none', 'full'\), got 'selective'"):
        apply_ac(build_model(MODEL_PRESETS["debug"]), "selective")
