"""Metrics: FLOPs and MFU inputs, hardware peaks and memory, logging, run info."""

from graphtrain.metrics.flops import (
    dense_causal_pairs,
    document_causal_pairs,
    model_training_flops,
    training_flops,
)
from graphtrain.metrics.hardware import (
    memory_stats,
    peak_flops,
    peak_flops_for_name,
    reset_memory_stats,
)
from graphtrain.metrics.logger import MetricsLogger, format_summary
from graphtrain.metrics.progress import ProgressBar
from graphtrain.metrics.run_info import collect_run_info, git_info, write_run_info

__all__ = [
    "MetricsLogger",
    "ProgressBar",
    "collect_run_info",
    "dense_causal_pairs",
    "document_causal_pairs",
    "format_summary",
    "git_info",
    "memory_stats",
    "model_training_flops",
    "peak_flops",
    "peak_flops_for_name",
    "reset_memory_stats",
    "training_flops",
    "write_run_info",
]
