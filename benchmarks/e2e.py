"""End-to-end training throughput of what users run: graphtrain's trainer against plain
torch.compile of the same model and against torchtitan's Llama 3 trainer, one GPU.

    python benchmarks/e2e.py [--model 1b] [--seq-len 4096] [--batch 2] [--grad-accum 1] \\
        [--steps 20] [--warmup 5]
    python benchmarks/e2e.py --model moe-1b --batch 4 --force-balance   # random balanced routing
    python benchmarks/e2e.py --fp8 --model 3b --batch 1                 # and --fp8 --model moe-1b
    python benchmarks/e2e.py --variant=--optim.implementation=graphtrain   # one more trainer row

Every row trains on the same packed micro-batches of real text (the default run's embedded
corpus and tokenizer): the graphtrain row draws them from the trainer's own loader, the others
replay them. bf16 autocast with fp32 master weights, AdamW, a constant learning rate
(optim.lr), gradients clipped at optim.max_norm, --grad-accum micro-batches per step.
  * torch.compile (plain): the models/ model built and initialised as the trainer does, every
    block and the head+loss compiled with plain Inductor, in a hand-written loop (per
    micro-batch: autocast forward and backward with the loss weighted by its share of the
    step's labelled tokens; then clip, AdamW; MoE: no expert-bias updates, which the trainer
    runs as a step hook). Its attention inputs are the trainer's
    (graphtrain.step.model_inputs): FlexAttention with the same-document causal mask on CUDA
    (SDPA with that mask as a block-diagonal one on CPU), so document masking does not differ.
  * graphtrain: the `graphtrain train` code path: build_run (loader, parallel wrappers, the
    default graph passes, optimizer, schedules) and its TrainStep per step (gradient
    accumulation, fp32 gradient finishing, clipping, step statistics, the FLOPs count). Left
    out of the loop: its log steps (one host sync every metrics.log_interval steps),
    validation and checkpoints.
  * torchtitan: torchtitan==0.3.0 (the `peer` extra), its Trainer driven step by step through
    Trainer.train_step with the same batches. Its Llama 3 model with graphtrain's dims (heads,
    kv heads, FFN width, vocabulary, RoPE theta, tied or not), compile of model and loss, its
    defaults otherwise: FSDP2's mixed precision on a one-rank mesh (fp32 master weights, bf16
    compute), CUDA graphs, the chunked loss, its own init (so its loss differs by init) and
    weight decay on every parameter; activation checkpointing off as in the other rows. It
    masks documents by the positions the loader resets at every document start (block-causal
    FlexAttention): the same mask. Dense models only; where it cannot run (not installed, no
    CUDA, an error on this torch) its row says why instead of numbers.
--fp8: rows torch.compile (plain) bf16, graphtrain bf16, graphtrain with training.fp8; the FP8
loss after the same steps must lie within FP8_LOSS_RTOL of the plain bf16 row's.
--variant="--SECTION.KEY=VALUE ..." (repeatable): one more graphtrain row with these overrides on
top of the others (an A/B of a default in the same process: the plain row, the tokenised corpus
and the Inductor cache are shared, so each costs its compile and steps only). Its row is named
after its overrides; one that drew other batches than the first graphtrain row says so.

Each row: tokens/s and MFU over the timed steps after the warm-up (MFU from graphtrain's exact
FLOPs of the very batches, document-causal attention pairs included: graphtrain.metrics.flops),
peak memory, and the loss of the last step. The table goes to benchmarks/RESULTS.md (record());
--device cpu runs the same rows on tiny shapes with nothing recorded (tests/test_e2e_benchmark.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import shlex
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tensordict import TensorDict

from graphtrain.attention import resolve_attention
from graphtrain.config import JOB_PRESETS, JobConfig, load_config
from graphtrain.metrics import model_training_flops, peak_flops
from graphtrain.optim import WorkingWeights, optimizer_from_config
from graphtrain.run import build_run
from graphtrain.step import ForwardLoss
from models import MODEL_PRESETS, build_model
from models.moe import MoEConfig

GIB = 2**30
# FP8 against bf16, loss after the same steps, relative. Per-tensor current scaling keeps each
# GEMM's signal-to-noise ratio near E4M3's ~30 dB (tests/custom_ops/test_fp8_linear.py), an
# error that averages out over the tokens of a step: published FP8 recipes (TransformerEngine,
# torchao) stay within ~1% of the bf16 loss curve; 2% leaves room for the short, high-loss
# start of training measured here, while a broken scale (a factor off) moves it by far more.
FP8_LOSS_RTOL = 0.02


@dataclasses.dataclass
class Row:
    name: str
    note: str = ""  # "not run: why" in place of numbers
    tokens_per_s: float = math.nan
    mfu: float = math.nan
    peak_mem_gib: float = math.nan
    warmup_s: float = math.nan
    loss: float = math.nan  # the last step's mean loss over its labelled tokens


Step = Callable[[int], torch.Tensor]  # step(i) trains optimizer step i, returns its loss


def job_config(
    args: argparse.Namespace, run_dir: str, *, fp8: bool = False, variant: str = ""
) -> JobConfig:
    """The job every row trains: the model's job preset at the benchmark's shape, a constant
    learning rate (warm-up and decay off), nothing written but the run directory; a --variant
    row's overrides last."""
    return load_config(
        [
            "--preset",
            args.model,
            f"--training.device={args.device}",
            f"--training.seq_len={args.seq_len}",
            f"--training.micro_batch_size={args.batch}",
            f"--training.steps={args.warmup + args.steps}",
            f"--training.fp8={str(fp8).lower()}",
            f"--training.run_dir={run_dir}",
            f"--schedule.batch_size={args.grad_accum * args.batch * args.seq_len}",
            "--schedule.warmup_steps=0",
            "--schedule.decay_ratio=0",
            "--checkpoint.final=false",
            "--metrics.tensorboard=false",
            *(["--model.force_balance=true"] if args.force_balance else []),
            *args.set,
            *shlex.split(variant),
        ]
    )


