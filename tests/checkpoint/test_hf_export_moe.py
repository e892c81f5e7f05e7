"""Export of MoE models to Hugging Face and back: transformers loads sigmoid routing as
Glm4MoeForCausalLM and softmax routing as Qwen2MoeForCausalLM with our logits (fp32, tight
tolerance; random non-zero expert biases, so the selection is tested), an import into a fresh
model gives back the state bit for bit, and the configurations no architecture computes are
refused before anything is written."""

import json
import re
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from graphtrain.checkpoint.hf import export_hf, load_hf_into
from graphtrain.cli import main
from graphtrain.config import JobConfig, TrainingConfig, load_config, to_toml
from models import MODEL_PRESETS, build_model
from models.moe import MoEConfig

transformers = pytest.importorskip("transformers")

DEBUG = MODEL_PRESETS["moe-debug"]  # sigmoid, 4 groups of 2 experts (2 kept), a shared expert
CASES = {
    # The DeepSeek-V3 routing of the preset, with a route scale.
    "sigmoid": (replace(DEBUG, route_scale=2.5), "Glm4MoeForCausalLM"),
    # No bias (exported as zeros), no shared experts (zero wide), weights not normalised.
    "sigmoid-plain": (
        replace(
            DEBUG,
            expert_bias=False,
            num_shared_experts=0,
            normalize_weights=False,
            num_groups=1,
            topk_groups=1,
            first_k_dense=0,
            tie_embeddings=True,
        ),
        "Glm4MoeForCausalLM",
    ),
    # Softmax over all experts, weights not normalised, two shared experts (a gated shared
    # expert on their side).
    "softmax": (
        replace(
            DEBUG,
            score_func="softmax",
            expert_bias=False,
            num_groups=1,
            topk_groups=1,
            normalize_weights=False,
            num_shared_experts=2,
        ),
        "Qwen2MoeForCausalLM",
    ),
    # Softmax after top-k: their normalised softmax, equal up to rounding.
    "softmax-after-topk": (
        replace(
            DEBUG,
            score_func="softmax",
            pre_softmax=False,
            expert_bias=False,
            num_groups=1,
            topk_groups=1,
            num_shared_experts=0,
            first_k_dense=0,
        ),
        "Qwen2MoeForCausalLM",
    ),
}
TOKENS = torch.randint(0, DEBUG.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))


def build(cfg: MoEConfig, seed: int) -> torch.nn.Module:
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.eval()


def make_run(tmp_path, cfg: MoEConfig):
    """A run directory with config.toml and one checkpoint of a random model whose routers
    have non-zero expert biases of the size of the score differences (they change the choice)."""
    model = build(cfg, seed=1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.uniform_(-0.05, 0.05)
    run = tmp_path / "run"
    run.mkdir()
    job = JobConfig(preset="moe-debug", model=cfg, training=TrainingConfig(seq_len=64))
    (run / "config.toml").write_text(to_toml(job))
    ckpt = run / "checkpoints" / "step-0000001"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    return run, model


@pytest.mark.parametrize("case", CASES)
def test_transformers_computes_our_logits_and_import_is_exact(case, tmp_path):
    cfg, architecture = CASES[case]
    run, model = make_run(tmp_path, cfg)
    out = export_hf(run, tmp_path / "hf", dtype="fp32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture
    with torch.no_grad():
        theirs = hf(TOKENS).logits
        ours = model(TOKENS)
    # fp32 both sides, same routing; only summation orders (grouped GEMM vs per-expert linear,
    # the combine) differ. A wrong routing option moves them by more than 5e-4.
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    if cfg.expert_bias:
        # The bias reaches their selection: without it the logits are others.
        with torch.no_grad():
            for layer in hf.model.layers[cfg.first_k_dense :]:
                layer.mlp.gate.e_score_correction_bias.zero_()
            assert (hf(TOKENS).logits - ours).abs().max() > 1e-3

    fresh = build(cfg, seed=2)
    load_hf_into(fresh, out)
    expected, got = model.state_dict(), fresh.state_dict()
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
        assert expected[name].dtype == got[name].dtype, name


def test_bf16_export_keeps_the_expert_bias_fp32(tmp_path):
    cfg, _ = CASES["sigmoid"]
    run, model = make_run(tmp_path, cfg)
    tensors = load_file(export_hf(run, tmp_path / "hf") / "model.safetensors")
    for i in ("1", "2"):
        bias = tensors.pop(f"model.layers.{i}.mlp.gate.e_score_correction_bias")
        assert bias.dtype == torch.float32
        assert torch.equal(bias, model.layers[i].moe.router.expert_bias)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    w2 = model.layers["2"].moe.experts.w2
    assert torch.equal(tensors["model.layers.2.mlp.experts.3.down_proj.weight"], w2[3].bfloat16())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"score_func": "softmax"},
            r"model.expert_bias=True with model.score_func='softmax' has no Hugging Face "
            r"architecture: Qwen2MoeForCausalLM, the one for softmax routing, needs "
            r"model.expert_bias=false",
        ),
        ({"score_func": "softmax", "expert_bias": False}, r"model.num_groups=4 with model"),
        (
            {
                "score_func": "softmax",
                "expert_bias": False,
                "num_groups": 1,
                "topk_groups": 1,
                "route_scale": 2.0,
            },
            r"model.route_scale=2.0 with model",
        ),
        ({"num_groups": 8, "topk_groups": 4}, r"one expert per group; Glm4MoeForCausalLM"),
    ],
)
def test_configs_no_architecture_computes_are_refused_before_writing(
    change, message, tmp_path, capsys
):
    run, _ = make_run(tmp_path, replace(DEBUG, **change))
    with pytest.raises(ValueError, match=message):
        export_hf(run, tmp_path / "hf")
    assert main(["export", str(run), str(tmp_path / "hf")]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "hf").exists()


