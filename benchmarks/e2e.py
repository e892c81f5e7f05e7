"""End-to-end training throughput of what users run: graphtrain's trainer against plain
torch.compile of the same model and against torchtitan's trainer, one GPU.

    python benchmarks/e2e.py [--model 1b] [--seq-len 4096] [--batch 2] [--grad-accum 1] \\
        [--steps 20] [--warmup 5]
    python benchmarks/e2e.py --model moe-1b --batch 4 --force-balance   # random balanced routing
    python benchmarks/e2e.py --fp8 --model 3b --batch 1                 # and --fp8 --model moe-1b
    python benchmarks/e2e.py --variant=--optim.implementation=graphtrain   # one more trainer row

Every row trains on the same packed micro-batches of real text (the default run's embedded
corpus and tokenizer): the graphtrain row draws them from the trainer's own loader, the others
replay them. bf16 autocast with fp32 master weights, AdamW, the learning rate warmed up over
the untimed --warmup steps (linear to optim.lr, torchtitan's formula), then constant: the timed
steps are a stable phase (without a warm-up 1b's loss rose from the first step, 2026-11-27),
gradients clipped at optim.max_norm, --grad-accum micro-batches per step.
  * torch.compile (plain): the models/ model built and initialised as the trainer does, every
    block and the head+loss compiled with plain Inductor, in a hand-written loop (per
    micro-batch: autocast forward and backward with the loss weighted by its share of the
    step's labelled tokens; then clip, the step's learning rate from the trainer's schedule,
    torch's fused AdamW; MoE: no expert-bias updates, which the trainer runs as a step hook).
    Its attention inputs are the trainer's
    (graphtrain.step.model_inputs): FlexAttention with the same-document causal mask on CUDA
    (SDPA with that mask as a block-diagonal one on CPU), so document masking does not differ.
  * graphtrain: the `graphtrain train` code path: build_run (loader, parallel wrappers, the
    default graph passes, optimizer, schedules) and its TrainStep per step (gradient
    accumulation, fp32 gradient finishing, clipping, step statistics, the FLOPs count). Left
    out of the loop: its log steps (one host sync every metrics.log_interval steps),
    validation and checkpoints.
  * torchtitan: torchtitan==0.2.2 (the `peer` extra; the newest release that imports on torch
    2.11), its Trainer driven step by step through Trainer.train_step with the same batches.
    Dense: its Llama 3 with graphtrain's dims; MoE: its Qwen3 with MoE layers (GQA without
    Qwen3's q/k norms, our first_k_dense dense layers, shared experts, score function, groups,
    route scaling, expert-bias balancing at our rate, round-robin routing for --force-balance);
    the parameter counts equal ours (tests/test_e2e_benchmark.py). Compile of model and loss,
    its defaults otherwise: bf16 autocast over fp32 weights on one rank, FlexAttention
    compiled with max-autotune (its warm-up is long), the unfused fp32 loss, its own init (so
    its loss differs by init) and weight decay on every parameter; activation checkpointing
    off as in the other rows. It resets RoPE at the loader's positions and masks documents at
    the eos that ends each: the same mask. Where it cannot run (not installed, no CUDA, an
    error on this torch) its row says why instead of numbers.
--fp8: rows torch.compile (plain) bf16, graphtrain bf16, graphtrain with training.fp8; the FP8
loss after the same steps must lie within FP8_LOSS_RTOL of the plain bf16 row's.
--variant="--SECTION.KEY=VALUE ..." (repeatable): one more graphtrain row with these overrides on
top of the others (an A/B of a default in the same process: the plain row, the tokenised corpus
and the Inductor cache are shared, so each costs its compile and steps only). Its row is named
after its overrides; one that drew other batches than the first graphtrain row says so.

Each row: tokens/s and MFU over the timed steps after the warm-up (MFU from graphtrain's exact
FLOPs of the very batches, document-causal attention pairs included: graphtrain.metrics.flops),
peak memory, the timed steps' median, fastest and slowest time (an uneven row shows), and the
loss of the last step. The table goes to benchmarks/RESULTS.md (record());
--device cpu runs the same rows on tiny shapes with nothing recorded (tests/test_e2e_benchmark.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import math
import os
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import CUT, record, rows_until_cap, why_not  # benchmarks/ on sys.path
from tensordict import TensorDict

from graphtrain.attention import resolve_attention
from graphtrain.config import JOB_PRESETS, JobConfig, load_config
from graphtrain.metrics import model_training_flops, peak_flops
from graphtrain.optim import WorkingWeights, lr_schedule_from_config, optimizer_from_config
from graphtrain.run import build_run
from graphtrain.step import ForwardLoss
from models import MODEL_PRESETS, build_model
from models.hybrid import HybridConfig
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
    step_ms: tuple[float, ...] = ()  # each timed step's time (device events on CUDA)


Step = Callable[[int], torch.Tensor]  # step(i) trains optimizer step i, returns its loss


def job_config(
    args: argparse.Namespace, run_dir: str, *, fp8: bool = False, variant: str = ""
) -> JobConfig:
    """The job every row trains: the model's job preset at the benchmark's shape, the learning
    rate warmed up over the untimed steps and constant after them (no decay), nothing written
    but the run directory; a --variant row's overrides last."""
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
            f"--schedule.warmup_steps={args.warmup}",
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
    once it ran (a replaying row reads them, the trainer's row appends what its loader drew).
    Each timed step is also timed alone, between device events on CUDA (no synchronisation
    in between), to show the spread: a slow step (a late compile, a host stall) stands out.
    Prints the loss and time of every step after the timing (kept on the device until then)."""
    device = torch.device(cfg.training.device)
    losses = []
    start = time.perf_counter()
    for i in range(warmup):
        losses.append(torch.as_tensor(step(i)).detach())
    _sync(device)
    timed_from = time.perf_counter()
    marks = [_mark(device)]
    for i in range(warmup, cfg.training.steps):
        losses.append(torch.as_tensor(step(i)).detach())
        marks.append(_mark(device))
    _sync(device)
    seconds = time.perf_counter() - timed_from
    step_ms = tuple(_elapsed_ms(a, b) for a, b in itertools.pairwise(marks))
    print(f"{name}: loss by step " + " ".join(f"{float(x):.3f}" for x in losses), flush=True)
    print(f"{name}: ms by timed step " + " ".join(f"{t:.1f}" for t in step_ms), flush=True)
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
        loss=float(losses[-1]),
        step_ms=step_ms,
    )


def _mark(device: torch.device) -> Any:
    """A point in the step stream: a recorded CUDA event, else the host clock (CPU runs each
    op before returning)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed_ms(a: Any, b: Any) -> float:
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


# ------------------------------------------------------------------------------------------
# The rows


def graphtrain_row(name: str, cfg: JobConfig, warmup: int) -> tuple[Row, list, int | None]:
    """The trainer's own step on batches from its own loader; (row, the batches of every step,
    the loader's document separator: eos_id, None where documents are not marked)."""
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
    return row, step_batches, run.data.train.eos_id


def variant_row(args: argparse.Namespace, run_dir: str, variant: str, step_batches: list) -> Row:
    """The trainer's step with a --variant's overrides; a row that says why where it fails (the
    rows measured before it are kept)."""
    name = f"graphtrain{' bf16' if args.fp8 else ''} {variant}"
    try:
        row, batches, _ = graphtrain_row(
            name, job_config(args, run_dir, variant=variant), args.warmup
        )
    except Exception as e:
        return Row(name, note=why_not(e))
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


def torch_adamw(model: torch.nn.Module, optim: Any) -> torch.optim.Optimizer:
    """What a user writes: torch's AdamW, fused (or foreach where the job asks for it), with the
    job's hyperparameters and groups; never graphtrain's AdamWCopies, which optim.implementation
    "auto" takes for fp32 parameters on CUDA."""
    torch_kernel = optim.implementation if optim.implementation == "foreach" else "fused"
    return optimizer_from_config(model, dataclasses.replace(optim, implementation=torch_kernel))


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
    optimizer = torch_adamw(model, optim)
    lr_schedule = lr_schedule_from_config(cfg)
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
        lr_schedule.apply(optimizer, i)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return step_loss

    return measure(name, cfg, step, step_batches, warmup)


TORCHTITAN = "torchtitan 0.2.2"


def torchtitan_row(
    name: str, cfg: JobConfig, step_batches: list, warmup: int, eos_id: int | None
) -> Row:
    """torchtitan's trainer on the same batches, or a row that says why not."""
    device = torch.device(cfg.training.device)
    if device.type != "cuda":
        return Row(name, note="not run: torchtitan's trainer needs CUDA")
    try:
        import torchtitan  # noqa: F401
    except ImportError as e:
        return Row(name, note=f"not run: torchtitan is not importable ({e})")
    _fresh_device(device)
    trainer = None
    try:
        trainer = torchtitan_trainer(cfg, eos_id, micro_batches=len(step_batches[0]))
        return torchtitan_measure(name, cfg, trainer, step_batches, warmup)
    except Exception as e:  # a peer that fails on this torch is a row that says so
        return Row(name, note=why_not(e))
    finally:
        close_torchtitan(trainer)


def close_torchtitan(trainer) -> None:
    """Its trainer closed (if it was built), the garbage collector it turns off on again, its
    process group gone."""
    if trainer is not None:
        trainer.close()
    gc.enable()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def torchtitan_model(cfg: JobConfig, eos_id: int | None):
    """(torchtitan's train spec name, model class, model args) with cfg.model's dims: dense,
    its Llama 3; MoE, its Qwen3 with MoE layers (GQA without Qwen3's q/k norms, shared experts,
    the first first_k_dense layers dense): the two of its models whose attention is ours."""
    m, seq_len = cfg.model, cfg.training.seq_len
    if isinstance(m, HybridConfig):
        raise ValueError("it has no Gated DeltaNet model (a hybrid model.layer_pattern)")
    if m.mtp_depth:
        raise ValueError(f"its Llama 3 and Qwen3 have no MTP (model.mtp_depth={m.mtp_depth})")
    common = {  # the model args its Llama 3 and Qwen3 share
        "dim": m.dim,
        "n_layers": m.num_layers,
        "n_heads": m.num_heads,
        "n_kv_heads": m.num_kv_heads,
        "vocab_size": m.vocab_size,
        "norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "max_seq_len": seq_len,
        "attn_type": "flex",
        "attn_mask_type": "causal" if eos_id is None else "block_causal",
        "eos_id": -1 if eos_id is None else eos_id,
    }
    if not isinstance(m, MoEConfig):
        from torchtitan.models.llama3 import Transformer, TransformerModelArgs

        if m.tie_embeddings:
            raise ValueError("its Llama 3 has no tied embeddings (model.tie_embeddings=true)")
        # Its FFN width is 8 dim / 3, times ffn_dim_multiplier, rounded up to multiple_of:
        # with multiple_of = ffn_dim and a multiplier that lands in (0, ffn_dim], ffn_dim.
        args = TransformerModelArgs(
            multiple_of=m.ffn_dim, ffn_dim_multiplier=m.ffn_dim / int(8 * m.dim / 3), **common
        )
        return "llama3", Transformer, args

    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import TransformerBlock

    class FirstLayersDense(Qwen3Model):
        def __init__(self, model_args: Qwen3ModelArgs) -> None:
            super().__init__(model_args)
            dense = dataclasses.replace(model_args, moe_enabled=False)
            for layer_id in range(m.first_k_dense):
                self.layers[str(layer_id)] = TransformerBlock(layer_id, dense)

    moe = MoEArgs(
        num_experts=m.num_experts,
        num_shared_experts=m.num_shared_experts,
        score_func=m.score_func,
        route_norm=m.normalize_weights,
        route_scale=m.route_scale,
        score_before_experts=False,  # the weights scale the experts' outputs, as ours
        top_k=m.top_k,
        num_expert_groups=m.num_groups if m.num_groups > 1 else None,
        num_limited_groups=m.topk_groups if m.num_groups > 1 else None,
        load_balance_coeff=m.bias_update_rate if m.expert_bias else None,
    )
    args = Qwen3ModelArgs(
        head_dim=m.head_dim,
        hidden_dim=m.ffn_dim,
        qk_norm=False,
        enable_weight_tying=m.tie_embeddings,
        moe_enabled=True,
        moe_inter_dim=m.moe_ffn_dim,
        moe_args=moe,
        **common,
    )
    return "qwen3", FirstLayersDense, args


def torchtitan_trainer(cfg: JobConfig, eos_id: int | None, *, micro_batches: int):
    """A torchtitan 0.2.2 Trainer (the release that imports on torch 2.11: 0.3.0 needs
    torch.distributed.fsdp's DataParallelMeshDims) for cfg.model's dims (torchtitan_model),
    one rank, model and loss compiled on CUDA (eager on CPU, for tests: its MoE's CPU index
    path does not compile), `micro_batches` per step; no loader (the batches are replayed:
    torchtitan_measure); its tokenizer only names the document separator."""
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.config import JobConfig as TitanConfig
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec
    from torchtitan.train import Trainer

    class DocumentSeparator(BaseTokenizer):
        def __init__(self) -> None:
            super().__init__()
            self.eos_id = eos_id

        def encode(self, *args, **kwargs) -> list[int]:
            raise RuntimeError("the benchmark feeds token ids")

        decode = encode

        def get_vocab_size(self) -> int:
            return cfg.model.vocab_size

    base, model_cls, model_args = torchtitan_model(cfg, eos_id)
    spec = f"graphtrain-e2e-{next(_TITAN_SPECS)}"  # one per trainer: the model class differs
    register_train_spec(
        spec,
        dataclasses.replace(
            get_train_spec(base),
            model_cls=model_cls,
            model_args={"e2e": model_args},
            build_dataloader_fn=None,
            build_tokenizer_fn=lambda job_config: DocumentSeparator(),
            build_validator_fn=None,
        ),
    )
    training, optim = cfg.training, cfg.optim
    cuda = torch.device(training.device).type == "cuda"
    config = TitanConfig()
    config.job.dump_folder = str(Path(training.run_dir).parent / "torchtitan")
    config.model.name, config.model.flavor = spec, "e2e"
    config.training.local_batch_size = training.micro_batch_size
    config.training.global_batch_size = micro_batches * training.micro_batch_size
    config.training.seq_len, config.training.steps = training.seq_len, training.steps
    config.training.max_norm = optim.max_norm
    # Autocast (one rank, no FSDP) in bf16 over fp32 weights on CUDA; fp32 on CPU (tests).
    config.training.mixed_precision_param = "bfloat16" if cuda else "float32"
    config.optimizer.lr, config.optimizer.weight_decay = optim.lr, optim.weight_decay
    config.optimizer.beta1, config.optimizer.beta2 = optim.betas
    config.optimizer.implementation = "fused" if cuda else "foreach"
    # Its warm-up (lr x (step + 1) / warmup_steps) is ours; no decay.
    config.lr_scheduler.warmup_steps, config.lr_scheduler.decay_ratio = cfg.warmup_steps, 0.0
    # It logs (a host sync) at step 1 and every log_freq steps: only in the warm-up here.
    config.metrics.log_freq = training.steps + 1
    config.activation_checkpoint.mode = "none"
    config.compile.enable, config.compile.components = cuda, ["model", "loss"]
    config.compile.backend = cfg.compile.backend
    config.debug.seed = training.seed
    config.debug.moe_force_load_balance = getattr(cfg.model, "force_balance", False)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29533")
    return Trainer(config)


_TITAN_SPECS = itertools.count()


def torchtitan_measure(name: str, cfg: JobConfig, trainer, step_batches: list, warmup: int) -> Row:
    losses: list[torch.Tensor] = []
    forward_backward = trainer.forward_backward_step

    def forward_backward_step(**kwargs) -> torch.Tensor:
        # Its loss is the micro-batch's summed token loss over the step's labelled tokens, so
        # the micro-batches' losses add up to the step's mean.
        loss = forward_backward(**kwargs)
        losses.append(loss.detach())
        return loss

    trainer.forward_backward_step = forward_backward_step
    # Its batches: ({"input", "positions"}, labels) with -100 where no label, as graphtrain's;
    # its model resets RoPE at the positions and masks documents at eos, as ours.
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
    (its loader draws the batches the others replay), plain torch.compile (after the variant
    rows with --plain-last; listed first either way), the FP8 and --variant rows, torchtitan.
    A row after graphtrain's that fails says why; the rows measured before it are kept."""
    with tempfile.TemporaryDirectory(prefix="e2e-") as tmp:
        cfg = job_config(args, f"{tmp}/bf16")
        precision = " bf16" if args.fp8 else ""
        row, step_batches, eos_id = graphtrain_row(f"graphtrain{precision}", cfg, args.warmup)
        rows.append(row)
        plain = f"torch.compile (plain){precision}"

        def plain_row() -> None:
            row = _or_why(plain, lambda: plain_compile_row(plain, cfg, step_batches, args.warmup))
            rows.insert(0, row)

        if not args.plain_last:
            plain_row()
        if args.fp8:
            fp8_cfg = job_config(args, f"{tmp}/fp8", fp8=True)
            fp8 = "graphtrain fp8"
            rows.append(_or_why(fp8, lambda: graphtrain_row(fp8, fp8_cfg, args.warmup)[0]))
        for i, variant in enumerate(args.variant):
            rows.append(variant_row(args, f"{tmp}/v{i}", variant, step_batches))
        if args.plain_last:
            plain_row()
        if not args.fp8:
            rows.append(torchtitan_row(TORCHTITAN, cfg, step_batches, args.warmup, eos_id))


def _or_why(name: str, measure: Callable[[], Row]) -> Row:
    """measure()'s row, or a row `name` that says why it failed: an Inductor error or an
    out-of-memory in one row loses none measured before it."""
    try:
        return measure()
    except Exception as e:
        return Row(name, note=why_not(e))


def table(rows: list[Row], args: argparse.Namespace) -> str:
    plain = rows[0].name.startswith("torch.compile")  # not there: a run stopped before it
    base = rows[0].tokens_per_s if plain else math.nan
    steps = args.warmup + args.steps
    lines = [
        f"| run | tokens/s | MFU | peak mem GiB | vs plain | step ms: median (min-max) | "
        f"warm-up s | loss after {steps} steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.note:
            lines.append(f"| {r.name} | {r.note} | | | | | | |")
            continue
        spread = (
            f"{statistics.median(r.step_ms):.1f} ({min(r.step_ms):.1f}-{max(r.step_ms):.1f})"
            if r.step_ms
            else ""
        )
        lines.append(
            f"| {r.name} | {r.tokens_per_s:,.0f} | {r.mfu:.1%} | {r.peak_mem_gib:.1f} | "
            f"{r.tokens_per_s / base:.2f}x | {spread} | {r.warmup_s:.0f} | {r.loss:.3f} |"
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
        "--plain-last",
        action="store_true",
        help="plain torch.compile's row after the --variant rows (a stage whose variants matter "
        "more than a new plain row; a time cap cuts the last row first)",
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
    rows_until_cap(rows, lambda: rows_for(args, rows), Row("(the rest)", note=CUT))
    text = table(rows, args)
    if args.device == "cpu":
        print(text)
        return rows
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
