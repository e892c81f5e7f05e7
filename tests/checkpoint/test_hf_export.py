"""Export to Hugging Face safetensors and back: transformers loads the dense model as Llama with
the same logits (fp32, tight tolerance), the tokenizer files load, and a run started from the
export has the exported model's loss. MoE models: test_hf_export_moe.py."""

import json

import pytest
import torch
from conftest import job

from graphtrain.checkpoint.hf import export_hf, parse_size
from graphtrain.cli import main
from graphtrain.config import load_config
from graphtrain.trainer import train
from models import build_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A debug run of 3 steps with its final checkpoint, and the validation losses it logged."""
    tmp = tmp_path_factory.mktemp("hf")
    args = job(
        corpus, tmp, "--training.steps=3", "--checkpoint.interval=3", "--metrics.validate=true"
    )
    return tmp / "run", train(load_config(args)), args


def _graphtrain_logits(run_dir, tokens):
    """Logits of the checkpointed model, loaded with graphtrain itself (eager, fp32)."""
    import torch.distributed.checkpoint as dcp

    cfg = load_config(["--config", str(run_dir / "config.toml")]).model
    model = build_model(cfg)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(run_dir / "checkpoints" / "step-0000003"), no_dist=True)
    model.load_state_dict(state["model"])
    with torch.no_grad():
        return model(tokens)


def test_transformers_loads_the_export_with_the_same_logits(trained, tmp_path):
    run_dir, _, _ = trained
    out = export_hf(run_dir, tmp_path / "hf", dtype="fp32")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = _graphtrain_logits(run_dir, tokens)
    # fp32 both sides; only the summation order of a few kernels differs.
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    from graphtrain.data.tokenizer import load_tokenizer

    ours_tok = load_tokenizer(run_dir / "tokenizer.json")
    text = "alpha beta gamma end1."
    assert tok(text, add_special_tokens=False)["input_ids"] == ours_tok.encode(text)
    assert tok.eos_token_id == ours_tok.eos_id == hf.config.eos_token_id


def test_sharded_export_has_an_index_and_the_same_tensors(trained, tmp_path):
    run_dir, _, _ = trained
    single = export_hf(run_dir, tmp_path / "one", dtype="bf16")
    sharded = export_hf(
        run_dir / "checkpoints" / "step-0000003", tmp_path / "many", max_shard_size=50_000
    )
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0].endswith("-of-" + f"{len(files):05d}.safetensors")
    from safetensors.torch import load_file

    a = load_file(single / "model.safetensors")
    b = {k: v for f in files for k, v in load_file(sharded / f).items()}
    assert a.keys() == b.keys() == index["weight_map"].keys()
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == torch.bfloat16 for k in a)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in a.values())


def test_a_run_started_from_the_export_has_its_loss(trained, corpus, tmp_path):
    run_dir, first, _ = trained
    out = export_hf(run_dir, tmp_path / "hf", dtype="fp32")
    again = train(
        load_config(
            job(corpus, tmp_path, "--training.steps=3", "--metrics.validate=true",
                f"--checkpoint.init_from_hf={out}")
        )
    )  # fmt: skip
    # Validation at step 0 of the new run sees exactly the weights the first run ended with.
    assert again.val_losses[0] == first.val_losses[3]


def test_bad_export_and_import_requests_are_refused(trained, corpus, tmp_path):
    run_dir, _, _ = trained
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="already holds files; pass --overwrite"):
        export_hf(run_dir, target)
    with pytest.raises(ValueError, match=r"notes.txt is a file, not a directory: give a folder"):
        export_hf(run_dir, target / "notes.txt")
    export_hf(run_dir, target, overwrite=True)
    assert (target / "notes.txt").read_text() == "mine"  # --overwrite replaces only export files
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    assert parse_size("2MiB") == 2 * 2**20
    # Import into another model shape names the field.
    with pytest.raises(ValueError, match=r"model.dim=32 but dim=64"):
        train(
            load_config(
                job(corpus, tmp_path, "--model.dim=32", f"--checkpoint.init_from_hf={target}")
            )
        )
    # A truncated safetensors file is reported as such.
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        train(load_config(job(corpus, tmp_path, f"--checkpoint.init_from_hf={target}")))


def test_a_damaged_checkpoint_never_replaces_an_export(trained, tmp_path):
    """--overwrite removes the previous export only once the new checkpoint has been read."""
    import shutil

    run_dir, _, _ = trained
    target = tmp_path / "out"
    export_hf(run_dir, target, dtype="fp32")
    before = {f.name: f.read_bytes() for f in target.iterdir()}
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shard = copy / "checkpoints" / "step-0000003" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(b"\0" * len(data))  # the same size: its digest differs
    with pytest.raises(ValueError, match=r"__0_0\.distcp is corrupted: its SHA-256 differs"):
        export_hf(copy, target, overwrite=True)
    shard.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"__0_0\.distcp was written with"):
        export_hf(copy, target, overwrite=True)
    assert {f.name: f.read_bytes() for f in target.iterdir()} == before


def test_cli_export(trained, tmp_path, capsys):
    run_dir, _, _ = trained
    assert main(["export", str(run_dir), str(tmp_path / "x"), "--dtype", "fp32"]) == 0
    assert json.loads((tmp_path / "x" / "config.json").read_text())["dtype"] == "float32"
    assert main(["export", str(run_dir), str(tmp_path / "x")]) == 2
    assert "--overwrite" in capsys.readouterr().err
