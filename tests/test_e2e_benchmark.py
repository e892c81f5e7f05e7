"""benchmarks/e2e.py's rows on CPU (debug model, a few steps): the trainer's step, the plain
torch.compile loop and the torchtitan row run, so a change to the trainer's build or step
breaks here rather than on the GPU; the GPU stages' e2e.py commands parse. Nothing is timed or
recorded."""

import functools
import importlib.util
import math
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from graphtrain.attention import document_causal_mask
from graphtrain.config import load_config
from graphtrain.optim import lr_schedule_from_config
from models import build_model

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def e2e():
    if str(BENCHMARKS) not in sys.path:  # its harness, as when it runs as a script
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("e2e_benchmark", BENCHMARKS / "e2e.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _args(corpus: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--device=cpu",
        "--model=debug",
        "--seq-len=32",
        "--batch=2",
        "--grad-accum=2",
        "--warmup=2",  # the learning rate's warm-up: lr / 2, lr, then constant
        "--steps=1",
        f"--set=--data.paths={corpus / 'docs.jsonl'}",
        f"--set=--data.tokenizer={corpus / 'tokenizer.json'}",
        f"--set=--data.cache_dir={tmp_path / 'cache'}",
        "--set=--compile.backend=aot_eager",
        *extra,
    ]


def test_rows_train_the_same_batches_alike_and_fp8_stays_close(e2e, corpus, tmp_path, capsys):
    # fp8.min_dim=16 lets the debug model's linears run in FP8 (the reference kernels on CPU).
    # Two variant rows: graphtrain's AdamW (an A/B of optim.implementation) and another seed
    # (other batches, which its name must say).
    copies, seed = "--optim.implementation=graphtrain", "--training.seed=1"
    variants = [f"--variant={copies}", f"--variant={seed}"]
    rows = e2e.main(_args(corpus, tmp_path, "--fp8", "--set=--fp8.min_dim=16", *variants))
    assert [r.name for r in rows] == [
        "torch.compile (plain) bf16",
        "graphtrain bf16",
        "graphtrain fp8",
        f"graphtrain bf16 {copies}",
        f"graphtrain bf16 {seed} (other batches)",
    ]
    for row in rows:
        assert not row.note and row.tokens_per_s > 0 and math.isfinite(row.loss)
        assert math.isnan(row.mfu) and math.isnan(row.peak_mem_gib)  # no peak FLOPs on CPU
    plain, bf16, fp8, adamw_copies, other_seed = rows
    # The same steps with graphtrain's AdamW kernel (its CPU reference: torch's foreach ops in
    # another order than the fused kernel): a few fp32 roundings apart after three steps.
    assert adamw_copies.loss == pytest.approx(bf16.loss, rel=1e-5)
    assert other_seed.loss != bf16.loss
    # Same model, init, batches (the trainer's loader, replayed), optimizer and learning rate by
    # step, fp32 on CPU, numerics-preserving default passes: the hand-written loop and the
    # trainer's step give the same loss after three steps of two micro-batches, but for the
    # clip: torch's and graphtrain's sum the norm in other orders, and the warm-up's steps clip
    # (7e-8 apart, measured; bitwise with optim.max_norm=100). A loop without the warm-up, at
    # lr from step 0, is 7e-3 apart (tried).
    assert bf16.loss == pytest.approx(plain.loss, rel=1e-6, abs=0)
    assert fp8.loss != bf16.loss  # FP8 did change the GEMMs
    assert fp8.loss == pytest.approx(plain.loss, rel=e2e.FP8_LOSS_RTOL)
    out = capsys.readouterr().out
    assert "within 2% (FP8_LOSS_RTOL)" in out
    # Every row's loss by step (3 steps), the last one the row's.
    by_step = next(line for line in out.splitlines() if line.startswith("graphtrain bf16: loss"))
    assert by_step.split()[-1] == f"{bf16.loss:.3f}" and len(by_step.split()) == 5 + 3


