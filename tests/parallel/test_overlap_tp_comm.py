"""Pass overlap_tp_comm on CPU ranks (gloo): what it rewrites, and that training is unchanged.

The chunked variant keeps every dot product's K order and every reduce-scatter's per-element
sum (same ranks, same order), so the losses and every gradient of every step must be bitwise
equal to the unrewritten graphs: dense tp=2 (chunks = tp and 4), MoE with expert TP (etp=tp),
tp=4, and the symm_mem variant. The fp8_all_gather pass (FP8 bytes gathered into fp8_linear)
is checked here too, on the same launches: bitwise against the FP8 run without it, and its FP8
gathers chunked by this pass bitwise against them unchunked. On gloo the rewritten graphs keep
one collective of a group in flight at a time (two corrupt gloo's heap beside another group's
collective: overlap_tp_comm._Builder). Composed with FSDP (dp2 x tp2), the pass is on by
default in tests/parallel/test_parallel_train.py, which follows the single process.
"""

from __future__ import annotations

import pytest
import torch
from overlap_scenarios import compare
from parallel_dist import run_ranks

# The 2- and 4-rank launches take ~2 min; the two tests without them are short.
pytestmark = pytest.mark.slow

SPECS_2 = [
    {"name": "dense_tp2", "model": "debug", "dims": {"tp": 2, "dp_shard": 1}},
    {"name": "dense_tp2_chunks4", "model": "debug", "dims": {"tp": 2, "dp_shard": 1}, "chunks": 4},
    {
        "name": "dense_tp2_chunks3",
        "model": "debug",
        "dims": {"tp": 2, "dp_shard": 1},
        "chunks": 3,
        "compare": False,
    },
    {
        "name": "dense_tp2_symm_mem",
        "model": "debug",
        "dims": {"tp": 2, "dp_shard": 1},
        "variant": "symm_mem",
    },
    {"name": "moe_etp2", "model": "moe-debug", "dims": {"tp": 2, "dp_shard": 1, "etp": 2}},
    {  # the fp8_all_gather pass off and on, FP8 linears everywhere the filters allow
        "name": "fp8_gather_tp2",
        "model": "debug",
        "dims": {"tp": 2, "dp_shard": 1},
        "passes": ["+fp8_linear"],
        "options": {"fp8.min_dim": 16},
        "toggle": "fp8_all_gather",
        "also": ["-overlap_tp_comm"],  # the FP8 gathers unchunked
    },
    {  # FSDP2 gathering the FP8 linears' weights in FP8, off and on (no tp)
        "name": "fp8_fsdp_dp2",
        "model": "debug",
        "dims": {"tp": 1, "dp_shard": 2},
        "passes": ["+fp8_linear"],
        "options": {"fp8.min_dim": 16},
        "toggle": "fp8.fsdp_all_gather_fp8",
    },
]
SPECS_4 = [
    {"name": "dense_tp4", "model": "debug", "dims": {"tp": 4, "dp_shard": 1}},
]


@pytest.fixture(scope="module")
def ranks2() -> list[dict]:
    return run_ranks(compare, 2, SPECS_2, timeout=600)


@pytest.fixture(scope="module")
def ranks4() -> list[dict]:
    return run_ranks(compare, 4, SPECS_4, timeout=600)


def _assert_bitwise(result: dict) -> None:
    off, on = result["off"], result["on"]
    for a, b in zip(off["losses"], on["losses"], strict=True):
        assert torch.equal(a, b), (a, b)
    for step, (ga, gb) in enumerate(zip(off["grads"], on["grads"], strict=True)):
        assert ga.keys() == gb.keys()
        for name in ga:
            assert torch.equal(ga[name], gb[name]), (step, name)


def _rewritten(notes: list[str]) -> int:
    return sum("chunked into" in n for n in notes)


def _block_graphs(notes: dict[str, list[str]], kind: str) -> list[list[str]]:
    graphs = [v for k, v in notes.items() if k.startswith("block-") and k.endswith(kind)]
    assert graphs, notes
    return graphs


@pytest.mark.parametrize("name", ["dense_tp2", "dense_tp2_chunks4", "moe_etp2"])
def test_tp2_bitwise(ranks2, name):
    _assert_bitwise(ranks2[0][name])


def test_gloo_keeps_one_collective_of_a_group_in_flight(ranks2, ranks4):
    """On gloo each block's collective is waited on before the next starts: two in flight on one
    group beside another group's collective corrupt gloo's heap (overlap_tp_comm._Builder). The
    chunked runs kept two (chunks = tp) or four in flight before; the symm_mem stand-in has one
    fused op per pair."""
    results = {**ranks2[0], "dense_tp4": ranks4[0]["dense_tp4"]}
    for name in [*(spec["name"] for spec in SPECS_2 if spec["dims"]["tp"] > 1), "dense_tp4"]:
        assert results[name]["in_flight"] == 1, name


