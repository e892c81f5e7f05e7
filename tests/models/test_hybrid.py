"""Hybrid models (models/hybrid.py): the layer pattern, initialisation, packed documents, and
hybrid-debug / hybrid-moe-debug training through the trainer, compiled equal to eager."""

import dataclasses

import pytest
import torch
from conftest import gloo_runs, job, poisoned_model, rank_jobs

from graphtrain.attention import document_causal_mask
from graphtrain.config import load_config
from graphtrain.parallel.mesh import validate_model_for_tp
from graphtrain.trainer import train
from models import MODEL_PRESETS, build_model
from models.gpt import TransformerBlock
from models.hybrid import (
    GatedDeltaNetBlock,
    GatedDeltaNetMoEBlock,
    HybridGPT,
    HybridMoEGPT,
)
from models.moe import MoEBlock

DEBUG = MODEL_PRESETS["hybrid-debug"]
MOE_DEBUG = MODEL_PRESETS["hybrid-moe-debug"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_pattern": "GGA*"}, "unknown letters \\['A'\\]"),
        ({"layer_pattern": ""}, "non-empty string"),
        ({"layer_pattern": "GGG"}, "length 3.*num_layers=4"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads=3 is not a multiple"),
        ({"linear_chunk_size": 0}, "linear_chunk_size must be >= 1"),
        ({"gated_attention": False}, "partial_rotary_factor=0.25 needs model.gated_attention"),
    ],
)
def test_config_errors_name_values(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(DEBUG, **change)


def test_pattern_repeats_to_the_layers_and_picks_ffn_kinds():
    cfg = dataclasses.replace(DEBUG, num_layers=8, layer_pattern="G*")
    model = poisoned_model(cfg)
    assert type(model) is HybridGPT
    kinds = [type(b) for b in model.layers.values()]
    assert kinds == [GatedDeltaNetBlock, TransformerBlock] * 4
    moe = poisoned_model(dataclasses.replace(MOE_DEBUG, mtp_depth=1))
    assert type(moe) is HybridMoEGPT
    assert [type(b) for b in moe.layers.values()] == [
        GatedDeltaNetBlock,  # first_k_dense = 1
        GatedDeltaNetMoEBlock,
        GatedDeltaNetMoEBlock,
        MoEBlock,
    ]
    # Every MoE block's router is found (balancing, aux losses), the MTP block's included,
    # and the MTP block is an attention block as in Qwen3-Next.
    assert [name for name, _ in moe.routers()] == [
        "layers.1",
        "layers.2",
        "layers.3",
        "mtp_layers.0.block",
    ]
    assert type(moe.mtp_layers["0"].block) is MoEBlock


@pytest.mark.parametrize("preset", ["hybrid-debug", "hybrid-moe-debug"])
def test_every_parameter_and_buffer_is_initialized_and_seeded(preset):
    a, b = (
        poisoned_model(MODEL_PRESETS[preset], seed=3),
        poisoned_model(MODEL_PRESETS[preset], seed=3),
    )
    for (name, t), u in zip(
        [*a.named_parameters(), *a.named_buffers()], [*b.parameters(), *b.buffers()], strict=True
    ):
        assert torch.isfinite(t).all(), f"{name} not initialized"
        assert torch.equal(t, u), name
    gdn = a.layers["0"].linear_attention
    assert (gdn.A_log.exp() >= 1).all() and (gdn.A_log.exp() <= 16).all()
    dt = torch.nn.functional.softplus(gdn.dt_bias)
    assert (dt >= 1e-4 * 0.999).all() and (dt <= 0.1 * 1.001).all()


def test_1b_preset_size():
    with torch.device("meta"):
        model = build_model(MODEL_PRESETS["hybrid-1b"])
    assert sum(p.numel() for p in model.parameters()) == 999_297_920


def test_packed_documents_equal_separate_documents():
    """A row holding three documents gives each the logits it gets alone: attention blocks by
    the mask, Gated DeltaNet blocks by resetting their state and convolution (float64; the MoE
    FFN works per token, and its grouped GEMMs have no float64)."""
    cfg = dataclasses.replace(DEBUG, linear_chunk_size=8)
    model = poisoned_model(cfg).double().eval()
    lengths = [11, 3, 20]
    T = sum(lengths)
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = model(ids, position_ids=pos, attn_mask=document_causal_mask(doc), document_ids=doc)
    start = 0
    for n in lengths:
        alone = model(ids[:, start : start + n])
        # The norms compute in fp32 even in a float64 model: fp32-level agreement.
        torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-5, atol=1e-6)
        start += n
    # Without document ids the GDN blocks read across documents: the check above is not vacuous.
    crossing = model(ids, position_ids=pos, attn_mask=document_causal_mask(doc))
    assert (crossing[:, lengths[0] :] - packed[:, lengths[0] :]).abs().max() > 1e-2


