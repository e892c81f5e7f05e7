"""`graphtrain eval`: the token-weighted loss of a run on files, as the trainer computes it."""

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from graphtrain.attention import build_attention_mask
from graphtrain.checkpoint.trained import load_trained
from graphtrain.cli import main
from graphtrain.data.packing import pack_rows
from graphtrain.evaluate import evaluate


def test_eval_is_the_mean_loss_over_every_labelled_token(debug_run, corpus, tmp_path, capsys):
    trained = load_trained(debug_run, "cpu")
    docs = [json.loads(x)["text"] for x in (corpus / "docs.jsonl").read_text().splitlines()]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:40]))
    # One row per micro-batch: every row of the files is evaluated once (in a shuffled order,
    # which a mean does not see).
    result = evaluate(trained, [str(held)], micro_batch_size=1)
    # Reference: the packed stream (each document, then eos) cut into rows of seq_len + 1, the
    # cross-entropy of every labelled token in float64, within-document attention.
    tok, seq = trained.tokenizer, trained.cfg.training.seq_len
    stream = [t for d in docs[:40] for t in [*tok.encode(d), tok.eos_id]]
    rows = (len(stream) - 1) // seq
    assert rows >= 4 and result.batches == rows
    total, count = 0.0, 0
    for i in range(rows):
        batch = pack_rows(torch.tensor([stream[i * seq : i * seq + seq + 1]]).numpy(), tok.eos_id)
        mask = build_attention_mask(batch["document_ids"], "sdpa")
        with torch.no_grad():
            logits = trained.model(batch["input_ids"], None, batch["position_ids"], mask)[0]
        labels = batch["labels"][0]
        keep = labels != -100
        ce = F.cross_entropy(logits.double(), labels.clamp(min=0), reduction="none")
        total += ce[keep].sum().item()
        count += int(keep.sum())
    assert result.tokens == count
    # float32 model, per-row means in float32: 1e-5 relative is a few ulps of ~6 nats.
    assert result.loss == pytest.approx(total / count, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)
    assert main(["eval", str(debug_run), "--data", str(held), "--device=cpu"]) == 0
    # The CLI's default micro-batch (the run's) leaves out the rows short of a full one.
    assert re.fullmatch(
        r"\S+step-0000006: loss \d+\.\d{4} \| perplexity \d+\.\d\d \| [\d,]+ tokens in \d+ batches\n",
        capsys.readouterr().out,
    )
    with pytest.raises(ValueError, match="fewer than one micro-batch"):
        evaluate(trained, [str(held)], micro_batch_size=rows + 1)