def test_symm_mem_variant(ranks2):
    # The fused ops where they apply (the forward's gathers and single-GEMM scatters); the
    # backward's scatter of a sum of dgrads stays chunked. Checked through torch's fallback
    # kernels of those ops (gloo has no symmetric memory), within fp32 rounding: the fallback
    # multiplies [B, T, K] by [K, N] with matmul, the same GEMM as the original.
    result = ranks2[0]["dense_tp2_symm_mem"]
    for forward in _block_graphs(result["notes"], "forward"):
        assert sum("symm_mem fused_all_gather_matmul" in n for n in forward) == 2, forward
        assert sum("symm_mem fused_matmul_reduce_scatter" in n for n in forward) == 2, forward
    for backward in _block_graphs(result["notes"], "backward"):
        assert sum("symm_mem fused_all_gather_matmul" in n for n in backward) == 2, backward
        assert sum("chunked into" in n for n in backward) == 2, backward
    _assert_bitwise(result)


def test_tp4_bitwise(ranks4):
    # FSDP composed with TP (dp2 x tp2, pass on by default) follows the single process in
    # tests/parallel/test_parallel_train.py.
    _assert_bitwise(ranks4[0]["dense_tp4"])


def test_dense_pairs_per_region(ranks2, ranks4):
    # A dense block: attention (q, k, v share one gather; wo scatters) and the MLP (w1, w3
    # share one gather; w2 scatters) in the forward, and their mirrors in the backward: the
    # gradient gathered before wo's / w2's dgrad, the dgrads of q, k, v / w1, w3 summed and
    # scattered.
    for notes in (ranks2[0]["dense_tp2"]["notes"], ranks4[0]["dense_tp4"]["notes"]):
        for kind in ("forward", "backward"):
            # One region for both blocks: the first block's input is the later one's kind
            # (tensor_parallel._EmbeddingRowwise; before, Dynamo compiled the block twice).
            (graph,) = _block_graphs(notes, kind)
            assert _rewritten(graph) == 4, graph
    (graph, *_) = _block_graphs(ranks2[0]["dense_tp2_chunks4"]["notes"], "forward")
    assert sum("chunked into 4" in n for n in graph) == 4, graph


def test_rows_that_do_not_split_are_left_alone(ranks2):
    for notes in _block_graphs(ranks2[0]["dense_tp2_chunks3"]["notes"], "forward"):
        assert _rewritten(notes) == 0
        assert sum("do not split into 3 chunks" in n for n in notes) == 4, notes


def test_moe_expert_tp_pairs(ranks2):
    # moe-debug: a dense first block (4 pairs each way), then MoE blocks whose attention pairs
    # are rewritten; their expert layer gathers the sequence for the router and the grouped
    # GEMMs (no row GEMM of the gathered tensor) and scatters a combine: left alone, noted.
    # The backward's gather of the output gradient also feeds the shared expert's dgrad as its
    # rows: torch 2.11's AOT graph reads it through one view and the pass chunks it (3 pairs);
    # 2.13+ write two views there, which the pass does not look through (left alone, noted).
    for kind in ("forward", "backward"):
        graphs = _block_graphs(ranks2[0]["moe_etp2"]["notes"], kind)
        counts = sorted(_rewritten(g) for g in graphs)
        assert counts == [2, 4] or (kind == "backward" and counts == [3, 4]), graphs
        moe = next(g for g in graphs if _rewritten(g) < 4)
        assert _rewritten(moe) == 3 or any("left alone" in n for n in moe), moe


def test_gather_without_gemm_is_noted(ranks2):
    notes = ranks2[0]["refusal"]
    assert any("feeds no GEMM" in n for n in notes), notes