def test_the_plain_row_steps_torchs_adamw(e2e):
    # optim.implementation "auto" takes graphtrain's AdamWCopies for fp32 parameters on CUDA
    # ("graphtrain" here, on CPU); the plain row is what a user writes: torch's AdamW, fused
    # unless the job asks for foreach, with the job's groups and hyperparameters.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    for implementation in ("auto", "graphtrain", "fused", "foreach"):
        cfg = load_config(["--preset=debug", f"--optim.implementation={implementation}"])
        optimizer = e2e.torch_adamw(model, cfg.optim)
        assert type(optimizer) is torch.optim.AdamW, implementation
        assert optimizer.defaults["fused"] is (implementation != "foreach"), implementation
        assert [g["weight_decay"] for g in optimizer.param_groups] == [cfg.optim.weight_decay, 0]


def test_torchtitan_row_says_why_it_did_not_run(e2e, tmp_path):
    args = e2e.parse_args(["--device=cpu", "--model=debug", "--seq-len=64"])
    row = e2e.torchtitan_row(e2e.TORCHTITAN, e2e.job_config(args, str(tmp_path)), [], 0, None)
    assert row.note == "not run: torchtitan's trainer needs CUDA" and math.isnan(row.loss)
    text = e2e.table([e2e.Row("plain", tokens_per_s=10.0, loss=1.0), row], args)
    assert "| torchtitan 0.2.2 | not run: torchtitan's trainer needs CUDA |" in text
    # Models it has no counterpart of: refused by name (its row says so on a GPU).
    for model, extra, why in [
        ("hybrid-debug", [], "no Gated DeltaNet model"),
        ("debug", ["--set=--model.mtp_depth=1"], "no MTP (model.mtp_depth=1)"),
    ]:
        args = e2e.parse_args(["--device=cpu", f"--model={model}", "--seq-len=64", *extra])
        with pytest.raises(ValueError, match=re.escape(why)):
            e2e.torchtitan_model(e2e.job_config(args, str(tmp_path)), 0)


@pytest.fixture
def torchtitan_on_cpu(monkeypatch):
    """torchtitan 0.2.2 (the dev extra) on CPU: its modules' CUDA device and memory monitor
    become CPU's and a stub; its FlexAttention (no CPU backward) becomes SDPA with the block
    mask (built on CPU, uncompiled) made dense, which records that mask; its MoE takes its
    CPU index path and an integer histc CPU lacks. Returns the masks it attends with."""
    import torchtitan.components.metrics as metrics
    import torchtitan.models.attention as attention
    import torchtitan.models.moe.utils as moe_utils

    # Every module that took CUDA as its device loaded before the sweep below.
    importlib.import_module("torchtitan.models.qwen3")
    importlib.import_module("torchtitan.train")
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    for module in [m for name, m in sys.modules.items() if name.startswith("torchtitan")]:
        if getattr(module, "device_type", None) == "cuda":
            monkeypatch.setattr(module, "device_type", "cpu")
        if getattr(module, "device_module", None) is torch.cuda:
            monkeypatch.setattr(module, "device_module", torch.cpu)

    class NoDeviceMemory:
        device_name = "cpu"

        def reset_peak_stats(self):
            pass

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0, 0, 0, 0, 0, 0)

    monkeypatch.setattr(metrics, "build_device_memory_monitor", NoDeviceMemory)
    masks = []

    def sdpa(q, k, v, *, block_mask, scale=None, enable_gqa=False, return_lse=False):
        B, T = block_mask.shape[0], q.shape[-2]
        masks.append(create_mask(block_mask.mask_mod, B, None, T, T, device=q.device))
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=masks[-1], scale=scale, enable_gqa=enable_gqa
        )

    monkeypatch.setattr(attention.FlexAttentionWrapper, "_compiled_flex_attn", sdpa)
    block_mask = functools.partial(create_block_mask, device="cpu")  # its default: CUDA
    monkeypatch.setattr(attention, "_compiled_create_block_mask", block_mask)
    permute = moe_utils.generate_permute_indices
    monkeypatch.setattr(
        moe_utils, "generate_permute_indices", functools.partial(permute, use_cpu=True)
    )
    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda x, *a, **kw: histc(x.float(), *a, **kw).to(x.dtype))
    return masks


