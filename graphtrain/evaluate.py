"""`graphtrain eval RUN_DIR --data FILES`: loss and perplexity of a trained run on held-out text.

The files are read, tokenized with the run's tokenizer and packed exactly as in training
(documents separated by the end-of-document token, rows of training.seq_len + 1 tokens,
attention within documents and positions reset at their starts), so the number is comparable
with the run's val_loss. Every full micro-batch of rows is evaluated once.

Numerics: each micro-batch's mean cross-entropy is weighted by its labelled tokens, so the
result is the mean over all labelled tokens, summed as validation sums it (graphtrain.step.
loss_sums: fp32 on the device); perplexity is exp(loss).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import tempfile
from dataclasses import dataclass

import torch

from graphtrain.attention import resolve_attention
from graphtrain.checkpoint.trained import TrainedModel, load_trained
from graphtrain.cli import DefaultsHelp
from graphtrain.data import build_data
from graphtrain.optim import WorkingWeights
from graphtrain.step import ForwardLoss, loss_sums


@dataclass
class EvalResult:
    loss: float  # mean cross-entropy per labelled token, nats
    perplexity: float
    tokens: int  # labelled tokens evaluated
    batches: int


@torch.no_grad()
def evaluate(
    trained: TrainedModel,
    files: list[str],
    *,
    micro_batch_size: int | None = None,
    max_batches: int | None = None,
) -> EvalResult:
    """Loss and perplexity of `trained` over the text `files` (globs allowed)."""
    cfg, device = trained.cfg, trained.device
    mbs = micro_batch_size or cfg.training.micro_batch_size
    with tempfile.TemporaryDirectory() as cache:
        data = build_data(
            paths=files,
            tokenizer_path=str(trained.tokenizer.path),
            vocab_size=cfg.model.vocab_size,
            seq_len=cfg.training.seq_len,
            micro_batch_size=mbs,
            dp_rank=0,
            dp_world_size=1,
            seed=0,
            cache_dir=cache,
            val_paths=files,  # every document evaluated: no hold-out split of these files
            token_dtype=cfg.data.token_dtype,
        )
    loader = data.val
    batches = loader.num_windows // mbs
    if batches == 0:
        raise ValueError(
            f"--data {files} holds {loader.num_windows} rows of training.seq_len + 1 = "
            f"{cfg.training.seq_len + 1} tokens, fewer than one micro-batch of {mbs}; "
            "give more text or a smaller --micro-batch-size"
        )
    if max_batches:
        batches = min(batches, max_batches)
    # A run trained with flex or varlen attention (CUDA) evaluates with SDPA on a CPU: the same
    # mask.
    trained_with = cfg.training.attention
    kind = "auto" if trained_with in ("auto", "flex", "varlen") else trained_with
    attention = resolve_attention(kind, device)
    no_copies = WorkingWeights(trained.model, [], torch.float32)  # the model's weights as loaded
    forward = ForwardLoss(trained.model, device, attention, contextlib.nullcontext(), no_copies)
    total, tokens = loss_sums(forward, (next(loader) for _ in range(batches))).tolist()
    mean = total / max(tokens, 1)
    return EvalResult(loss=mean, perplexity=math.exp(mean), tokens=int(tokens), batches=batches)


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelp,
        prog="graphtrain eval",
        description="Loss and perplexity of a run's newest checkpoint on held-out text files.",
    )
    parser.add_argument("source", help="a run directory (its newest checkpoint) or a checkpoint")
    parser.add_argument(
        "--data", nargs="+", required=True, help=".txt/.jsonl/.parquet files or globs"
    )
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--max-batches", type=int, default=None, help="evaluate at most this many")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ns = parser.parse_args(args)
    trained = load_trained(ns.source, ns.device)
    result = evaluate(
        trained, ns.data, micro_batch_size=ns.micro_batch_size, max_batches=ns.max_batches
    )
    print(
        f"{trained.checkpoint}: loss {result.loss:.4f} | perplexity {result.perplexity:.2f} | "
        f"{result.tokens:,} tokens in {result.batches} batches"
    )
    return 0
