"""Blends of sources (data.paths + data.weights): proportions, determinism, exact resume on
another layout, and the config and build_data checks."""

import json
import re

import numpy as np
import pytest

from graphtrain.config import load_config
from graphtrain.data import build_data
from graphtrain.data.blend import BLOCK, BlendedLoader, blend_schedule
from graphtrain.data.loader import PackedLoader

SEQ = 8


def _sources(sizes=(4000, 900, 2500)):
    """Token streams whose ids say their source: source s holds ids in [100 s, 100 s + 100)."""
    rng = np.random.default_rng(0)
    return [
        PackedLoader(
            rng.integers(100 * s, 100 * s + 100, n),
            seq_len=SEQ,
            micro_batch_size=1,
            vocab_size=400,
            eos_id=None,
        )
        for s, n in enumerate(sizes)
    ]


def _blend(weights, **kw):
    return BlendedLoader(_sources(), weights, eos_id=None, **{"micro_batch_size": 4, **kw})


def _source_of_rows(td):
    return (td["input_ids"][:, 0] // 100).tolist()


def test_every_prefix_holds_the_weights_share():
    weights = [0.5, 0.2, 0.3]
    loader = _blend(weights)
    seen = []
    for _ in range(800):  # 3200 rows: several blocks, the small source repeated
        seen += _source_of_rows(next(loader))
    counts = np.zeros(3)
    for n, s in enumerate(seen, start=1):
        counts[s] += 1
        # Greedy per block: each prefix is within a row of its share, plus one per block edge.
        assert np.all(np.abs(counts - np.array(weights) * n) <= 1 + n // BLOCK), (n, counts)
    assert counts.tolist() == [1600, 640, 960]


def test_unnormalised_weights_and_the_schedule():
    source, index = blend_schedule([7, 3], block=10)
    # By hand: each position goes to the source furthest behind 0.7 n / 0.3 n (ties: the first).
    assert source.tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]
    assert index.tolist() == [0, 0, 1, 2, 3, 1, 4, 5, 2, 6]
    for bad in ([], [1, 0], [1, float("nan")]):
        with pytest.raises(ValueError, match=re.escape("data.weights must be positive")):
            blend_schedule(bad)


def test_rows_are_each_sources_own_order_and_resume_exactly_on_another_layout():
    straight = _blend([0.6, 0.1, 0.3])
    rows = np.concatenate([next(straight)["input_ids"].numpy() for _ in range(30)])
    # The blend's rows of source d are source d's rows in its own order, none skipped.
    for d, src in enumerate(_sources()):
        mine = [r for r in rows if r[0] // 100 == d]
        assert all(np.array_equal(r, src.row(k)[:-1]) for k, r in enumerate(mine))
    first = _blend([0.6, 0.1, 0.3])
    for _ in range(10):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    # Continue on two data-parallel ranks with micro-batches of 2: the same global rows.
    ranks = [
        _blend([0.6, 0.1, 0.3], micro_batch_size=2, dp_rank=r, dp_world_size=2) for r in (0, 1)
    ]
    for rank in ranks:
        rank.load_state_dict(state)
    resumed = np.concatenate(
        [np.concatenate([next(rank)["input_ids"].numpy() for rank in ranks]) for _ in range(20)]
    )
    assert np.array_equal(resumed, rows[40:])
    other = _blend([0.5, 0.2, 0.3])
    with pytest.raises(ValueError, match=re.escape("blends data.weights=[0.6, 0.1, 0.3]")):
        other.load_state_dict(state)


def test_config_and_build_data(corpus, tmp_path):
    with pytest.raises(ValueError, match=re.escape("needs one weight per entry of data.paths")):
        load_config(["--data.paths=a.txt,b.txt", "--data.weights=[0.5]"])
    with pytest.raises(ValueError, match=re.escape("data.weights must all be > 0, got [1.0, 0.0]")):
        load_config(["--data.paths=a.txt,b.txt", "--data.weights=[1, 0]"])
    docs = [json.loads(x)["text"] for x in (corpus / "docs.jsonl").read_text().splitlines()]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.txt"
    a.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:300]))
    b.write_text("zeta " * 3000)  # a source whose rows are easy to tell apart
    data = build_data(
        paths=[str(a), str(b)],
        tokenizer_path=str(corpus / "tokenizer.json"),
        vocab_size=300,
        seq_len=32,
        micro_batch_size=10,
        dp_rank=0,
        dp_world_size=1,
        seed=0,
        cache_dir=tmp_path / "cache",
        weights=[0.7, 0.3],
    )
    assert isinstance(data.train, BlendedLoader)
    zeta = set(data.tokenizer.encode(" zeta zeta"))
    from_b = sum(
        set(row.tolist()) <= zeta for _ in range(20) for row in next(data.train)["input_ids"]
    )
    assert from_b == 60  # 30% of 200 rows
    assert data.val is not None  # each source's hold-out, together


def test_a_blended_run_resumes_exactly(corpus, tmp_path):
    from conftest import job

    from graphtrain.trainer import train

    docs = [json.loads(x)["text"] for x in (corpus / "docs.jsonl").read_text().splitlines()]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:200]))
    b.write_text("".join(json.dumps({"text": d.upper()}) + "\n" for d in docs[200:]))
    blend = [f"--data.paths={a},{b}", "--data.weights=[0.7, 0.3]", "--compile.enable=false"]
    common = [*blend, "--training.steps=4", "--metrics.log_interval=1"]
    straight = train(load_config(job(corpus, tmp_path / "s", *common)))
    args = job(corpus, tmp_path / "r", *common, "--checkpoint.interval=2")
    train(load_config(args))
    ckpt = tmp_path / "r" / "run" / "checkpoints" / "step-0000002"
    fork = [*args, f"--checkpoint.resume={ckpt}", f"--training.run_dir={tmp_path / 'fork'}"]
    resumed = train(load_config(fork))
    assert resumed.losses == straight.losses[2:]