@pytest.mark.parametrize("model", ["debug", "moe-debug"])
def test_torchtitan_trains_our_dims_on_our_batches(e2e, corpus, tmp_path, torchtitan_on_cpu, model):
    # Its model for ours (dense: Llama 3; MoE: Qwen3 with our layers' layout): the same
    # parameter count; fed the same tokens, positions and labels, it attends within documents
    # as ours does; the row's loss is its step's mean token loss (its own init: not ours).
    balance = ["--force-balance"] if model.startswith("moe") else []
    args = e2e.parse_args(_args(corpus, tmp_path, f"--model={model}", *balance))
    cfg = e2e.job_config(args, str(tmp_path / "run"))
    _, step_batches, eos_id = e2e.graphtrain_row("graphtrain", cfg, args.warmup)
    trainer = e2e.torchtitan_trainer(cfg, eos_id, micro_batches=args.grad_accum)
    seen, labels, sums, lrs = [], [], [], []
    optimizer = trainer.optimizers.optimizers[0]

    def record(module, inputs, kwargs):
        seen.append((inputs[0], kwargs["positions"]))
        lrs.append(optimizer.param_groups[0]["lr"])  # what this step's update will use

    trainer.model_parts[0].register_forward_pre_hook(record, with_kwargs=True)
    loss_fn = trainer.loss_fn

    def recording_loss(pred, y):
        labels.append(y)
        sums.append(
            torch.nn.functional.cross_entropy(pred.flatten(0, 1), y.flatten(), reduction="sum")
        )
        return loss_fn(pred, y)

    trainer.loss_fn = recording_loss
    try:
        row = e2e.torchtitan_measure("torchtitan", cfg, trainer, step_batches, args.warmup)
    finally:
        e2e.close_torchtitan(trainer)
    with torch.device("meta"):
        reference = build_model(cfg.model)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(trainer.model_parts[0]) == count(reference)
    batches = [b for step in step_batches for b in step]
    assert len(seen) == len(batches) == (args.warmup + args.steps) * args.grad_accum
    for (tokens, positions), y, batch in zip(seen, labels, batches, strict=True):
        assert torch.equal(tokens, batch["input_ids"])
        assert torch.equal(positions, batch["position_ids"])
        assert torch.equal(y, batch["labels"])
    # Our learning rate by step: the warm-up over the untimed steps, then constant.
    schedule = lr_schedule_from_config(cfg)
    want = [
        schedule.lr_at(i) for i in range(args.warmup + args.steps) for _ in range(args.grad_accum)
    ]
    assert lrs == pytest.approx(want, rel=1e-12) and want[0] < want[-1]
    assert batches[0]["document_ids"].max() > 0  # several documents: not the causal mask
    assert torch.equal(torchtitan_on_cpu[0], document_causal_mask(batches[0]["document_ids"]))
    last = sum(sums[-args.grad_accum :]) / sum(b["num_label_tokens"] for b in step_batches[-1])
    assert not row.note and row.loss == pytest.approx(last.item(), rel=1e-5)