def test_tensor_parallel_needs_the_gdn_key_heads_divisible():
    validate_model_for_tp(DEBUG, 2)
    cfg = dataclasses.replace(DEBUG, linear_num_key_heads=1)
    with pytest.raises(
        ValueError, match=r"model.linear_num_key_heads=1 is not divisible by parallel.tp=2"
    ):
        validate_model_for_tp(cfg, 2)
    validate_model_for_tp(dataclasses.replace(cfg, layer_pattern="*"), 2)  # no GDN block


def test_hybrid_debug_learns(corpus, tmp_path):
    result = train(
        load_config(
            job(
                corpus,
                tmp_path,
                "--preset=hybrid-debug",
                "--training.steps=30",
                "--metrics.val_interval=30",
                "--metrics.validate=true",
            )
        )
    )
    assert result.val_losses[30] < result.val_losses[0] - 2.0, result.val_losses


@pytest.mark.parametrize(
    "preset", ["hybrid-debug", pytest.param("hybrid-moe-debug", marks=pytest.mark.slow)]
)
def test_eager_and_compiled_losses_are_bitwise_equal(corpus, tmp_path, preset):
    """With the numerics-preserving passes (the fused cross-entropy changes rounding: off)."""
    from graphtrain.passes import all_passes

    switches = ",".join(("+" if p.preserves_numerics else "-") + p.name for p in all_passes())
    common = (f"--preset={preset}", "--training.steps=3")
    eager = train(load_config(job(corpus, tmp_path / "e", *common, "--compile.enable=false")))
    compiled = train(
        load_config(job(corpus, tmp_path / "c", *common, f"--compile.passes={switches}"))
    )
    assert eager.losses == compiled.losses


def test_gdn_flops_are_the_matmuls_the_layer_runs():
    """The FLOPs formula of a GDN mixer (graphtrain.metrics.flops) against torch's flop counter
    on the layer's forward. Where the formula counts the unit-triangular solve for u_v and u_s
    (C * C * (Dk + Dv) per chunk and value head), the layer solves against the identity (not
    counted) and applies the inverse by matmuls (counted, twice that): solve_difference."""
    from torch.utils.flop_counter import FlopCounterMode

    from graphtrain.metrics.flops import gated_deltanet_forward_flops_per_token
    from models.hybrid import build_gated_deltanet

    cfg = DEBUG
    layer = build_gated_deltanet(cfg)
    layer.init_weights(0.02, 0.01)
    T = 2 * cfg.linear_chunk_size
    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(1, T, cfg.dim))
    C, Dk, Dv = cfg.linear_chunk_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    solve_difference = -cfg.linear_num_value_heads * C * (Dk + Dv)  # per token
    want = T * gated_deltanet_forward_flops_per_token(cfg)
    assert counter.get_total_flops() + T * solve_difference == want