def _fresh_device(device: torch.device) -> None:
    """The last row's model, optimizer and compiled code gone; peak memory counted anew."""
    torch._dynamo.reset()  # its caches hold the compiled modules
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(
    name: str, cfg: JobConfig, step: Step, step_batches: list[list[TensorDict]], warmup: int
) -> Row:
    """Run steps 0 .. cfg.training.steps - 1, timing those after `warmup` on the host clock
    with the device synchronised at both ends; step_batches[i] holds step i's micro-batches
    once it ran (a replaying row reads them, the trainer's row appends what its loader drew)."""
    device = torch.device(cfg.training.device)
    start = time.perf_counter()
    for i in range(warmup):
        step(i)
    _sync(device)
    timed_from = time.perf_counter()
    for i in range(warmup, cfg.training.steps):
        loss = step(i)
    _sync(device)
    seconds = time.perf_counter() - timed_from
    timed = [batch for batches in step_batches[warmup : cfg.training.steps] for batch in batches]
    flops = sum(
        model_training_flops(
            cfg.model,
            num_tokens=batch["input_ids"].numel(),
            num_attention_pairs=int(batch["num_attention_pairs"]),
        )
        for batch in timed
    )
    peak = peak_flops(device, torch.bfloat16)
    return Row(
        name,
        tokens_per_s=sum(batch["input_ids"].numel() for batch in timed) / seconds,
        mfu=flops / seconds / peak if peak else math.nan,
        peak_mem_gib=torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else math.nan,
        warmup_s=timed_from - start,
        loss=float(loss),
    )


# ------------------------------------------------------------------------------------------
# The rows


def graphtrain_row(name: str, cfg: JobConfig, warmup: int) -> tuple[Row, list, Path | None]:
    """The trainer's own step on batches from its own loader; (row, the batches of every step,
    the tokenizer file the loader used)."""
    device = torch.device(cfg.training.device)
    _fresh_device(device)
    run = build_run(cfg, device, rank=0, world_size=1)
    loader, consumed, step_batches = iter(run.data.train), 0, []

    def step(i: int) -> torch.Tensor:
        nonlocal consumed
        batches = [next(loader) for _ in range(run.train_step.num_micro_batches(consumed))]
        step_batches.append(batches)
        stats = run.train_step(batches, step=i)
        consumed += stats.tokens
        return stats.loss

    row = measure(name, cfg, step, step_batches, warmup)
    run.metrics.close()
    tokenizer = run.data.tokenizer
    return row, step_batches, tokenizer.path if tokenizer is not None else None