def test_a_failing_variant_is_a_row_that_says_why(e2e, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("the variant's build failed\nsecond line")

    monkeypatch.setattr(e2e, "graphtrain_row", fail)
    args = e2e.parse_args(
        ["--device=cpu", "--model=debug", "--seq-len=64", "--variant=--training.fp8=true"]
    )
    row = e2e.variant_row(args, str(tmp_path), args.variant[0], [])
    assert row.name == "graphtrain --training.fp8=true"
    assert row.note == "not run: RuntimeError: the variant's build failed"


def test_a_run_stopped_part_way_keeps_the_rows_it_measured(e2e, monkeypatch, capsys):
    # The GPU stage's cap sends SIGINT: the rows measured so far still make the table.
    measured = e2e.Row("graphtrain", tokens_per_s=5.0, loss=2.0)
    monkeypatch.setattr(e2e, "graphtrain_row", lambda *args: (measured, [], None))

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(e2e, "plain_compile_row", interrupted)
    rows = e2e.main(["--device=cpu", "--model=debug", "--seq-len=64"])
    assert rows[0] is measured and "stopped by SIGINT" in rows[1].note
    assert "| graphtrain | 5 | nan% | nan | nanx |" in capsys.readouterr().out  # no plain row


def test_every_benchmark_keeps_the_rows_measured_before_the_cap(e2e):
    # harness.rows_until_cap, as every benchmark that records a table fills it: rows kept, a cut
    # row last; none measured, the interrupt goes on (the stage's log says the item was cut).
    import harness  # benchmarks/ is on sys.path: the e2e fixture put it there

    def stopped_after(n, rows):
        def fill():
            rows.extend(f"row {i}" for i in range(n))
            raise KeyboardInterrupt

        return fill

    rows = ["header"]
    kept = harness.rows_until_cap(rows, stopped_after(2, rows), f"cut: {harness.CUT}")
    assert kept == ["header", "row 0", "row 1", "cut: " + harness.CUT] and kept is rows
    rows = ["header"]
    with pytest.raises(KeyboardInterrupt):
        harness.rows_until_cap(rows, stopped_after(0, rows), "cut")
    assert rows == ["header"]
    assert harness.rows_until_cap(rows, lambda: rows.append("row"), "cut") == ["header", "row"]


def test_a_failed_rows_cell_names_the_root_cause_in_one_line(e2e, capsys):
    import harness

    try:
        try:
            raise ValueError("shape | mismatch\nthe second line of a long story")
        except ValueError as cause:
            raise RuntimeError("backend='inductor' raised:") from cause
    except RuntimeError as e:
        cell = harness.why_not(e, "skipped")
    assert cell == "skipped: ValueError: shape / mismatch"
    assert "backend='inductor' raised" in capsys.readouterr().err  # the whole story, for the log


def test_a_failing_plain_or_fp8_row_says_why_and_plain_can_come_last(e2e, monkeypatch):
    # An Inductor error or an out-of-memory in the plain or the FP8 row loses no row measured
    # before it; --plain-last measures plain's row after the variants (listed first still).
    order = []

    def graphtrain_row(name, cfg, warmup):
        order.append(name)
        if name == "graphtrain fp8":
            raise RuntimeError("the FP8 row failed\nsecond line")
        return e2e.Row(name, tokens_per_s=5.0, loss=2.0), [], None

    def plain_compile_row(name, *args):
        order.append(name)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    def variant_row(args, run_dir, variant, step_batches):
        order.append(variant)
        return e2e.Row(f"graphtrain bf16 {variant}", tokens_per_s=4.0, loss=2.0)

    for name, fn in [("graphtrain_row", graphtrain_row), ("plain_compile_row", plain_compile_row),
                     ("variant_row", variant_row)]:  # fmt: skip
        monkeypatch.setattr(e2e, name, fn)
    seed = "--training.seed=1"
    argv = ["--device=cpu", "--model=debug", "--seq-len=64", "--fp8", f"--variant={seed}"]
    rows = e2e.main([*argv, "--plain-last"])
    plain = "torch.compile (plain) bf16"
    assert order == ["graphtrain bf16", "graphtrain fp8", seed, plain]
    assert [r.name for r in rows] == [
        plain,
        "graphtrain bf16",
        "graphtrain fp8",
        f"graphtrain bf16 {seed}",
    ]
    assert rows[0].note == "not run: OutOfMemoryError: CUDA out of memory"
    assert rows[2].note == "not run: RuntimeError: the FP8 row failed"
    order.clear()
    e2e.main(argv)  # the default: plain's row second
    assert order == ["graphtrain bf16", plain, "graphtrain fp8", seed]


def test_bad_arguments_are_named(e2e, capsys):
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device=cpu", "--model=debug", "--seq-len=8192"])
    assert "training.seq_len=8192 exceeds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device=cpu", "--variant=--optim.implementaton=graphtrain"])
    assert "--variant='--optim.implementaton=graphtrain'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device=cpu", "--model=debug", "--force-balance"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device=cpu", "--steps=0"])


def test_the_gpu_stages_e2e_commands_parse(e2e):
    """Every e2e.py command of benchmarks/gpu_session.sh passes e2e.py's own checks (presets,
    every --set and --variant override against the config), so a misspelt key fails here and
    not minutes into a GPU stage."""
    script = (BENCHMARKS / "gpu_session.sh").read_text().replace("\\\n", " ")
    commands = [
        shlex.split(line.split("e2e.py", 1)[1])
        for line in script.splitlines()
        if line.strip().startswith("bench ") and " e2e.py " in line
    ]
    assert len(commands) >= 5, commands
    for argv in commands:
        args = e2e.parse_args([*argv, "--device=cpu"])
        assert args.model in e2e.JOB_PRESETS, argv
