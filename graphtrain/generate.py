"""`graphtrain generate RUN_DIR --prompt TEXT`: sample a continuation from a trained run.

Greedy (temperature 0) or temperature + nucleus (top-p) sampling from the newest complete
checkpoint, on the CPU or a GPU. Each new token runs the whole context through the model again
(no KV cache): the plain model's forward, right for looking at what a small run learned, not a
serving path. The context is cut to the model's max_seq_len from the left.

Numerics: logits are taken in float32; top-p keeps the smallest set of most likely tokens whose
probability sums to at least top_p (the most likely token always), renormalised.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from graphtrain.checkpoint.trained import load_trained
from graphtrain.cli import DefaultsHelp


def sample_next(
    logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Next token ids (B,) from last-position logits (B, V)."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(
            f"temperature must be >= 0 and top_p in (0, 1], got {temperature} and {top_p}"
        )
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # A token is kept when the mass before it is still short of top_p (so the first always is).
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    choice = torch.multinomial(sorted_probs, 1, generator=generator)  # renormalises itself
    return order.gather(-1, choice).squeeze(-1)


@torch.no_grad()
def generate_ids(
    model: nn.Module,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    max_seq_len: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    device: torch.device | str = "cpu",
) -> list[int]:
    """The new token ids after `prompt_ids` (stops early at `eos_id`)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one token of text")
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt_ids], device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(ids[:, -max_seq_len:])[:, -1]  # (1, V)
        token = sample_next(logits, temperature=temperature, top_p=top_p, generator=generator)
        new.append(int(token))  # host sync per token: generation is sequential anyway
        if eos_id is not None and new[-1] == eos_id:
            break
        ids = torch.cat([ids, token[:, None]], dim=1)
    return new


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelp,
        prog="graphtrain generate",
        description="Continue a prompt with the newest checkpoint of a run (greedy when "
        "--temperature=0).",
    )
    parser.add_argument("source", help="a run directory (its newest checkpoint) or a checkpoint")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ns = parser.parse_args(args)
    trained = load_trained(ns.source, ns.device)
    tok = trained.tokenizer
    new = generate_ids(
        trained.model,
        tok.encode(ns.prompt),
        max_new_tokens=ns.max_new_tokens,
        max_seq_len=trained.cfg.model.max_seq_len,
        temperature=ns.temperature,
        top_p=ns.top_p,
        seed=ns.seed,
        eos_id=tok.eos_id,
        device=trained.device,
    )
    print(ns.prompt + tok.decode(new))
    return 0
