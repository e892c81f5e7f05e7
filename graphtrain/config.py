"""Job configuration: typed, frozen dataclasses, presets, TOML files and --section.key=value.

Resolution order, later wins:
    1. the dataclass defaults,
    2. the job preset (`--preset NAME`, or `preset = "NAME"` at the top of the TOML file),
    3. the TOML file (`--config FILE`),
    4. command-line overrides `--section.key=value` (or `--section.key value`; a bare
       `--section.flag` sets a bool to true).
Unknown sections or keys and values of the wrong type are errors that name the key. The resolved
config is written to the run directory as config.toml, which `--config` reads back as it is.

The `model` section is the model's own config dataclass (models/), chosen by the preset.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomllib

from graphtrain.metrics.profiling import parse_step_range
from models import MODEL_PRESETS, GPTConfig


def _check_choices(section: str, obj: Any) -> None:
    """Every Literal[...] field of `obj` holds one of its allowed values (the type hint is the
    one list of choices: validation, the CLI and `--help` all read it)."""
    for name, tp in typing.get_type_hints(type(obj)).items():
        if typing.get_origin(tp) is Literal and getattr(obj, name) not in typing.get_args(tp):
            raise ValueError(
                f"{section}.{name} must be one of {typing.get_args(tp)}, got {getattr(obj, name)!r}"
            )


def _positive(section: str, obj: Any, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ValueError(f"{section}.{name} must be {bound}, got {value}")


@dataclass(frozen=True)
class TrainingConfig:
    steps: int = 1000  # optimizer steps to train for
    seq_len: int = 256  # tokens per packed sequence
    # Sequences per data-parallel rank per micro-batch; gradient accumulation comes from
    # schedule.batch_size.
    micro_batch_size: int = 8
    seed: int = 0  # of the initialization and the data order
    device: Literal["auto", "cuda", "cpu"] = "auto"  # auto: cuda if available, else cpu
    # Parameter/compute dtype. auto: bfloat16 on CUDA (fp32 master weights kept by FSDP2 or
    # autocast), float32 on CPU (bf16 matmuls are slow there).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Gradient reduction dtype across data-parallel ranks.
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Storage (and update) dtype of the parameters: float32 keeps fp32 master weights; bfloat16
    # is pure bf16 training (half the parameter and gradient memory; see optim.fp32_grad_accum).
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    # With fp32 master weights and 16-bit compute: copies in the compute dtype, made once per
    # optimizer step, of the weights otherwise cast on every use (the matmul weights under
    # autocast, i.e. without data parallelism; under FSDP2, which casts its own shards, the
    # expert-parallel weights), used by forward and backward; same numerics
    # (graphtrain.optim.working_weights).
    working_weights: bool = True  # false: every use casts the fp32 weight (as before)
    # Attention for packed documents: auto (flex on CUDA, sdpa on CPU), flex, sdpa, or causal
    # (ignore document boundaries).
    attention: Literal["auto", "flex", "sdpa", "causal"] = "auto"
    # Activation checkpointing: none, or full (recompute every block in the backward).
    activation_checkpoint: Literal["none", "full"] = "none"
    run_dir: str = ""  # "" -> runs/<preset>-<date>-<time>
    # FP8 GEMMs (per-tensor current scaling) for the linears and experts the [fp8] filters
    # select: turns the fp8_linear graph pass on (the same as compile.passes = ["+fp8_linear"]).
    fp8: bool = False
    # Every N steps, compare a hash of the parameters and optimizer state across the ranks that
    # must hold equal values (replicas, tp ranks of replicated params); 0: never.
    replica_check_interval: int = 1000

    def __post_init__(self) -> None:
        _check_choices("training", self)
        _positive("training", self, "steps", "micro_batch_size")
        _positive("training", self, "replica_check_interval", allow_zero=True)
        if self.seq_len < 2:
            raise ValueError(f"training.seq_len must be >= 2, got {self.seq_len}")
        if self.master_dtype == "bfloat16" and self.dtype not in ("auto", "bfloat16"):
            raise ValueError(
                f"training.master_dtype='bfloat16' computes in bfloat16, but training.dtype="
                f"{self.dtype!r}; set training.dtype to 'bfloat16' (or 'auto')"
            )


@dataclass(frozen=True)
class ParallelConfig:
    dp_replicate: int = 1  # replicated data-parallel groups (HSDP: replicate x shard)
    dp_shard: int = -1  # -1: every rank not used by the other axes
    tp: int = 1  # tensor-parallel ranks (with sequence parallelism between blocks)
    # Expert parallel (MoE models): experts split over ep ranks carved out of dp_shard.
    ep: int = 1
    # Expert tensor parallel (MoE models with tp): 1, or tp to split every expert over tp.
    etp: int = 1
    # Blocks each tp all-gather / reduce-scatter is split into by the overlap_tp_comm pass, so
    # that a block's GEMM runs while the next block is in flight; 0: tp blocks.
    tp_overlap_chunks: int = 0
    # How overlap_tp_comm overlaps: auto (torch's symm_mem fused ops where the tp group has
    # symmetric memory, else chunked), chunked, or symm_mem.
    tp_overlap_variant: Literal["auto", "chunked", "symm_mem"] = "auto"
    # Pipeline-parallel ranks, the outermost mesh axis (graphtrain.parallel.pipeline).
    pp: int = 1
    # The torch.distributed.pipelining schedule; interleaved_1f1b, zbv and dualpipev run two
    # (or, interleaved, more) virtual stages per rank.
    pp_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev"] = "1f1b"
    # Micro-batches the pipeline splits each step's rows into (it must divide them); 0: one per
    # stage (pp, or 2 x pp for the schedules with two stages per rank).
    pp_microbatches: int = 0
    # Stages as a string over E (embedding), t (layer), m (MTP depth), L (norm, head, loss), |
    # (stage boundary), "x*n" repeats x: "Et*2|t*2L". Empty: layers split evenly.
    pp_layout: str = ""

    def __post_init__(self) -> None:
        _check_choices("parallel", self)
        _positive("parallel", self, "dp_replicate", "tp", "ep", "etp", "pp")
        _positive("parallel", self, "tp_overlap_chunks", "pp_microbatches", allow_zero=True)
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ValueError(f"parallel.dp_shard must be >= 1 or -1, got {self.dp_shard}")


@dataclass(frozen=True)
class CompileConfig:
    enable: bool = True  # compile each block and the head+loss with graphtrain's backend
    # Inner backend after graphtrain's passes: inductor, or aot_eager (no code generation).
    backend: Literal["inductor", "aot_eager"] = "inductor"
    passes: list[str] = field(default_factory=list)  # ["-name", "+name"] switches
    dump_graphs: bool = False  # write every region's graph before/after each pass to run_dir/graphs
    # The fused linear + cross-entropy's mode: "fast" (three GEMMs, a [token chunk, V] logits
    # buffer), "low_memory" (four GEMMs), or "auto": on CUDA without tp, Inductor's unfused loss
    # where its logits fit lce_memory_budget (faster there); else fast unless its extra bytes
    # exceed lce_memory_budget.
    lce_mode: Literal["auto", "fast", "low_memory"] = "auto"
    # Bytes the fused cross-entropy's fast mode may use beyond the low-memory mode's; 0: a
    # quarter of the free device memory at compile time (on CPU, of the available memory).
    lce_memory_budget: int = 0
    # The MTP layers' compiled forward and backward as CUDA graphs (Inductor's cudagraph trees).
    # Used where they can work (CUDA, Inductor, no FSDP, no expert parallel, no activation
    # checkpointing); elsewhere one log line says why not (graphtrain.compile).
    cudagraph_mtp: bool = True

    def __post_init__(self) -> None:
        _check_choices("compile", self)
        if isinstance(self.lce_memory_budget, bool) or not isinstance(self.lce_memory_budget, int):
            raise ValueError(
                "compile.lce_memory_budget must be a whole number of bytes (0 = automatic), "
                f"got {self.lce_memory_budget!r}"
            )
        _positive("compile", self, "lce_memory_budget", allow_zero=True)


@dataclass(frozen=True)
class Fp8Config:
    """Which GEMMs the fp8_linear pass runs in FP8, and its recipe (graphtrain/passes/fp8_linear.py
    explains each rule and the default minimum size)."""

    # fnmatch globs over module paths ("layers.0.attention.wq") that may run in FP8
    include: list[str] = field(default_factory=lambda: ["*"])
    # globs left out of those: by default the output head and the router
    exclude: list[str] = field(default_factory=lambda: ["*output", "*router*"])
    min_dim: int = 4096  # M, K, N (experts: K, N) at least this; smaller GEMMs lose to bf16
    multiple_of: int = 16  # torch._scaled_mm on CUDA needs dims that are multiples of 16
    experts: bool = True  # the MoE experts' grouped GEMMs too
    e4m3_grads: bool = False  # gradients in E4M3 instead of E5M2
    pow2_scale: bool = False  # round scales down to powers of two
    # FSDP2 gathers the FP8 linears' weights as E4M3 bytes cast from the shards (scale from the
    # shard amaxes max-reduced over dp): half the bytes of a bf16 gather, same numerics; no tp
    fsdp_all_gather_fp8: bool = False

    def __post_init__(self) -> None:
        _positive("fp8", self, "min_dim")
        if self.multiple_of < 16 or self.multiple_of % 16:
            raise ValueError(
                f"fp8.multiple_of must be a multiple of 16 (torch._scaled_mm's alignment), "
                f"got {self.multiple_of}"
            )
        for name in ("include", "exclude"):
            globs = getattr(self, name)
            if not all(isinstance(g, str) and g for g in globs):
                raise ValueError(f"fp8.{name} must be a list of non-empty globs, got {globs!r}")
        if not self.include:
            raise ValueError('fp8.include is empty: no linear could run in FP8; use ["*"]')


@dataclass(frozen=True)
class DataConfig:
    # Files or globs of .txt/.jsonl/.parquet text or .bin/.npy token shards; [] -> the embedded
    # default corpus (the Python standard library's source).
    paths: list[str] = field(default_factory=list)
    # A blend (Megatron-style): one weight per entry of paths, each entry a source of its own,
    # rows drawn in these proportions (normalised), deterministic and resumable; [] -> no blend.
    weights: list[float] = field(default_factory=list)
    # Held-out files or globs for validation; [] -> a deterministic split of data.paths.
    val_paths: list[str] = field(default_factory=list)
    tokenizer: str = ""  # a tokenizer.json; "" -> the default BPE trained on the default corpus
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # of .bin token shards
    cache_dir: str = ""  # "" -> $GRAPHTRAIN_CACHE or ~/.cache/graphtrain

    def __post_init__(self) -> None:
        _check_choices("data", self)
        if self.weights and len(self.weights) != len(self.paths):
            raise ValueError(
                f"data.weights={self.weights} needs one weight per entry of data.paths="
                f"{self.paths} ({len(self.paths)}); the default corpus cannot be blended"
            )
        if any(w <= 0 for w in self.weights):
            raise ValueError(f"data.weights must all be > 0, got {self.weights}")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4  # peak learning rate (after warm-up)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW beta1, beta2
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # decoupled weight decay, except for the no_decay parameters
    # Parameters (fnmatch on dotted names) without weight decay.
    no_decay: list[str] = field(default_factory=lambda: ["*norm*", "*bias", "tok_embeddings.*"])
    # AdamW kernel: torch's "fused" or "foreach", or "graphtrain" (fp32 masters: the step also
    # writes the bf16 working copies, graphtrain.optim.adamw_copies; opt-in until measured on a
    # GPU); "auto": fused where supported, else foreach.
    implementation: Literal["auto", "fused", "foreach", "graphtrain"] = "auto"  # AdamW kernel
    max_norm: float = 1.0  # gradient clipping by the global norm; <= 0 disables clipping
    # dtype of the AdamW moments: float32, or bfloat16 (half the memory; fp32 math, rounded to
    # nearest on store; see graphtrain.optim.adamw_bf16).
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    # Parameters (fnmatch on dotted names, e.g. "*norm*", "*.router.*") whose gradients are
    # summed over the micro-batches in fp32 when training.master_dtype is bfloat16 (see
    # graphtrain.optim.precision); fp32 parameters accumulate in fp32 anyway.
    fp32_grad_accum: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_choices("optim", self)
        _positive("optim", self, "lr")
        _positive("optim", self, "eps", "weight_decay", allow_zero=True)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")


@dataclass(frozen=True)
class ScheduleConfig:
    # Linear warm-up, in optimizer steps; -1: take schedule.warmup_ratio of training.steps.
    warmup_steps: int = -1
    # Linear warm-up as a fraction of training.steps (used when warmup_steps is -1), so that a
    # preset's schedule fits a shorter or longer run.
    warmup_ratio: float = 0.1
    decay_ratio: float = 0.2  # the last decay_ratio of training.steps decay to min_lr
    # lr decay, Megatron-Core's formulas: linear, cosine, exponential, minus_sqrt over the last
    # decay_ratio (step i of D at progress i/D: the last step one step short of min_lr, as
    # Megatron-Core and torchtitan); inverse_sqrt: lr * sqrt(warmup / step) after warm-up.
    decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt", "inverse_sqrt"] = "cosine"
    min_lr: float = 3e-5  # learning rate the decay heads for (0 allowed); inverse_sqrt's floor
    # Global batch size in tokens, optionally stepped on consumed tokens: "0:256K 50M:512K".
    # "" -> one micro-batch per data-parallel rank per step (no accumulation).
    batch_size: str = ""

    def __post_init__(self) -> None:
        _check_choices("schedule", self)
        _positive("schedule", self, "min_lr", allow_zero=True)
        if self.warmup_steps < -1:
            raise ValueError(
                f"schedule.warmup_steps must be >= 0 (or -1: from schedule.warmup_ratio), "
                f"got {self.warmup_steps}"
            )
        for name in ("warmup_ratio", "decay_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"schedule.{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 0  # save every N steps; 0: none besides the final checkpoint
    # Save a checkpoint when training ends (whatever interval says), so that every run can be
    # exported or continued; false: none at the end (the interval's saves stay).
    final: bool = True
    keep_last: int = 2  # complete checkpoints kept (plus the retain_interval ones)
    # Also keep every checkpoint whose step is a multiple of this; 0: only the last keep_last.
    retain_interval: int = 0
    # "" none, "latest", a checkpoint of this run (step-0000100), or the path of another run's
    # checkpoint folder (continued in this run's empty run dir)
    resume: str = ""
    # Write checkpoints in the background (DCP async_save); CUDA only.
    async_save: bool = False
    # A Hugging Face safetensors directory (as `graphtrain export` writes) to start from,
    # instead of a random init; ignored when resuming.
    init_from_hf: str = ""
    # resume=latest with a damaged newest checkpoint (a file whose digest differs): resume from
    # the newest intact one instead of stopping.
    fallback_on_corruption: bool = False
    # SIGTERM/SIGINT: finish the step, save a checkpoint (unless interval = 0 and final = false),
    # exit with code 75.
    save_on_signal: bool = True

    def __post_init__(self) -> None:
        _positive("checkpoint", self, "interval", "retain_interval", allow_zero=True)
        _positive("checkpoint", self, "keep_last")


@dataclass(frozen=True)
class MetricsConfig:
    log_interval: int = 10  # optimizer steps between log lines (a host sync each)
    val_interval: int = 100  # steps between validations; 0: only at step 0 and at the end
    val_batches: int = 8  # held-out micro-batches per validation
    # Held-out rows (sequences of seq_len) evaluated at each validation, split over the ranks:
    # the same rows for any layout. 0: val_batches x training.micro_batch_size.
    val_rows: int = 0
    tensorboard: bool = True  # also write TensorBoard events to run_dir/tb
    peak_tflops: float = 0.0  # per device, for MFU; 0 -> from the device name, if known
    # Optimizer steps to run under the torch profiler, e.g. "10-12" (a trace per rank in
    # run_dir/profile/); "" -> none.
    profile_steps: str = ""
    # Also record a CUDA memory snapshot over profile_steps (run_dir/memory/); CUDA only.
    memory_snapshot: bool = False

    def __post_init__(self) -> None:
        _positive("metrics", self, "log_interval", "val_batches")
        _positive("metrics", self, "val_interval", "peak_tflops", "val_rows", allow_zero=True)
        parse_step_range(self.profile_steps)


@dataclass(frozen=True)
class JobConfig:
    preset: str = "tiny"  # the job preset the values start from
    model: GPTConfig = field(default_factory=GPTConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        if self.training.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"training.seq_len={self.training.seq_len} exceeds the model's "
                f"model.max_seq_len={self.model.max_seq_len}"
            )
        if self.model.mtp_depth >= self.training.seq_len:
            # Depth k predicts the token k + 1 ahead inside the row: none would have a label.
            raise ValueError(
                f"model.mtp_depth={self.model.mtp_depth} needs training.seq_len > "
                f"{self.model.mtp_depth}, got {self.training.seq_len}"
            )
        s = self.schedule
        if self.warmup_steps + self.decay_steps > self.training.steps:
            warmup = (
                f"schedule.warmup_steps={s.warmup_steps}"
                if s.warmup_steps >= 0
                else f"warm-up {self.warmup_steps} (schedule.warmup_ratio={s.warmup_ratio})"
            )
            raise ValueError(
                f"{warmup} + decay {self.decay_steps} (schedule.decay_ratio={s.decay_ratio}) "
                f"exceed training.steps={self.training.steps}; lower them, or give the warm-up "
                "as schedule.warmup_ratio (a fraction of training.steps)"
            )
        self._check_model_numbers()
        if self.checkpoint.async_save and self.training.device == "cpu":
            raise ValueError(
                "checkpoint.async_save=true needs CUDA (it overlaps writing with GPU compute); "
                "training.device='cpu' saves synchronously: set checkpoint.async_save=false"
            )
        self._check_fp8()

    def _check_model_numbers(self) -> None:
        """Values that would train to NaN or fail deep inside torch: stopped here, named."""
        m = self.model
        for name, meaning in (
            ("norm_eps", "RMSNorm's epsilon, e.g. 1e-5"),
            ("rope_theta", "RoPE's base frequency, e.g. 10000.0"),
            ("init_std", "the standard deviation of the initial weights, e.g. 0.02"),
        ):
            value = getattr(m, name, None)
            if value is not None and not value > 0:
                raise ValueError(f"model.{name} must be > 0 ({meaning}), got {value}")
        dense = not hasattr(m, "num_experts")
        for axis in ("ep", "etp"):
            value = getattr(self.parallel, axis)
            if dense and value > 1:
                raise ValueError(
                    f"parallel.{axis}={value} splits the routed experts of an MoE model, but "
                    f"preset {self.preset!r} builds a dense model (no experts); set "
                    f"parallel.{axis}=1 or use an MoE preset"
                )

    def _check_fp8(self) -> None:
        """training.fp8 = true is compile.passes += ["+fp8_linear"]: added here, so the trainer
        and `graphtrain inspect` (which read compile.passes) both see it."""
        if self.fp8.fsdp_all_gather_fp8 and not self.training.fp8:
            raise ValueError("fp8.fsdp_all_gather_fp8=true needs training.fp8=true")
        if self.fp8.fsdp_all_gather_fp8 and self.parallel.tp > 1:
            raise ValueError(
                f"fp8.fsdp_all_gather_fp8=true is built for FSDP without tensor parallelism, "
                f"got parallel.tp={self.parallel.tp}: set one of them off"
            )
        if not self.training.fp8:
            return
        if not self.compile.enable:
            raise ValueError(
                "training.fp8=true needs compile.enable=true (FP8 is inserted by a graph pass)"
            )
        if "-fp8_linear" in self.compile.passes:
            raise ValueError(
                'training.fp8=true contradicts compile.passes entry "-fp8_linear"; drop one'
            )
        if "+fp8_linear" not in self.compile.passes:
            passes = [*self.compile.passes, "+fp8_linear"]
            # frozen: the resolved config is built once, here
            object.__setattr__(self, "compile", dataclasses.replace(self.compile, passes=passes))

    @property
    def warmup_steps(self) -> int:
        """schedule.warmup_steps, or schedule.warmup_ratio of training.steps when it is -1."""
        if self.schedule.warmup_steps >= 0:
            return self.schedule.warmup_steps
        return round(self.schedule.warmup_ratio * self.training.steps)

    @property
    def decay_steps(self) -> int:
        return round(self.schedule.decay_ratio * self.training.steps)


# Job presets: a model preset plus training settings that suit it. Warm-up is a fraction of the
# steps, so `--training.steps=N` keeps the preset's schedule shape at any length. "tiny" is the default run:
# it learns the embedded corpus on a 2-core CPU in a few minutes.
# The training settings of the small presets the tests use (debug, moe-debug, hybrid-*-debug).
_DEBUG_JOB: dict[str, Any] = {
    "training": {"steps": 20, "seq_len": 64, "micro_batch_size": 4},
    "optim": {"lr": 1e-3},
    "schedule": {"warmup_ratio": 0.1, "decay_ratio": 0.25, "min_lr": 1e-4},
    "metrics": {"log_interval": 5, "val_interval": 10, "val_rows": 8},
}
JOB_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        # About 180 x 4096 tokens: ~3.5 min of training at ~3.4k tokens/s on 2 CPU cores, which
        # takes the validation loss from ~9.5 to below 5.
        "model": "tiny",
        "training": {"steps": 180, "seq_len": 256, "micro_batch_size": 16},
        "optim": {"lr": 2e-3, "weight_decay": 0.1},
        "schedule": {"warmup_ratio": 0.11, "decay_ratio": 0.4, "min_lr": 2e-4},
        "metrics": {"log_interval": 10, "val_interval": 60, "val_rows": 128},
    },
    "debug": {"model": "debug", **_DEBUG_JOB},
    "125m": {
        "model": "125m",
        "training": {"steps": 10000, "seq_len": 2048, "micro_batch_size": 8},
        "optim": {"lr": 6e-4},
        "schedule": {"warmup_ratio": 0.05, "min_lr": 6e-5},
    },
    "1b": {
        "model": "1b",
        "training": {"steps": 20000, "seq_len": 4096, "micro_batch_size": 2},
        "optim": {"lr": 3e-4},
        "schedule": {"warmup_ratio": 0.05, "min_lr": 3e-5},
    },
    # MoE (models/moe.py). moe-tiny learns the embedded corpus on a 2-core CPU in minutes.
    "moe-tiny": {
        "model": "moe-tiny",
        "training": {"steps": 150, "seq_len": 256, "micro_batch_size": 16},
        "optim": {"lr": 2e-3, "weight_decay": 0.1},
        "schedule": {"warmup_ratio": 0.133, "decay_ratio": 0.4, "min_lr": 2e-4},
        "metrics": {"log_interval": 10, "val_interval": 50, "val_rows": 128},
    },
    "moe-debug": {"model": "moe-debug", **_DEBUG_JOB},
    "moe-1b": {
        "model": "moe-1b",
        "training": {"steps": 20000, "seq_len": 4096, "micro_batch_size": 4},
        "optim": {"lr": 3e-4},
        "schedule": {"warmup_ratio": 0.05, "min_lr": 3e-5},
    },
    # Hybrids (models/hybrid.py): Gated DeltaNet and attention blocks by model.layer_pattern.
    "hybrid-debug": {"model": "hybrid-debug", **_DEBUG_JOB},
    "hybrid-moe-debug": {"model": "hybrid-moe-debug", **_DEBUG_JOB},
    "hybrid-1b": {
        "model": "hybrid-1b",
        "training": {"steps": 20000, "seq_len": 4096, "micro_batch_size": 2},
        "optim": {"lr": 3e-4},
        "schedule": {"warmup_ratio": 0.05, "min_lr": 3e-5},
    },
    # The FP8 benchmark's dense model (models/gpt.py): one GPU, fp32 master weights.
    "3b": {
        "model": "3b",
        "training": {"steps": 20000, "seq_len": 4096, "micro_batch_size": 1},
        "optim": {"lr": 3e-4},
        "schedule": {"warmup_ratio": 0.05, "min_lr": 3e-5},
    },
    "8b": {
        "model": "8b",
        "training": {
            "steps": 50000,
            "seq_len": 8192,
            "micro_batch_size": 1,
            "activation_checkpoint": "full",
        },
        "optim": {"lr": 3e-4},
        "schedule": {"warmup_ratio": 0.04, "min_lr": 3e-5},
    },
}


# ---------------------------------------------------------------------------------------------
# Typed application of nested mappings onto the dataclasses.


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "str"
    if typing.get_origin(tp) in (list, tuple):
        return "list of " + _type_name((typing.get_args(tp) or (Any,))[0])
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _cli_scalar(text: str, tp: Any) -> Any:
    """Command-line text for a bool/int/float key as that type; the text itself when it is not
    one (then _coerce names the key and the value)."""
    if tp is bool:
        lowered = text.lower()
        return lowered in ("true", "1") if lowered in ("true", "false", "1", "0") else text
    try:
        return tp(text)
    except ValueError:
        return text


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """`value` as type `tp`, or a ValueError naming `key`, the value and the expected type."""
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):  # from the command line: "a,b,c"
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ValueError(
                f"config key {key!r} expects a list of {_type_name(item_tp)}, got {value!r}"
            )
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"config field {key!r}: union types are not supported")  # internal
    # Numbers and booleans must be TOML numbers and booleans: a TOML string "5" for an int key
    # is refused (the command line's text was parsed before, in _cli_values).
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            # No key means anything by nan or inf (TOML and float() accept both).
            if not math.isfinite(value):
                raise ValueError(f"config key {key!r} expects a finite number, got {value!r}")
            return float(value)
    elif tp is str or origin is Literal:
        if isinstance(value, str):
            return value  # a Literal's choices are checked in the section's __post_init__
    else:
        raise TypeError(f"config field {key!r} has unsupported type {tp!r}")  # internal
    raise ValueError(f"config key {key!r} expects {_type_name(tp)}, got {value!r}")


def _apply(obj: Any, updates: dict[str, Any], prefix: str) -> Any:
    """A copy of dataclass `obj` with `updates` (nested dicts for nested dataclasses) applied."""
    hints = typing.get_type_hints(type(obj))
    fields = {f.name for f in dataclasses.fields(obj)}
    changes = {}
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ValueError(f"unknown config key {key!r}; known keys here: {known}")
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"config key {key!r} is a section; got the value {value!r}")
            changes[name] = _apply(current, value, f"{key}.")
        else:
            if isinstance(value, dict):  # --training.steps.x=1: keys below a plain value
                below = ", ".join(f"{key}.{k}" for k in value)
                raise ValueError(
                    f"config key {below!r} does not exist: {key!r} is a value, not a section; "
                    f"set it as --{key}=..."
                )
            changes[name] = _coerce(key, value, hints[name])
    return dataclasses.replace(obj, **changes)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _parse_cli_value(text: str) -> Any:
    """A TOML literal when it is one (numbers, true/false, [lists], "strings"), else the text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Split argv into nested overrides {"training": {"steps": 5}} and the plain options
    {"preset": ..., "config": ...}. Values stay strings where the field type decides."""
    nested: dict[str, Any] = {}
    plain: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"unexpected argument {arg!r}; expected --section.key=value")
        key, has_value, value = arg[2:].partition("=")
        if not has_value:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = "true"  # a bare flag
        i += 1
        if key in ("preset", "config"):
            plain[key] = value
            continue
        if "." not in key:
            raise ValueError(f"unknown option --{key}; config keys look like --section.key=value")
        *sections, leaf = key.split(".")
        target = nested
        for depth, s in enumerate(sections):
            target = target.setdefault(s, {})
            if not isinstance(target, dict):
                parent = ".".join(sections[: depth + 1])
                raise ValueError(
                    f"config key {key!r}: {parent!r} is a value (given as --{parent}=...), "
                    f"not a section with keys"
                )
        # CLI strings: keep them raw for str and list fields (decided in _coerce via the field
        # type), parse TOML literals for the rest.
        target[leaf] = value
    return nested, plain


def _cli_values(obj: Any, updates: dict[str, Any]) -> dict[str, Any]:
    """Turn raw CLI strings into typed values, except for str fields where the text is the value."""
    hints = typing.get_type_hints(type(obj))
    out = {}
    for name, value in updates.items():
        current = getattr(obj, name, None)
        tp = hints.get(name)
        if isinstance(value, dict) and dataclasses.is_dataclass(current):
            out[name] = _cli_values(current, value)
        elif tp is str or typing.get_origin(tp) is Literal or not isinstance(value, str):
            out[name] = value
        elif tp in (bool, int, float):
            out[name] = _cli_scalar(value, tp)
        else:
            parsed = _parse_cli_value(value)
            # "a,b" for a list stays a string (split in _coerce); "[1, 2]" parses as a list.
            out[name] = value if isinstance(parsed, str) else parsed
    return out


# Keys that say the same thing two ways: a layer (file, command line) that sets one drops the
# other from the layers below it; one layer setting both is a contradiction.
_ALTERNATIVES = {("schedule", "warmup_steps"): ("schedule", "warmup_ratio")}
_ALTERNATIVES.update({b: a for a, b in _ALTERNATIVES.items()})


def _layer_over(below: dict[str, Any], layer: dict[str, Any], origin: str) -> dict[str, Any]:
    """`layer` merged over `below`, with the alternatives of the keys it sets removed first."""
    below = _merge(below, {})
    for (section, key), (alt_section, alt) in _ALTERNATIVES.items():
        if key in layer.get(section, {}) and alt in layer.get(alt_section, {}):
            raise ValueError(
                f"{origin} sets both {section}.{key} and {alt_section}.{alt}; set one of them"
            )
        if key in layer.get(section, {}) and isinstance(below.get(alt_section), dict):
            below[alt_section] = {k: v for k, v in below[alt_section].items() if k != alt}
    return _merge(below, layer)


def preset_updates(name: str) -> dict[str, Any]:
    if name not in JOB_PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(JOB_PRESETS)}")
    updates = dict(JOB_PRESETS[name])
    updates["model"] = dataclasses.asdict(MODEL_PRESETS[updates["model"]])
    return updates


def load_config(args: list[str] | None = None, *, file: str | Path | None = None) -> JobConfig:
    """Resolve a JobConfig from a preset, an optional TOML file and --section.key=value args."""
    overrides, plain = parse_overrides(list(args or []))
    file = plain.get("config", file)
    file_values: dict[str, Any] = {}
    if file:
        path = Path(file)
        if not path.is_file():
            raise ValueError(
                f"config file {str(path)!r} does not exist (looked for {str(Path(path).absolute())!r})"
            )
        try:
            file_values = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    preset = plain.get("preset") or file_values.pop("preset", None) or JobConfig.preset
    file_values.pop("preset", None)
    values = _layer_over(preset_updates(preset), file_values, "the config file")
    values["preset"] = preset
    # The preset's model decides the model section's class (GPTConfig, MoEConfig, ...): its
    # keys are the ones a file or the command line may set.
    base = JobConfig(model=type(MODEL_PRESETS[JOB_PRESETS[preset]["model"]])())
    # Merge everything as plain dicts, then build each section once, so the __post_init__ checks
    # see the final values (a preset value overridden on the command line never trips a check).
    values = _layer_over(values, _cli_values(base, overrides), "the command line")
    unknown = set(values) - {f.name for f in dataclasses.fields(JobConfig)}
    if unknown:
        known = ", ".join(f.name for f in dataclasses.fields(JobConfig))
        raise ValueError(f"unknown config section(s) {sorted(unknown)}; known sections: {known}")
    return _apply(base, values, "")


def pass_options(cfg: JobConfig) -> dict[str, Any]:
    """The settings the graph passes read (graphtrain.passes.PassContext.options), by key.

    One place, so the trainer and `graphtrain inspect` hand the passes the same options.
    """
    return {
        "lce_mode": cfg.compile.lce_mode,
        "lce_memory_budget": cfg.compile.lce_memory_budget,
        **{f"fp8.{k}": v for k, v in dataclasses.asdict(cfg.fp8).items()},
        "tp_overlap_chunks": cfg.parallel.tp_overlap_chunks,
        "tp_overlap_variant": cfg.parallel.tp_overlap_variant,
    }


# ---------------------------------------------------------------------------------------------
# Writing the resolved config back out.


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _unused_alternatives(cfg: JobConfig) -> set[tuple[str, str]]:
    return {("schedule", "warmup_ratio" if cfg.schedule.warmup_steps >= 0 else "warmup_steps")}


def to_toml(cfg: JobConfig) -> str:
    lines = [f"preset = {_toml_value(cfg.preset)}"]
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(section):
            continue
        lines.append(f"\n[{f.name}]")
        for k, v in dataclasses.asdict(section).items():
            if (f.name, k) in _unused_alternatives(cfg):
                continue  # written, it would contradict the key in effect
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


@functools.cache
def _field_comments(cls: type) -> dict[str, str]:
    """{field: its description} from the comments at a dataclass field's definition: the
    comment lines right above it and the comment after it on its line (the definitions are the
    one copy of the documentation; a base class's fields come from the base's source)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        above: list[str] = []
        for line in inspect.getsource(klass).splitlines()[1:]:
            stripped = line.strip()
            field_match = re.match(r"(\w+)\s*:[^#]*?(?:#\s*(.*))?$", stripped)
            if stripped.startswith("#"):
                above.append(stripped.lstrip("#").strip())
            elif field_match and line.startswith("    ") and not line.startswith("     "):
                text = " ".join([*above, field_match.group(2) or ""]).strip()
                out[field_match.group(1)] = text
                above = []
            else:
                above = []
    return out


def describe_key(section: Any, name: str, tp: Any) -> str:
    """`name`'s type, allowed values and description, for `--help`."""
    kind = _type_name(tp)
    if typing.get_origin(tp) is Literal:
        kind += ": " + " | ".join(typing.get_args(tp))
    return f"({kind}) {_field_comments(type(section)).get(name, '')}".rstrip()


def describe_keys(cfg: JobConfig) -> str:
    """Every section and key of `cfg` with its value in `cfg` (the default for this preset), type,
    allowed values and description, for `graphtrain train --help`."""
    out = []
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(section):
            continue
        out.append(f"[{f.name}]")
        hints = typing.get_type_hints(type(section))
        for k, v in dataclasses.asdict(section).items():
            out.append(f"  --{f.name}.{k}={_toml_value(v)}")
            out.extend(
                textwrap.wrap(
                    describe_key(section, k, hints[k]),
                    width=100,
                    initial_indent=" " * 6,
                    subsequent_indent=" " * 6,
                )
            )
    return "\n".join(out)
