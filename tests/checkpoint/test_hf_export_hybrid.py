"""Export of the hybrid models to Hugging Face Qwen3-Next and back: transformers'
Qwen3NextForCausalLM loads hybrid-debug, and hybrid-moe-debug with Qwen3-Next's softmax routing,
with our logits and loss (fp32); an import into a fresh model gives back the state bit for bit;
what Qwen3-Next does not compute is refused before anything is written."""

from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from graphtrain.checkpoint.hf import export_hf, load_hf_into
from graphtrain.config import JobConfig, TrainingConfig, to_toml
from models import MODEL_PRESETS, build_model
from models.hybrid_hf import conv_from_hf, conv_to_hf, conv_widths

transformers = pytest.importorskip("transformers")

DEBUG = MODEL_PRESETS["hybrid-debug"]  # "GGG*", Qwen3-Next's attention, 4 value on 2 key heads
# Softmax over all 8 experts, top-2 normalised, a shared expert, block 0 dense: Qwen3-Next's MoE.
MOE = replace(
    MODEL_PRESETS["hybrid-moe-debug"],
    score_func="softmax",
    expert_bias=False,
    num_groups=1,
    topk_groups=1,
)
CASES = {
    "dense": (DEBUG, "hybrid-debug"),
    "dense-tied": (replace(DEBUG, tie_embeddings=True), "hybrid-debug"),
    "moe": (MOE, "hybrid-moe-debug"),
}
TOKENS = torch.randint(0, DEBUG.vocab_size, (2, 80), generator=torch.Generator().manual_seed(0))


def build(cfg, seed: int) -> torch.nn.Module:
    """A random model whose 1-D weights (norms, A_log, dt_bias) are perturbed too: at init the
    norms are all ones, which would hide a norm mapped the wrong way."""
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.mul_(torch.empty(p.shape).uniform_(0.6, 1.4, generator=g))
    return model.eval()


def make_run(tmp_path, cfg, preset: str = "hybrid-debug"):
    model = build(cfg, seed=1)
    run = tmp_path / "run"
    run.mkdir()
    job = JobConfig(preset=preset, model=cfg, training=TrainingConfig(seq_len=64))
    (run / "config.toml").write_text(to_toml(job))
    ckpt = run / "checkpoints" / "step-0000001"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    return run, model


@pytest.mark.parametrize("case", CASES)
def test_transformers_computes_our_logits_and_loss_and_import_is_exact(case, tmp_path):
    cfg, preset = CASES[case]
    run, model = make_run(tmp_path, cfg, preset)
    out = export_hf(run, tmp_path / "hf", dtype="fp32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3NextForCausalLM"
    with torch.no_grad():
        theirs = hf(TOKENS, labels=TOKENS)
        ours = model(TOKENS)
    loss = F.cross_entropy(ours[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten())
    # fp32 both sides; the recurrences are both chunked (64), summed in other orders.
    assert theirs.loss.item() == pytest.approx(loss.item(), abs=1e-4)
    torch.testing.assert_close(theirs.logits, ours, rtol=1e-4, atol=1e-4)

    fresh = build(cfg, seed=2)
    load_hf_into(fresh, out)
    expected, got = model.state_dict(), fresh.state_dict()
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_conv_channels_are_reordered_to_theirs_and_back():
    cfg = DEBUG
    Hk, Dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    rDv = cfg.linear_num_value_heads // Hk * cfg.linear_value_head_dim
    # Channel c of ours holds the value c: key head h's q, k, v sit at h * (2 Dk + rDv).
    ours = torch.arange(Hk * (2 * Dk + rDv), dtype=torch.float32).view(-1, 1, 1)
    theirs = conv_to_hf(ours, Hk, conv_widths(cfg)).flatten()
    width = 2 * Dk + rDv
    q = torch.cat([torch.arange(h * width, h * width + Dk) for h in range(Hk)])
    v = torch.cat([torch.arange(h * width + 2 * Dk, (h + 1) * width) for h in range(Hk)])
    assert torch.equal(theirs, torch.cat([q, q + Dk, v]).float())
    assert torch.equal(conv_from_hf(theirs.view(-1, 1, 1), Hk, conv_widths(cfg)), ours)


@pytest.mark.parametrize(
    "preset, change, message",
    [
        ("hybrid-moe-debug", {}, r"needs Qwen3-Next's routing.*got model.score_func='sigmoid'"),
        (
            "hybrid-debug",
            {"gated_attention": False, "partial_rotary_factor": 1.0},
            r"needs model.gated_attention=true",
        ),
        (
            "hybrid-debug",
            {"mtp_depth": 1},
            r"MTP layers \(model.mtp_depth=1\) is refused: .*after the final norm.*mtp.norm",
        ),
    ],
)
def test_what_qwen3_next_does_not_compute_is_refused_before_writing(
    preset, change, message, tmp_path
):
    run, _ = make_run(tmp_path, replace(MODEL_PRESETS[preset], **change), preset)
    with pytest.raises(ValueError, match=message):
        export_hf(run, tmp_path / "hf", dtype="fp32")
    assert not (tmp_path / "hf").exists()


def test_an_import_into_another_model_names_the_options_that_differ(tmp_path):
    run, _ = make_run(tmp_path, DEBUG)
    out = export_hf(run, tmp_path / "hf", dtype="bf16")
    other = replace(DEBUG, layer_pattern="G*", linear_num_key_heads=4, dim=128)
    with pytest.raises(ValueError, match="does not match the model config") as e:
        load_hf_into(build(other, seed=0), out)
    for part in (
        "model.dim=128 but dim=64",
        "model.layer_pattern='G*' but layer_types=['linear_attention', 'linear_attention', "
        "'linear_attention', 'full_attention']",
        "model.linear_num_key_heads=4 but linear_num_key_heads=2",
    ):
        assert part in str(e.value)


@pytest.mark.slow
def test_a_trained_hybrid_run_exports_and_a_new_run_starts_from_it(corpus, tmp_path):
    """Through the trainer and the CLI's export: train hybrid-debug, export, start a new run
    with --checkpoint.init_from_hf: its step-0 validation sees exactly the trained weights.
    And the run resumed from its step-2 checkpoint continues its curve (weights, the GDN
    blocks' A_log / dt_bias / convolution included, and the optimizer's state); it runs
    eager, so agreement is to fp32 rounding, not bitwise."""
    from conftest import job

    from graphtrain.config import load_config
    from graphtrain.trainer import train

    hybrid = (
        "--preset=hybrid-debug",
        "--training.steps=4",
        "--metrics.val_interval=4",
        "--metrics.validate=true",
    )
    first = train(load_config(job(corpus, tmp_path / "a", *hybrid, "--checkpoint.interval=2")))
    out = export_hf(tmp_path / "a" / "run", tmp_path / "hf", dtype="fp32")
    again = train(
        load_config(job(corpus, tmp_path / "b", *hybrid, f"--checkpoint.init_from_hf={out}"))
    )
    assert again.val_losses[0] == first.val_losses[4]
    step2 = tmp_path / "a" / "run" / "checkpoints" / "step-0000002"
    resumed = train(
        load_config(
            job(corpus, tmp_path / "c", *hybrid, "--compile.enable=false",
                f"--checkpoint.resume={step2}")
        )
    )  # fmt: skip
    assert len(resumed.losses) == 2
    assert resumed.losses == pytest.approx(first.losses[2:], rel=1e-6)
