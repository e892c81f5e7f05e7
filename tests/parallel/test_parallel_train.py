"""Multi-rank layouts on CPU (gloo) against single-process training of the same model.

Each layout: build on meta -> parallelize_model -> to_empty -> NaN fill -> init_weights(seed)
-> 3 AdamW steps (fp32) on the same global batch (tp ranks read the same rows, dp ranks their
slice of them). Checked: nothing left NaN, full initial parameters bitwise equal to the
single-process init, losses equal to single-process training within LOSS_RTOL.

LOSS_RTOL = 1e-5: the layouts add the same fp32 numbers in another order (matmuls split over
heads/ffn/vocab then summed by reduce-scatter, gradients averaged over dp ranks), a few ulps
(~1e-7 relative, as measured) per step; 3 steps at this size do not amplify that noticeably.
A real bug (a wrong shard, a gradient not reduced or scaled twice, a broken tie) moves the loss
by more than 1e-3 after one step at LR 1e-2, far outside the tolerance.

All 2-rank layouts run in one spawn, the 4-rank ones in another: process start and imports
dominate the cost on 2 cores. The 2-rank spawn also runs the rank-divergence check
(graphtrain.parallel.divergence): test_a_perturbed_rank_is_named.
"""

from __future__ import annotations

import pytest
import torch
from parallel_dist import run_ranks
from parallel_scenarios import DIVERGENCE_CASES, reference, replica_divergence, run_specs

# Every test reads the 2- and 4-rank launches (~1 min).
pytestmark = pytest.mark.slow

LOSS_RTOL = 1e-5
AOT_EAGER = {"inner": "aot_eager"}

SPECS_2 = [
    {"name": "fsdp", "dims": {"dp_shard": 2}},
    {"name": "tp", "dims": {"tp": 2}},
    {"name": "tp_tied_docmask", "dims": {"tp": 2}, "tie": True, "mask": True},
    {"name": "tp_compile", "dims": {"tp": 2}, "compile": AOT_EAGER},
    {"name": "tp_compile_ac", "dims": {"tp": 2}, "compile": AOT_EAGER, "ac": "full"},
    {
        "name": "fsdp_compile_ac_tied",
        "dims": {"dp_shard": 2},
        "compile": AOT_EAGER,
        "ac": "full",
        "tie": True,
    },
    {"name": "replicate", "dims": {"dp_replicate": 2, "dp_shard": 1}},
    # MTP (D=2) on packed rows: its layers sharded like the trunk's blocks.
    {"name": "fsdp_mtp", "dims": {"dp_shard": 2}, "mtp": 2, "mask": True},
    {"name": "tp_mtp", "dims": {"tp": 2}, "mtp": 2, "mask": True},
]
SPECS_4 = [
    {"name": "fsdp_tp", "dims": {"dp_shard": 2, "tp": 2}},
    {"name": "hsdp", "dims": {"dp_replicate": 2, "dp_shard": 2}},
    {
        "name": "fsdp_tp_compile_ac_tied",
        "dims": {"dp_shard": 2, "tp": 2},
        "compile": AOT_EAGER,
        "ac": "full",
        "tie": True,
    },
]
ALL = {**{s["name"]: (2, s) for s in SPECS_2}, **{s["name"]: (4, s) for s in SPECS_4}}


@pytest.fixture(scope="module")
def ranks2() -> list[dict]:
    return run_ranks(run_specs, 2, SPECS_2, (replica_divergence,))


@pytest.fixture(scope="module")
def ranks4() -> list[dict]:
    return run_ranks(run_specs, 4, SPECS_4)


@pytest.fixture(scope="module")
def references() -> dict:
    cache: dict = {}

    def get(tie: bool, mask: bool, mtp: int) -> dict:
        if (tie, mask, mtp) not in cache:
            cache[tie, mask, mtp] = reference(tie=tie, mask=mask, mtp=mtp)
        return cache[tie, mask, mtp]

    return get


@pytest.fixture(params=sorted(ALL))
def layout(request, ranks2, ranks4, references):
    """(name, spec, per-rank results, single-process reference) of one layout."""
    name = request.param
    world, spec = ALL[name]
    results = ranks2 if world == 2 else ranks4
    ref = references(spec.get("tie", False), spec.get("mask", False), spec.get("mtp", 0))
    return name, spec, [r[name] for r in results], ref


def test_mesh(ranks2, ranks4):
    for results, world in ((ranks2, 2), (ranks4, 4)):
        mesh = results[0]["mesh"]
        assert mesh["names"] == ("dp_replicate", "dp_shard", "tp")
        assert mesh["shape"] == (1, world // 2, 2)
        assert mesh["dp_size"] == world // 2 and mesh["tp_size"] == 2
        assert f"world size {2 * world}" in mesh["wrong_world"]
        assert f"has {world} ranks" in mesh["wrong_world"]


def test_everything_initialized(layout):
    name, _, results, _ = layout
    for rank, r in enumerate(results):
        assert r["still_nan"] == [], f"{name} rank {rank}: left uninitialized: {r['still_nan']}"


def test_init_equals_single_process(layout):
    name, _, results, ref = layout
    params = results[0]["params"]
    assert params.keys() == ref["params"].keys(), name
    for key, value in ref["params"].items():
        assert torch.equal(params[key], value), f"{name}: {key} differs from single-process init"


def test_losses_equal_single_process(layout):
    name, _, results, ref = layout
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL), f"{name} rank {rank}"
    # The run must actually learn, or equal losses would prove little.
    assert ref["losses"][-1] < ref["losses"][0] - 0.1


def test_tied_head_stays_tied(layout):
    name, spec, results, _ = layout
    for r in results:
        assert r["tied"] == spec.get("tie", False), name


def test_ranks_do_not_share_aot_autograd_graphs(ranks2, ranks4):
    """On several ranks graphtrain turns the AOTAutograd cache off: its key misses the group
    names and shard offsets in the graphs, so ranks of one host would load each other's (seen:
    ep=2 x tp=2 x etp=2 under Inductor failing on another tp group's name, and a warm cache
    giving tp=2 another tp rank's backward). Single-process compiles keep it."""
    import torch._functorch.config

    before = torch._functorch.config.enable_autograd_cache
    for results in (ranks2, ranks4):
        assert [r["aot_cache"] for r in results] == [(before, False)] * len(results)
    assert before, "nothing to check: the cache is already off in this torch"


def test_a_perturbed_rank_is_named(ranks2):
    """Rank divergence: a clean 2-rank run (tp=2; dp_replicate=2) passes the replica check after
    one AdamW step; rank 1's parameter or optimizer state perturbed by one ulp is named, with
    the ranks, on every rank."""
    per_rank = [r["replica_divergence"] for r in ranks2]
    for (_, _, named), *messages in zip(DIVERGENCE_CASES, *per_rank, strict=True):
        for clean, perturbed in messages:
            assert clean == ""
            assert perturbed.startswith("replicas diverged at step 7: " + named)
