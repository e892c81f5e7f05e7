"""The job config's sections: typed, frozen dataclasses, each validated in __post_init__.

What
    TrainingConfig ... MetricsConfig   one dataclass per TOML section; JobConfig holds them and
                                       the model's own config dataclass (models/)
    option(default, doc)               a field with its `--help` text as metadata["help"]: the
                                       one copy of each key's documentation (models.fields, whose
                                       model configs document their keys the same way)
Contract
    A Literal[...] type hint is a key's one list of choices (validation, the command line and
    `--help` read it). Bad values raise ValueError naming the key, the value and what is right.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from graphtrain.metrics.profiling import parse_step_range
from models import GPTConfig
from models.fields import option


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
    steps: int = option(1000, "optimizer steps to train for")
    seq_len: int = option(256, "tokens per packed sequence")
    micro_batch_size: int = option(
        8,
        "Sequences per data-parallel rank per micro-batch; gradient accumulation comes from "
        "schedule.batch_size.",
    )
    seed: int = option(0, "of the initialization and the data order")
    device: Literal["auto", "cuda", "cpu"] = option("auto", "auto: cuda if available, else cpu")
    dtype: Literal["auto", "float32", "bfloat16"] = option(
        "auto",
        "Parameter/compute dtype. auto: bfloat16 on CUDA (fp32 master weights kept by FSDP2 or "
        "autocast), float32 on CPU (bf16 matmuls are slow there).",
    )
    reduce_dtype: Literal["float32", "bfloat16"] = option(
        "float32",
        "Gradient reduction dtype across data-parallel ranks.",
    )
    master_dtype: Literal["float32", "bfloat16"] = option(
        "float32",
        "Storage (and update) dtype of the parameters: float32 keeps fp32 master weights; "
        "bfloat16 is pure bf16 training (half the parameter and gradient memory; see "
        "optim.fp32_grad_accum).",
    )
    working_weights: bool = option(
        True,
        "With fp32 master weights and 16-bit compute: copies in the compute dtype, made once per "
        "optimizer step, of the weights otherwise cast on every use (the matmul weights under "
        "autocast, i.e. without data parallelism; under FSDP2, which casts its own shards, the "
        "expert-parallel weights), used by forward and backward; same numerics "
        "(graphtrain.optim.working_weights). false: every use casts the fp32 weight (as before)",
    )
    attention: Literal["auto", "flex", "varlen", "sdpa", "causal"] = option(
        "auto",
        "Attention for packed documents: auto (flex on CUDA, sdpa on CPU), flex, varlen (torch's "
        "varlen_attn: FlashAttention-2's variable-length kernel, CUDA), sdpa, or causal (ignore "
        "document boundaries).",
    )
    activation_checkpoint: Literal["none", "full"] = option(
        "none",
        "Activation checkpointing: none, or full (recompute every block in the backward).",
    )
    activation_memory_budget: float = option(
        1.0,
        "Selective recomputation by the compiler, in (0, 1]: each compiled region saves for "
        "the backward at most this fraction of what it saves by default beyond its inputs, and "
        "torch's partitioner recomputes the cheapest rest (by FLOPs) in the backward; "
        "graphtrain's ops and random ops are always saved. 1: off. Needs compile.enable and "
        "activation_checkpoint='none' (full is the budget's end: only the blocks' inputs).",
    )
    run_dir: str = option(
        "",
        '"" -> runs/<preset>-<date>-<time>',
    )
    fp8: bool = option(
        False,
        "FP8 GEMMs (per-tensor current scaling) for the linears and experts the [fp8] filters "
        "select: turns the fp8_linear graph pass on (the same as compile.passes = "
        '["+fp8_linear"]).',
    )
    replica_check_interval: int = option(
        1000,
        "Every N steps, compare a hash of the parameters and optimizer state across the ranks "
        "that must hold equal values (replicas, tp ranks of replicated params); 0: never.",
    )

    def __post_init__(self) -> None:
        for key in ("dtype", "reduce_dtype"):
            if getattr(self, key) == "float16":  # before the choices: why, not just the list
                raise ValueError(
                    f"training.{key}='float16': float16 training needs loss scaling (its normal "
                    "numbers end at 6e-5 and 65504: small gradients flush to zero, large ones "
                    "overflow), which graphtrain does not do; use 'bfloat16' (float32's range, "
                    "the same tensor-core rate)"
                )
        _check_choices("training", self)
        _positive("training", self, "steps", "micro_batch_size")
        _positive("training", self, "replica_check_interval", "seed", allow_zero=True)
        if self.seq_len < 2:
            raise ValueError(f"training.seq_len must be >= 2, got {self.seq_len}")
        budget = self.activation_memory_budget
        if not 0 < budget <= 1:
            raise ValueError(
                f"training.activation_memory_budget must be in (0, 1] (1: off), got {budget}; "
                "for recomputing whole blocks set training.activation_checkpoint='full'"
            )
        if budget < 1 and self.activation_checkpoint != "none":
            raise ValueError(
                f"training.activation_memory_budget={budget} with training.activation_checkpoint="
                f"{self.activation_checkpoint!r}: the checkpoint already recomputes whole "
                "blocks; set one of them to its off value (1 or 'none')"
            )
        if self.master_dtype == "bfloat16" and self.dtype not in ("auto", "bfloat16"):
            raise ValueError(
                f"training.master_dtype='bfloat16' computes in bfloat16, but training.dtype="
                f"{self.dtype!r}; set training.dtype to 'bfloat16' (or 'auto')"
            )


@dataclass(frozen=True)
class ParallelConfig:
    dp_replicate: int = option(1, "replicated data-parallel groups (HSDP: replicate x shard)")
    dp_shard: int = option(-1, "-1: every rank not used by the other axes")
    tp: int = option(1, "tensor-parallel ranks (with sequence parallelism between blocks)")
    ep: int = option(
        1,
        "Expert parallel (MoE models): experts split over ep ranks carved out of dp_shard.",
    )
    etp: int = option(
        1,
        "Expert tensor parallel (MoE models with tp): 1, or tp to split every expert over tp.",
    )
    tp_overlap_chunks: int = option(
        0,
        "Blocks each tp all-gather / reduce-scatter is split into by the overlap_tp_comm pass, so "
        "that a block's GEMM runs while the next block is in flight; 0: tp blocks.",
    )
    tp_overlap_variant: Literal["auto", "chunked", "symm_mem"] = option(
        "auto",
        "How overlap_tp_comm overlaps: auto (torch's symm_mem fused ops where the tp group has "
        "symmetric memory, else chunked), chunked, or symm_mem.",
    )
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = option(
        "default",
        "FSDP2 after a block's forward: default frees its gathered weights without pp and keeps "
        "them until the step's last backward with pp (one all-gather per step); always frees "
        "them (less memory; under pp an all-gather per micro-batch, block and pass; not with "
        "zbv or dualpipev); never keeps them until the backward (the most memory).",
    )
    pp: int = option(
        1,
        "Pipeline-parallel ranks, the outermost mesh axis (graphtrain.parallel.pipeline).",
    )
    pp_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev"] = option(
        "1f1b",
        "The torch.distributed.pipelining schedule; interleaved_1f1b, zbv and dualpipev run two "
        "(or, interleaved, more) virtual stages per rank.",
    )
    pp_microbatches: int = option(
        0,
        "Micro-batches the pipeline splits each step's rows into (it must divide them); 0: one "
        "per stage (pp, or 2 x pp for the schedules with two stages per rank).",
    )
    pp_layout: str = option(
        "",
        "Stages as a string over E (embedding), t (layer), m (MTP depth), L (norm, head, loss), | "
        '(stage boundary), "x*n" repeats x: "Et*2|t*2L". Empty: layers split evenly.',
    )

    def __post_init__(self) -> None:
        _check_choices("parallel", self)
        _positive("parallel", self, "dp_replicate", "tp", "ep", "etp", "pp")
        _positive("parallel", self, "tp_overlap_chunks", "pp_microbatches", allow_zero=True)
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ValueError(f"parallel.dp_shard must be >= 1 or -1, got {self.dp_shard}")


@dataclass(frozen=True)
class CompileConfig:
    enable: bool = option(True, "compile each block and the head+loss with graphtrain's backend")
    backend: Literal["inductor", "aot_eager"] = option(
        "inductor",
        "Inner backend after graphtrain's passes: inductor, or aot_eager (no code generation).",
    )
    passes: list[str] = option(
        factory=list,
        doc='["-name", "+name"] switches',
    )
    dump_graphs: bool = option(
        False,
        "write every region's graph before/after each pass to run_dir/graphs",
    )
    lce_mode: Literal["auto", "fast", "low_memory"] = option(
        "auto",
        'The fused linear + cross-entropy\'s mode: "fast" (three GEMMs, a [token chunk, V] '
        'logits buffer), "low_memory" (four GEMMs), or "auto": on CUDA without tp, Inductor\'s '
        "unfused loss where its logits fit lce_memory_budget (faster there); else fast unless "
        "its extra bytes exceed lce_memory_budget.",
    )
    lce_memory_budget: int = option(
        0,
        "Bytes the fused cross-entropy's fast mode may use beyond the low-memory mode's; 0: a "
        "quarter of the free device memory at compile time (on CPU, of the available memory).",
    )
    gdr_kernels: Literal["auto", "triton", "fla"] = option(
        "auto",
        "The Gated DeltaNet op's CUDA kernels: triton (graphtrain's), fla (the fla extra's), or "
        "auto: fla where it imports and runs (its backward refuses Hopper with triton >= 3.4, "
        "< 3.7.1 unless tilelang is installed), else triton.",
    )
    gdr_form: Literal["op", "inline"] = option(
        "op",
        "What pass gated_delta_rule makes of a Gated DeltaNet region: op (one opaque op, whose "
        "backward recomputes the forward) or inline (the model's chunked form with graphtrain's "
        "kernels in its two slots, the rest left to Inductor; not with gdr_kernels fla).",
    )
    cudagraph_mtp: bool = option(
        True,
        "The MTP layers' compiled forward and backward as CUDA graphs (Inductor's cudagraph "
        "trees). Used where they can work (CUDA, Inductor, no FSDP, no expert parallel, no "
        "activation checkpointing); elsewhere one log line says why not (graphtrain.compile).",
    )

    def __post_init__(self) -> None:
        _check_choices("compile", self)
        if self.gdr_form == "inline" and self.gdr_kernels == "fla":  # FLA's come as one op
            bad = "compile.gdr_form='inline' takes graphtrain's kernels, not gdr_kernels='fla'"
            raise ValueError(f"{bad}: set compile.gdr_form='op' or compile.gdr_kernels='auto'")
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

    include: list[str] = option(
        factory=lambda: ["*"],
        doc='fnmatch globs over module paths ("layers.0.attention.wq") that may run in FP8',
    )
    exclude: list[str] = option(
        factory=lambda: ["*output", "*router*"],
        doc="globs left out of those: by default the output head and the router",
    )
    min_dim: int = option(4096, "M, K, N (experts: K, N) at least this; smaller GEMMs lose to bf16")
    multiple_of: int = option(16, "torch._scaled_mm on CUDA needs dims that are multiples of 16")
    experts: bool = option(True, "the MoE experts' grouped GEMMs too")
    e4m3_grads: bool = option(False, "gradients in E4M3 instead of E5M2")
    pow2_scale: bool = option(False, "round scales down to powers of two")
    fsdp_all_gather_fp8: bool = option(
        False,
        "FSDP2 gathers the FP8 linears' weights as E4M3 bytes cast from the shards (scale from "
        "the shard amaxes max-reduced over dp): half the bytes of a bf16 gather, same numerics; "
        "no tp",
    )

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
    paths: list[str] = option(
        factory=list,
        doc="Files or globs of .txt/.jsonl/.parquet text or .bin/.npy token shards; [] -> the "
        "embedded default corpus (the Python standard library's source).",
    )
    weights: list[float] = option(
        factory=list,
        doc="A blend (Megatron-style): one weight per entry of paths, each entry a source of "
        "its own, rows drawn in these proportions (normalised), deterministic and resumable; "
        "[] -> no blend.",
    )
    val_paths: list[str] = option(
        factory=list,
        doc="Held-out files or globs for validation; [] -> a deterministic split of data.paths.",
    )
    tokenizer: str = option(
        "",
        'a tokenizer.json; "" -> the default BPE trained on the default corpus',
    )
    token_dtype: Literal["uint16", "uint32"] = option("uint16", "of .bin token shards")
    cache_dir: str = option(
        "",
        '"" -> $GRAPHTRAIN_CACHE or ~/.cache/graphtrain',
    )

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
    lr: float = option(3e-4, "peak learning rate (after warm-up)")
    betas: list[float] = option(factory=lambda: [0.9, 0.95], doc="AdamW beta1, beta2")
    eps: float = option(1e-8, "AdamW epsilon")
    weight_decay: float = option(0.1, "decoupled weight decay, except for the no_decay parameters")
    no_decay: list[str] = option(
        factory=lambda: ["*norm*", "*bias", "tok_embeddings.*"],
        doc="Parameters (fnmatch on dotted names) without weight decay.",
    )
    implementation: Literal["auto", "fused", "foreach", "graphtrain"] = option(
        "auto",
        'AdamW kernel: torch\'s "fused" or "foreach", or "graphtrain" (fp32 masters: the '
        'step also writes the bf16 working copies, graphtrain.optim.adamw_copies); "auto": '
        "graphtrain for fp32 parameters on CUDA (measured faster: benchmarks/RESULTS.md), else "
        "fused where supported, else foreach.",
    )
    max_norm: float = option(1.0, "gradient clipping by the global norm; <= 0 disables clipping")
    state_dtype: Literal["float32", "bfloat16"] = option(
        "float32",
        "dtype of the AdamW moments: float32, or bfloat16 (half the memory; fp32 math, rounded to "
        "nearest on store; see graphtrain.optim.adamw_bf16).",
    )
    fp32_grad_accum: list[str] = option(
        factory=list,
        doc='Parameters (fnmatch on dotted names, e.g. "*norm*", "*.router.*") whose gradients '
        "are summed over the micro-batches in fp32 when training.master_dtype is bfloat16 (see "
        "graphtrain.optim.precision); fp32 parameters accumulate in fp32 anyway.",
    )

    def __post_init__(self) -> None:
        _check_choices("optim", self)
        _positive("optim", self, "lr")
        _positive("optim", self, "eps", "weight_decay", allow_zero=True)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")


@dataclass(frozen=True)
class ScheduleConfig:
    warmup_steps: int = option(
        -1,
        "Linear warm-up, in optimizer steps; -1: take schedule.warmup_ratio of training.steps.",
    )
    warmup_ratio: float = option(
        0.1,
        "Linear warm-up as a fraction of training.steps (used when warmup_steps is -1), so that a "
        "preset's schedule fits a shorter or longer run.",
    )
    decay_ratio: float = option(0.2, "the last decay_ratio of training.steps decay to min_lr")
    decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt", "inverse_sqrt"] = option(
        "cosine",
        "lr decay, Megatron-Core's formulas: linear, cosine, exponential, minus_sqrt over the "
        "last decay_ratio (step i of D at progress i/D: the last step one step short of min_lr, "
        "as Megatron-Core and torchtitan); inverse_sqrt: lr * sqrt(warmup / step) after warm-up.",
    )
    min_lr: float = option(
        3e-5,
        "learning rate the decay heads for (0 allowed); inverse_sqrt's floor",
    )
    batch_size: str = option(
        "",
        'Global batch size in tokens, optionally stepped on consumed tokens: "0:256K 50M:512K". '
        '"" -> one micro-batch per data-parallel rank per step (no accumulation).',
    )

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
    interval: int = option(0, "save every N steps; 0: none besides the final checkpoint")
    final: bool = option(
        True,
        "Save a checkpoint when training ends (whatever interval says), so that every run can be "
        "exported or continued; false: none at the end (the interval's saves stay).",
    )
    keep_last: int = option(2, "complete checkpoints kept (plus the retain_interval ones)")
    retain_interval: int = option(
        0,
        "Also keep every checkpoint whose step is a multiple of this; 0: only the last keep_last.",
    )
    resume: str = option(
        "",
        '"" none, "latest", a checkpoint of this run (step-0000100), or the path of another '
        "run's checkpoint folder (continued in this run's empty run dir)",
    )
    async_save: bool = option(
        False,
        "Write checkpoints in the background (DCP async_save); CUDA only.",
    )
    init_from_hf: str = option(
        "",
        "A Hugging Face safetensors directory (as `graphtrain export` writes) to start from, "
        "instead of a random init; ignored when resuming.",
    )
    fallback_on_corruption: bool = option(
        False,
        "resume=latest with a damaged newest checkpoint (a file whose digest differs): resume "
        "from the newest intact one instead of stopping.",
    )
    save_on_signal: bool = option(
        True,
        "SIGTERM/SIGINT: finish the step, save a checkpoint (unless interval = 0 and final = "
        "false), exit with code 75.",
    )

    def __post_init__(self) -> None:
        _positive("checkpoint", self, "interval", "retain_interval", allow_zero=True)
        _positive("checkpoint", self, "keep_last")


@dataclass(frozen=True)
class MetricsConfig:
    log_interval: int = option(10, "optimizer steps between log lines (a host sync each)")
    validate: bool = option(
        True, "the held-out loss at step 0, every val_interval steps and at the end; false: never"
    )
    val_interval: int = option(100, "steps between validations; 0: only at step 0 and at the end")
    val_batches: int = option(8, "held-out micro-batches per validation")
    val_rows: int = option(
        0,
        "Held-out rows (sequences of seq_len) evaluated at each validation, split over the ranks: "
        "the same rows for any layout. 0: val_batches x training.micro_batch_size.",
    )
    tensorboard: bool = option(True, "also write TensorBoard events to run_dir/tb")
    peak_tflops: float = option(0.0, "per device, for MFU; 0 -> from the device name, if known")
    profile_steps: str = option(
        "",
        'Optimizer steps to run under the torch profiler, e.g. "10-12" (a trace per rank in '
        'run_dir/profile/); "" -> none.',
    )
    memory_snapshot: bool = option(
        False,
        "Also record a CUDA memory snapshot over profile_steps (run_dir/memory/); CUDA only.",
    )

    def __post_init__(self) -> None:
        _positive("metrics", self, "log_interval", "val_batches")
        _positive("metrics", self, "val_interval", "peak_tflops", "val_rows", allow_zero=True)
        parse_step_range(self.profile_steps)


@dataclass(frozen=True)
class JobConfig:
    preset: str = option("tiny", "the job preset the values start from")
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
        if self.training.activation_memory_budget < 1 and not self.compile.enable:
            raise ValueError(
                f"training.activation_memory_budget={self.training.activation_memory_budget} "
                "needs compile.enable=true (the compiler's partitioner applies it)"
            )
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