def test_imports_the_model_cannot_hold_are_refused(tmp_path):
    cfg, _ = CASES["sigmoid"]
    run, _ = make_run(tmp_path, cfg)
    out = export_hf(run, tmp_path / "hf", dtype="fp32")
    # Another routing shape names the option and the key.
    with pytest.raises(ValueError, match=r"model.top_k=3 but num_experts_per_tok=2"):
        load_hf_into(build(replace(cfg, top_k=3), seed=0), out)
    # A real bias cannot go into a model without one.
    with pytest.raises(ValueError, match=r"e_score_correction_bias is not zero but model.exp"):
        load_hf_into(build(replace(cfg, expert_bias=False), seed=0), out)
    # Another architecture altogether.
    softmax_cfg, _ = CASES["softmax"]
    with pytest.raises(ValueError, match=r"model_type='glm4_moe'; the model maps onto 'qwen2_moe'"):
        load_hf_into(build(softmax_cfg, seed=0), out)
    # A Glm4Moe that rotates half of each head (its default) is not our attention.
    config = json.loads((out / "config.json").read_text())
    del config["rope_parameters"]["partial_rotary_factor"], config["partial_rotary_factor"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5 but graphtrain's model needs"):
        load_hf_into(build(cfg, seed=0), out)


def test_a_gated_qwen2_moe_shared_expert_is_refused(tmp_path):
    cfg, _ = CASES["softmax"]
    run, _ = make_run(tmp_path, cfg)
    out = export_hf(run, tmp_path / "hf", dtype="fp32")
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.2.mlp.shared_expert_gate.weight"] += 0.1
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers.2.mlp.shared_expert_gate.weight is not zero"):
        load_hf_into(build(cfg, seed=0), out)


def test_a_trained_moe_run_exports_and_a_new_run_starts_from_it(corpus, tmp_path):
    """Through the trainer: train moe-debug (its expert biases move), export, start a new run
    with --checkpoint.init_from_hf: its step-0 validation sees exactly the trained weights and
    biases (the biases change which experts run, so a lost bias would show)."""
    from conftest import job

    from graphtrain.trainer import train

    moe = (
        "--preset=moe-debug",
        "--training.steps=3",
        "--metrics.val_interval=3",
        "--metrics.validate=true",
    )
    first = train(load_config(job(corpus, tmp_path / "a", *moe, "--checkpoint.interval=3")))
    out = export_hf(tmp_path / "a" / "run", tmp_path / "hf", dtype="fp32")
    bias = load_file(out / "model.safetensors")["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().max() > 0
    again = train(
        load_config(job(corpus, tmp_path / "b", *moe, f"--checkpoint.init_from_hf={out}"))
    )
    assert again.val_losses[0] == first.val_losses[3]