@pytest.mark.parametrize("gated, mtp_depth", [(True, 1), (False, 0)])
def test_hybrid_forward_flops_match_the_flop_counter_on_the_model(gated, mtp_depth):
    """hybrid-debug's forward (its GDN blocks, gated or plain attention, MTP) against torch's
    flop counter, with the solve's difference of the test above; whole chunks (the rule pads a
    partial one), attention as its full T x T on SDPA's math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from graphtrain.metrics.flops import model_training_flops

    rope = {} if gated else {"gated_attention": False, "partial_rotary_factor": 1.0}
    cfg = dataclasses.replace(DEBUG, linear_chunk_size=8, mtp_depth=mtp_depth, **rope)
    model = poisoned_model(cfg)
    B, T = 2, 16
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, tokens)
    C, Dk, Dv = cfg.linear_chunk_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    solve_difference = -3 * B * T * cfg.linear_num_value_heads * C * (Dk + Dv)  # 3 GDN blocks
    expected = model_training_flops(cfg, num_tokens=B * T, num_attention_pairs=B * T * T)
    assert 3 * (counter.get_total_flops() + solve_difference) == expected


@pytest.mark.parametrize("preset", ["hybrid-debug", "hybrid-moe-debug"])
def test_hybrid_flops_swap_attention_for_gdn(preset):
    from graphtrain.metrics.flops import (
        gated_deltanet_forward_flops_per_token,
        model_training_flops,
    )

    cfg = dataclasses.replace(MODEL_PRESETS[preset], mtp_depth=1)
    tokens, pairs = 4 * 256, 4 * 256 * 257 // 2
    attention_only = dataclasses.replace(cfg, layer_pattern="*")
    full = model_training_flops(attention_only, num_tokens=tokens, num_attention_pairs=pairs)
    d, hd = cfg.dim, cfg.head_dim
    # wq (query and gate: 2 * q_dim), wo; wk, wv
    attention = 2 * d * cfg.num_heads * hd * 3 + 2 * 2 * d * cfg.num_kv_heads * hd
    per_gdn = tokens * (gated_deltanet_forward_flops_per_token(cfg) - attention)
    per_gdn -= pairs * 4 * hd * cfg.num_heads
    hybrid = model_training_flops(cfg, num_tokens=tokens, num_attention_pairs=pairs)
    assert hybrid == full + 3 * 3 * per_gdn  # "GGG*": 3 GDN blocks
    assert hybrid != full


def test_memory_plan_counts_gdn_and_gated_attention_activations():
    """hybrid-1b's activations against the same model with attention blocks only, with plain
    attention and with the Gated DeltaNet's chunked form compiled (the inline form, the pass
    off), by hand (per token, bf16)."""
    from graphtrain.metrics.memory_plan import (
        gated_deltanet_activations_per_token,
        gated_deltanet_chunked_activations_per_token,
        plan_memory,
    )

    def activations(*changes):
        plan = plan_memory(load_config([*args, *changes]), 1)
        return plan.items["activations per micro-batch"]

    args = ["--preset", "hybrid-1b", "--training.dtype=bfloat16"]
    cfg = MODEL_PRESETS["hybrid-1b"]
    tokens = 2 * 4096  # the preset's micro-batch
    kv_dim = cfg.num_kv_heads * cfg.head_dim
    # A Llama block keeps 7 dim + 2 kv_dim + 4 ffn_dim; gated attention adds q and k before
    # their norms, the gate and the gated product; a GDN block keeps its own tensors instead of
    # q, k, v and the attention output.
    plain = 7 * cfg.dim + 2 * kv_dim + 4 * cfg.ffn_dim
    gated = plain + 3 * cfg.dim + kv_dim
    gdn = plain - 2 * cfg.dim - 2 * kv_dim + gated_deltanet_activations_per_token(cfg)
    assert activations() == tokens * (12 * gdn + 4 * gated) * 2  # "GGG*" x 4, bf16
    assert activations("--model.layer_pattern=*") == tokens * 16 * gated * 2
    ungated = ("--model.gated_attention=false", "--model.partial_rotary_factor=1")
    assert activations(*ungated) == tokens * (12 * gdn + 4 * plain) * 2
    # The chunked form under Inductor (the inline form, or the pass off) keeps its chunk terms:
    # 768 MiB more a GDN block at these shapes.
    chunked = gated_deltanet_chunked_activations_per_token(cfg)
    assert chunked * tokens * 2 == 768 * 2**20
    with_terms = tokens * (12 * (gdn + chunked) + 4 * gated) * 2
    off = '--compile.passes=["-gated_delta_rule"]'
    assert activations("--compile.gdr_form=inline") == with_terms
    assert activations(off) == activations("--compile.gdr_form=inline", off) == with_terms
    assert activations("--compile.gdr_form=inline", "--compile.enable=false") == activations()


@pytest.mark.slow
def test_fsdp_and_pipeline_follow_the_single_process_curve(corpus, tmp_path):
    """hybrid-debug on two gloo ranks against one process, the same global batch: under FSDP2
    (dp_shard=2) the losses to 1e-3 relative (each rank weights its own tokens: measured up to
    6e-5 apart); on pp=2 (zbv where torch runs it on gloo, else 1F1B: a GDN or attention block
    per stage, the documents to each GDN block, zbv's split backward through the GDN regions)
    to 1e-5, the token-weighted micro-batches being one process's loss (measured 7e-8 against
    the compiled reference)."""
    common = ["--preset=hybrid-debug", "--training.steps=4", "--metrics.log_interval=1"]
    # the reference eager (compiled, the same bits without the fused loss: the test above)
    single = train(load_config(job(corpus, tmp_path / "one", *common, "--compile.enable=false")))
    two = ["--parallel.dp_shard=2", "--training.micro_batch_size=2"]
    pp = ["--parallel.pp=2", f"--parallel.pp_schedule={'zbv' if gloo_runs('zbv') else '1f1b'}"]
    runs = rank_jobs(2, [job(corpus, tmp_path / name, *common, *args)
                         for name, args in (("two", two), ("pp", pp))])  # fmt: skip
    for metrics, rel in zip(runs, (1e-3, 1e-5), strict=True):
        multi = [m["loss"] for m in metrics if "loss" in m]
        assert len(multi) == 4
        for a, b in zip(single.losses, multi, strict=True):
            assert b == pytest.approx(a, rel=rel)
