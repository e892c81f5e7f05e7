"""Pipeline parallelism: the plain model cut into stages on the outermost mesh axis "pp", driven
by a torch.distributed.pipelining schedule, each stage's blocks and head+loss compiled as in one
process (graphtrain.compile), so every pass (the fused loss in the last stage) still applies.
Design and what is not done yet: docs/design/pipeline.md.

What
    parse_layout / check_pipeline (layout.py): parallel.pp_layout (E, t, m, L, |, "x*n") or an
        even split, checked against the model, the schedule and the batch at start (one-line
        ValueError naming the stage and the count: `graphtrain train --check` exits 2);
        bubble_fraction / in_flight_micro_batches: the schedule's predicted idle share and
        the activations each rank keeps (graphtrain plan, the log).
    cut_model (stages.py) prunes the meta-device model in place to this rank's stages (the whole model's
        parameter names: TP plan, FSDP, optimizer, checkpoints unchanged) and returns the
        PipelineStageModules the schedule runs (FSDP2's root units under pp). Afterwards
        model.init_weights(seed) gives every parameter the whole model's value.
    PipelineRunner.forward_backward(batches, hooks) (runner.py): the step's rows split into
        pp_microbatches pieces, each loss weighted by its share of the labelled tokens; MoE
        routers scaled and counted per stage; the loss all-reduced to every pp rank.
        model(**inputs) (= PipelineRunner.forward) runs every stage in order (validation).
    clip_grad_norm_pp_ / norm_over_stages: norms over all stages. SharedCopies: an MTP
        stage's copies of the embedding, norm and head, their gradients summed with their
        owners' once per step.

Contract: every rank of a pp group holds the same batches (pp ranks share a data-parallel
index); every step has the same rows (the stages' activation shapes are given to the schedule,
none inferred); under tp the stages exchange plain (B, T / tp, dim) slices.
Numerics: in fp32 the loss and gradients equal the single-process step's up to the order of
fp32 sums (tested to 1e-5 relative over 10 steps; measured a few 1e-7).
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
from graphtrain.parallel.pipeline.stages import PipelineStageModule, cut_model

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
    "in_flight_micro_batches",
    "norm_over_stages",
    "parse_layout",
    "pipeline_microbatches",
    "schedule_class",
    "stage_rank",
    "stage_tp_plan",
    "stages_per_rank",
]
