"""A model with MTP depths (D=2) through the trainer's checkpoints and the Hugging Face export:
exact resume, transformers loads the main model unchanged, the MTP layers go to mtp.safetensors
under DeepSeek-V3's names, and the export reads back with or without that file."""

import shutil

import pytest
import torch
from conftest import job
from safetensors.torch import load_file

from graphtrain.checkpoint.hf import export_hf, load_hf_into, read_hf
from graphtrain.config import load_config
from graphtrain.trainer import train
from models import build_model

transformers = pytest.importorskip("transformers")

MTP = ("--model.mtp_depth=2", "--compile.enable=false", "--metrics.val_interval=0")


def _args(corpus, tmp, *extra):
    return job(corpus, tmp, *MTP, *extra)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """4 steps straight with checkpoints at 2 and 4."""
    tmp = tmp_path_factory.mktemp("mtp")
    args = _args(corpus, tmp, "--training.steps=4", "--checkpoint.interval=2")
    return tmp / "run", train(load_config(args)), args


def test_resume_is_exact(trained):
    run_dir, straight, args = trained
    shutil.rmtree(run_dir / "checkpoints" / "step-0000004")
    resumed = train(load_config([*args, "--checkpoint.resume=latest"]))
    assert resumed.losses == straight.losses[2:]


def _model(run_dir):
    import torch.distributed.checkpoint as dcp

    cfg = load_config(["--config", str(run_dir / "config.toml")]).model
    model = build_model(cfg)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(run_dir / "checkpoints" / "step-0000002"), no_dist=True)
    model.load_state_dict(state["model"])
    return model


def test_export_and_import_round_trip(trained, tmp_path):
    run_dir, _, _ = trained
    src = run_dir / "checkpoints" / "step-0000002"
    out = export_hf(src, tmp_path / "hf", dtype="fp32")
    ours = _model(run_dir)
    cfg = ours.cfg
    assert "mtp.safetensors" in {p.name for p in out.iterdir()}

    # transformers reads the main model as ever: the same logits as our main head.
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)

    # DeepSeek-V3's names: depth k is layer num_layers + k - 1, shared head included.
    mtp = load_file(out / "mtp.safetensors")
    L = cfg.num_layers
    for k in (1, 2):
        i = L + k - 1
        own = ours.mtp_layers[str(k - 1)]
        assert torch.equal(mtp[f"model.layers.{i}.eh_proj.weight"], own.eh_proj.weight)
        assert torch.equal(mtp[f"model.layers.{i}.enorm.weight"], own.enorm.weight)
        assert torch.equal(mtp[f"model.layers.{i}.hnorm.weight"], own.hnorm.weight)
        wq = mtp[f"model.layers.{i}.self_attn.q_proj.weight"]
        assert torch.equal(wq, own.block.attention.wq.weight)
        assert torch.equal(mtp[f"model.layers.{i}.shared_head.head.weight"], ours.output.weight)
        assert f"model.layers.{i}.embed_tokens.weight" in mtp
        assert f"model.layers.{i}.shared_head.norm.weight" in mtp

    # Back: every tensor of the model, MTP layers included, bit for bit (fp32 export).
    back = read_hf(out, cfg)
    state = ours.state_dict()
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], v) for k, v in state.items())

    # Without the MTP file the main model still loads; the MTP layers keep their init.
    (out / "mtp.safetensors").unlink()
    fresh = build_model(cfg)
    fresh.init_weights(seed=7)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    load_hf_into(fresh, out)
    for k, v in fresh.state_dict().items():
        expected = before[k] if k.startswith("mtp_layers.") else state[k]
        assert torch.equal(v, expected), k


def test_mtp_file_of_another_depth_is_refused(trained, tmp_path):
    import dataclasses

    run_dir, _, _ = trained
    out = export_hf(run_dir / "checkpoints" / "step-0000002", tmp_path / "hf", dtype="fp32")
    cfg = dataclasses.replace(_model(run_dir).cfg, mtp_depth=3)
    with pytest.raises(ValueError, match=r"mtp_depth=3 needs layers \[2, 3, 4\].*mtp_depth=2"):
        read_hf(out, cfg)


def test_moe_mtp_names_round_trip():
    """The MTP layers of an MoE model (stacked experts split into DeepSeek-V3's per-expert
    tensors) map to the extra file's names and back to the same tensors."""
    import dataclasses

    from models import MODEL_PRESETS, moe_hf
    from models.mtp_hf import mtp_from_hf_state, mtp_to_hf_state

    cfg = dataclasses.replace(MODEL_PRESETS["moe-debug"], mtp_depth=2, vocab_size=64)
    model = build_model(cfg)
    model.init_weights(seed=0)
    state = model.state_dict()
    hf = mtp_to_hf_state(state, cfg, moe_hf.to_hf_state)
    i = cfg.num_layers  # depth 1
    # The MTP block is an MoE block, as the trunk's last layer (an MoE config has one).
    assert f"model.layers.{i}.mlp.experts.7.down_proj.weight" in hf
    assert f"model.layers.{i}.mlp.gate_proj.weight" not in hf
    back = mtp_from_hf_state(hf, cfg, moe_hf.from_hf_state)
    mtp = {k: v for k, v in state.items() if k.startswith("mtp_layers.")}
    assert back.keys() == mtp.keys()
    assert all(torch.equal(back[k], v) for k, v in mtp.items())