@pytest.mark.multigpu
def test_symm_mem_on_gpus():
    # NCCL with symmetric memory enabled for the tp group: the auto variant picks torch's
    # fused ops in the forward under Inductor, and training matches the unrewritten graphs
    # to fp32 rounding (the fused ops' GEMM kernels may block K differently).
    spec = {"name": "gpu", "model": "debug", "dims": {"tp": 2, "dp_shard": 1}}
    spec.update(device="cuda", inner="inductor")
    (result, _) = run_ranks(compare, 2, [spec], timeout=900, backend="nccl")
    forward = _block_graphs(result["gpu"]["notes"], "forward")
    assert all(sum("symm_mem" in n for n in graph) == 4 for graph in forward), forward
    off, on = result["gpu"]["off"], result["gpu"]["on"]
    for a, b in zip(off["losses"], on["losses"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_benchmark_cpu_smoke():
    """benchmarks/tp_overlap.py imports and its emulation of the chunked GEMMs is right."""
    from conftest import run_benchmark_smoke

    run_benchmark_smoke("tp_overlap.py", "tp_overlap smoke: chunked == one GEMM")


def test_fp8_all_gather_bitwise(ranks2):
    # fp8_linear on every block linear: the attention's and the MLP's input gathers feed only
    # FP8 GEMMs (q, k, v; w1, w3) and move E4M3 bytes, the backward's gradient gathers for
    # wo's and w2's dgrad E5M2 bytes; the losses and every gradient equal the FP8 run that
    # gathers fp32 and casts after (same global amax, so the same bytes).
    result = ranks2[0]["fp8_gather_tp2"]
    for forward in _block_graphs(result["notes"], "forward"):
        assert sum("cast to E4M3 before the gather" in n for n in forward) == 2, forward
    for backward in _block_graphs(result["notes"], "backward"):  # wo's and w2's dgrad inputs
        assert sum("cast to E5M2 before the gather" in n for n in backward) == 2, backward
    _assert_bitwise(result)


def test_fp8_gather_chunked(ranks2):
    # overlap_tp_comm after fp8_all_gather: the forward's two FP8 gathers (q, k, v; w1, w3)
    # chunked into tp blocks, each block's FP8 GEMMs run as it arrives; the row-parallel
    # fp8_linear outputs (wo, w2) are not GEMM rows the scatter can split, and the backward's
    # FP8 gradient gathers feed fp8_linear_backward (dgrad and wgrad in one op): left alone.
    # Bitwise against the unchunked FP8 gathers (`also`: overlap_tp_comm off), over the steps.
    result = ranks2[0]["fp8_gather_tp2"]
    for forward in _block_graphs(result["overlap"], "forward"):
        chunked = [n for n in forward if n.startswith("fp8 all_gather") and "chunked into 2" in n]
        assert len(chunked) == 2, forward
        assert sum("made by fp8_linear" in n for n in forward) == 2, forward
    # The later blocks' forward GEMMs (torch._scaled_mm written by the pass) accumulate as the
    # first block's fp8_linear_precast: FORWARD_FAST_ACCUM (the same bits on a GPU too).
    assert result["fast_accum"] and all(result["fast_accum"]), result["fast_accum"]
    for backward in _block_graphs(result["overlap"], "backward"):
        gathers = [n for n in backward if n.startswith("all_gather")]
        assert len(gathers) == 2 and all("read by fp8_linear_backward" in n for n in gathers)
        assert sum("made by fp8_linear_backward" in n for n in backward) == 2, backward
    _assert_bitwise({"off": result["also"], "on": result["on"]})


def test_fp8_all_gather_equals_cast_after_gather(ranks2):
    # Per rank: the FP8 copy of the gathered bf16 activation (and its scale) equals gathering
    # bf16 and casting with the global amax, bit for bit; the gather of a tensor that is also
    # summed stays bf16, with a note, and its result equals the eager computation.
    for rank in ranks2:
        r = rank["fp8_gather"]
        assert torch.equal(r["x8_t"], r["ref_t"]) and torch.equal(r["sx"], r["ref_sx"])
        assert torch.equal(r["out_y"], r["ref_y"])
    r = ranks2[0]["fp8_gather"]
    assert sum("1 byte per element gathered instead of 2" in n for n in r["notes"]) == 1, r
    assert sum("left in high precision" in n and "not fp8_linear" in n for n in r["notes"]) == 1
    assert sorted(line.split('"')[1][:3] for line in r["gathers"]) == ["bf1", "u8["], r["gathers"]
    # x's FP8 gather is chunked (overlap_tp_comm, on by default): x8_t above is assembled from
    # the blocks (B = 2: the rank-major rows permuted back to sequence order).
    assert len(r["chunked"]) == 1 and r["chunked"][0].startswith("fp8 all_gather"), r


def test_fsdp_fp8_all_gather_bitwise(ranks2):
    # dp_shard=2: the linears' weights (not the head, not the norms) are gathered as E4M3
    # bytes cast with the amax max-reduced over dp; the losses and every gradient equal the
    # run that gathers fp32 and casts after, bit for bit, over the steps (optimizer included).
    result = ranks2[0]["fp8_fsdp_dp2"]
    on, off = result["on"]["gathered"], result["off"]["gathered"]
    linears = [n for n in on if n.endswith(("wq.weight", "wo.weight", "w1.weight", "w2.weight"))]
    assert len(linears) == 4 and all(on[n] == [torch.uint8] for n in linears), on
    assert all(on[n] == [torch.float32] for n in on if "norm" in n), on
    assert all(dtypes == [torch.float32] for dtypes in off.values()), off
    _assert_bitwise(result)