def variant_row(args: argparse.Namespace, run_dir: str, variant: str, step_batches: list) -> Row:
    """The trainer's step with a --variant's overrides; a row that says why where it fails (the
    rows measured before it are kept)."""
    name = f"graphtrain{' bf16' if args.fp8 else ''} {variant}"
    try:
        row, batches, _ = graphtrain_row(
            name, job_config(args, run_dir, variant=variant), args.warmup
        )
    except Exception as e:
        return Row(name, note=_not_run(e))
    if not _same_batches(batches, step_batches):
        row.name += " (other batches)"
    return row


def _same_batches(a: list[list[TensorDict]], b: list[list[TensorDict]]) -> bool:
    """The same micro-batches of the same tokens, step by step."""
    return [len(x) for x in a] == [len(y) for y in b] and all(
        torch.equal(x["input_ids"], y["input_ids"])
        for xs, ys in zip(a, b, strict=True)
        for x, y in zip(xs, ys, strict=True)
    )


def _plain_compile(model: torch.nn.Module, backend: str) -> None:
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=True)
    model.head_loss = torch.compile(model.head_loss, backend=backend, fullgraph=True)


def plain_compile_row(name: str, cfg: JobConfig, step_batches: list, warmup: int) -> Row:
    """The same model and init under plain torch.compile, in the loop a user would write."""
    device = torch.device(cfg.training.device)
    _fresh_device(device)
    with torch.device("meta"):
        model = build_model(cfg.model)
    # The trainer's inner backend: Inductor on the GPU (aot_eager keeps CPU tests fast).
    _plain_compile(model, cfg.compile.backend)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.training.seed)
    model.train()
    optim = cfg.optim
    optimizer = optimizer_from_config(model, optim)
    # bf16 autocast over fp32 parameters on CUDA, fp32 on CPU: training.dtype=auto's choice.
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    # What a user writes: autocast casts the fp32 weights per use (no working copies).
    no_copies = WorkingWeights(model, [], torch.bfloat16)
    forward = ForwardLoss(
        model, device, resolve_attention(cfg.training.attention, device), autocast, no_copies
    )

    def step(i: int) -> torch.Tensor:
        batches = step_batches[i]
        num_labels = sum(batch["num_label_tokens"] for batch in batches)
        step_loss = torch.zeros((), device=device)
        for batch in batches:
            weight = batch["num_label_tokens"] / max(num_labels, 1)
            loss = forward(batch)
            (loss * weight).backward()
            step_loss += loss.detach().float() * weight
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.max_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return step_loss

    return measure(name, cfg, step, step_batches, warmup)


