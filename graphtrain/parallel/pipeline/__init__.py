"""Pipeline parallelism: the plain model cut into stages on the outermost mesh axis "pp", driven
by a torch.distributed.pipelining schedule, each stage's blocks and head+loss compiled as in one
process (graphtrain.compile), so every pass (the fused loss in the last stage) still applies.

What
    layout.py   parse_layout / check_pipeline: parallel.pp_layout or an even split, checked at
                start; bubble_fraction / in_flight_micro_batches (graphtrain plan, the log)
    stages.py   cut_model: the meta-device model pruned to this rank's stages (the whole
                model's parameter names), the PipelineStageModules the schedule runs
    runner.py   PipelineRunner (the step's micro-batches through the schedule; model(...) runs
                every stage for validation), clip_grad_norm_pp_ / norm_over_stages,
                SharedCopies (an MTP stage's copies of the embedding, norm and head)

Contract: every rank of a pp group holds the same batches; every step has the same rows; under
tp the stages exchange plain (B, T / tp, dim) slices. Numerics: in fp32 the loss and gradients
equal the single-process step's up to the order of fp32 sums (tested to 1e-5 over 10 steps).
Design, each piece in full, and what is not done yet: docs/design/pipeline.md.
"""

from graphtrain.parallel.pipeline.layout import (
    SCHEDULES,
    StageSpec,
    bubble_fraction,
    check_pipeline,
    in_flight_micro_batches,
    parse_layout,
    pipeline_microbatches,
    schedule_class,
    stage_rank,
    stage_tp_plan,
    stages_per_rank,
)
from graphtrain.parallel.pipeline.runner import (
    PipelineRunner,
    SharedCopies,
    build_runner,
    clip_grad_norm_pp_,
    cut_pipeline,
    norm_over_stages,
)
from graphtrain.parallel.pipeline.stages import PipelineStageModule, cut_model, fsdp_roots

__all__ = [
    "SCHEDULES",
    "PipelineRunner",
    "PipelineStageModule",
    "SharedCopies",
    "StageSpec",
    "bubble_fraction",
    "build_runner",
    "check_pipeline",
    "clip_grad_norm_pp_",
    "cut_model",
    "cut_pipeline",
    "fsdp_roots",
    "in_flight_micro_batches",
    "norm_over_stages",
    "parse_layout",
    "pipeline_microbatches",
    "schedule_class",
    "stage_rank",
    "stage_tp_plan",
    "stages_per_rank",
]