def torchtitan_row(
    name: str, cfg: JobConfig, step_batches: list, warmup: int, tokenizer: Path | None
) -> Row:
    """torchtitan's Llama 3 trainer on the same batches, or a row that says why not."""
    device = torch.device(cfg.training.device)
    if isinstance(cfg.model, MoEConfig):
        return Row(name, note="not run: this benchmark drives torchtitan's Llama 3 (dense) trainer")
    if device.type != "cuda":
        return Row(name, note="not run: torchtitan's trainer needs CUDA")
    try:
        import torchtitan  # noqa: F401
    except ImportError as e:
        return Row(name, note=f"not run: torchtitan is not importable ({e})")
    _fresh_device(device)
    try:
        trainer = _torchtitan_trainer(cfg, tokenizer, micro_batches=len(step_batches[0]))
    except Exception as e:  # a peer that fails on this torch is a row that says so
        return Row(name, note=_not_run(e))
    try:
        return _torchtitan_measure(name, cfg, trainer, step_batches, warmup)
    except Exception as e:
        return Row(name, note=_not_run(e))
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _not_run(error: BaseException) -> str:
    """ "not run: " and the root cause's type and first line (Dynamo wraps the real error)."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).strip().splitlines()
    return f"not run: {type(error).__name__}: {lines[0] if lines else ''}".replace("|", "/")


def _torchtitan_trainer(cfg: JobConfig, tokenizer: Path | None, *, micro_batches: int):
    """A torchtitan 0.3.0 Trainer whose Llama 3 model has cfg.model's dims (built as its own
    flavors are, torchtitan/models/llama3/__init__.py), one rank, compile on, `micro_batches`
    per step."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.trainer import Trainer

    class ReplayedBatches(BaseDataLoader):
        """Its Trainer builds a loader; the batches come from graphtrain's, replayed
        (_torchtitan_measure), so this one is never iterated."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config: Config, **kwargs) -> None:
            self.config = config

        def __iter__(self):
            raise RuntimeError("the benchmark feeds torchtitan's train_step itself")

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    m, training = cfg.model, cfg.training
    model = Llama3Model.Config(
        dim=m.dim,
        vocab_size=m.vocab_size,
        enable_weight_tying=m.tie_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=m.vocab_size,
            embedding_dim=m.dim,
            param_init=llama3._EMBEDDING_INIT,
        ),
        norm=RMSNorm.Config(normalized_shape=m.dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=m.dim,
            out_features=m.vocab_size,
            param_init=llama3._output_linear_init(m.dim),
        ),
        layers=llama3._build_llama3_layers(
            n_layers=m.num_layers,
            dim=m.dim,
            n_heads=m.num_heads,
            n_kv_heads=m.num_kv_heads,
            hidden_dim=m.ffn_dim,
            rope=ComplexRoPE.Config(dim=m.head_dim, max_seq_len=m.max_seq_len, theta=m.rope_theta),
            attn_backend="flex",
        ),
    )
    spec = dataclasses.replace(llama3.model_registry("debugmodel"), flavor="e2e", model=model)
    # Its assets and dump folder beside the run directory (the benchmark's temporary one).
    assets = Path(training.run_dir).parent / "torchtitan"
    assets.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:  # its trainer loads one; the batches come tokenized already
        (assets / "tokenizer.json").write_bytes(Path(tokenizer).read_bytes())
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29533")
    config = Trainer.Config(
        model_spec=spec,
        hf_assets_path=str(assets),
        dataloader=ReplayedBatches.Config(),
        dump_folder=str(assets),
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=m.vocab_size)
        ),
        optimizer=default_adamw(
            lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay
        ),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0),
        training=TrainingConfig(
            local_batch_size=training.micro_batch_size,
            global_batch_size=micro_batches * training.micro_batch_size,
            seq_len=training.seq_len,
            steps=training.steps,
            max_norm=cfg.optim.max_norm,
        ),
        # It logs (a host sync) at step 1 and every log_freq steps: only in the warm-up here.
        metrics=MetricsProcessor.Config(log_freq=training.steps + 1),
        activation_checkpoint=None,
        compile=CompileConfig(enable=True, components=["model", "loss"]),
    )
    config.debug.seed = training.seed
    return Trainer(config)


def _torchtitan_measure(name: str, cfg: JobConfig, trainer, step_batches: list, warmup: int) -> Row:
    losses: list[torch.Tensor] = []
    forward_backward = trainer.forward_backward_step

    def forward_backward_step(**kwargs) -> torch.Tensor:
        # Its loss is the micro-batch's summed token loss over the step's labelled tokens, so
        # the micro-batches' losses add up to the step's mean. Cloned: a CUDA graph replay
        # overwrites its output.
        loss = forward_backward(**kwargs)
        losses.append(loss.detach().clone())
        return loss

    trainer.forward_backward_step = forward_backward_step
    # Its batches: ({"input", "positions"}, labels) with -100 where no label, as graphtrain's.
    micro_batches = iter(
        [
            ({"input": b["input_ids"], "positions": b["position_ids"]}, b["labels"])
            for batches in step_batches
            for b in batches
        ]
    )
    data = trainer.batch_generator(micro_batches)

    def step(i: int) -> torch.Tensor:
        losses.clear()
        trainer.step = i + 1  # as Trainer.train counts
        trainer.train_step(data)
        return torch.stack(losses).sum()

    return measure(name, cfg, step, step_batches, warmup)


# ------------------------------------------------------------------------------------------
# Table


def rows_for(args: argparse.Namespace, rows: list[Row]) -> None:
    """Every row of the run into `rows` as it is measured, most important first: graphtrain's
    (its loader draws the batches the others replay), plain torch.compile, the FP8 and
    --variant rows, torchtitan. A run stopped part-way (the GPU stage's cap) keeps the rows it
    measured."""
    with tempfile.TemporaryDirectory(prefix="e2e-") as tmp:
        cfg = job_config(args, f"{tmp}/bf16")
        precision = " bf16" if args.fp8 else ""
        row, step_batches, tokenizer = graphtrain_row(f"graphtrain{precision}", cfg, args.warmup)
        rows.append(row)
        plain = f"torch.compile (plain){precision}"
        rows.insert(0, plain_compile_row(plain, cfg, step_batches, args.warmup))
        if args.fp8:
            fp8_cfg = job_config(args, f"{tmp}/fp8", fp8=True)
            rows.append(graphtrain_row("graphtrain fp8", fp8_cfg, args.warmup)[0])
        for i, variant in enumerate(args.variant):
            rows.append(variant_row(args, f"{tmp}/v{i}", variant, step_batches))
        if not args.fp8:
            rows.append(
                torchtitan_row("torchtitan 0.3.0", cfg, step_batches, args.warmup, tokenizer)
            )


def table(rows: list[Row], args: argparse.Namespace) -> str:
    plain = rows[0].name.startswith("torch.compile")  # not there: a run stopped before it
    base = rows[0].tokens_per_s if plain else math.nan
    steps = args.warmup + args.steps
    lines = [
        f"| run | tokens/s | MFU | peak mem GiB | vs plain | warm-up s | loss after {steps} steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.note:
            lines.append(f"| {r.name} | {r.note} | | | | | |")
            continue
        lines.append(
            f"| {r.name} | {r.tokens_per_s:,.0f} | {r.mfu:.1%} | {r.peak_mem_gib:.1f} | "
            f"{r.tokens_per_s / base:.2f}x | {r.warmup_s:.0f} | {r.loss:.3f} |"
        )
    fp8 = [r.loss for r in rows if r.name == "graphtrain fp8"]
    if fp8 and plain:
        fp8, bf16 = fp8[0], rows[0].loss
        verdict = "within" if abs(fp8 - bf16) <= FP8_LOSS_RTOL * abs(bf16) else "NOT within"
        lines.append(
            f"\nFP8 loss {fp8:.3f} against plain bf16 {bf16:.3f}: {verdict} "
            f"{FP8_LOSS_RTOL:.0%} (FP8_LOSS_RTOL)"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="1b", choices=list(JOB_PRESETS), help="job preset")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument(
        "--force-balance",
        action="store_true",
        help="MoE models: random routing with a straight-through gradient (balanced load)",
    )
    parser.add_argument(
        "--fp8", action="store_true", help="rows with training.fp8 against plain bf16"
    )
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: the rows on tiny shapes for tests; nothing is recorded",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="--SECTION.KEY=VALUE",
        help="a config override for every row (repeatable), e.g. --set=--data.paths=docs.jsonl",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar='"--SECTION.KEY=VALUE ..."',
        help="one more graphtrain row with these overrides (repeatable): an A/B of a default",
    )
    args = parser.parse_args(argv)
    for name in ("batch", "grad_accum", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    model = MODEL_PRESETS[JOB_PRESETS[args.model]["model"]]
    if args.force_balance and not isinstance(model, MoEConfig):
        parser.error(f"--force-balance needs an MoE model; {args.model} is dense")
    # A misspelt key or a bad value fails here, not after some rows ran on the GPU.
    for variant in ["", *args.variant]:
        try:
            job_config(args, tempfile.gettempdir(), variant=variant)
        except ValueError as e:
            parser.error(f"--variant={variant!r}: {e}" if variant else str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("benchmarks/e2e.py needs a CUDA GPU (--device cpu only checks the rows run)")
    return args


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    rows: list[Row] = []
    try:
        rows_for(args, rows)
    except KeyboardInterrupt:  # the stage's cap (SIGINT): record what was measured
        if not rows:
            raise
        rows.append(Row("(the rest)", note="not run: stopped by SIGINT (the stage's time cap)"))
    text = table(rows, args)
    if args.device == "cpu":
        print(text)
        return rows
    from harness import record  # run as a script: benchmarks/ is on sys.path

    force = " (force_balance)" if args.force_balance else ""
    title = (
        f"e2e {args.model}{force}{', fp8' if args.fp8 else ''}: the trainer's step, seq "
        f"{args.seq_len}, batch {args.batch} x {args.grad_accum} micro-batches, bf16 autocast, "
        "fp32 master weights, packed default corpus"
    )
    record(title, text)
    return rows


if __name__ == "__main__":
    main()
