"""BatchSizeSchedule: parsing (K = 1024 rule), thresholds, micro-batch math, errors."""

import pytest

from graphtrain.optim import BatchSizeSchedule, parse_token_count

K, M = 1024, 1024**2


def test_parse_token_count():
    assert parse_token_count("4096") == 4096
    assert parse_token_count("256K") == 262144
    assert parse_token_count("50m") == 50 * M
    assert parse_token_count("1G") == 1024**3
    for bad in ("", "1.5M", "12Q", "-5", "K"):
        with pytest.raises(ValueError, match="bad token count"):
            parse_token_count(bad)


def test_parse_and_thresholds():
    schedule = BatchSizeSchedule.parse("0:256K 50M:512K 200M:1M")
    assert schedule.entries == [(0, 256 * K), (50 * M, 512 * K), (200 * M, M)]
    assert schedule.tokens_per_step(0) == 256 * K
    assert schedule.tokens_per_step(50 * M - 1) == 256 * K
    assert schedule.tokens_per_step(50 * M) == 512 * K
    assert schedule.tokens_per_step(200 * M - 1) == 512 * K
    assert schedule.tokens_per_step(10**12) == M
    # Commas work as separators too.
    assert BatchSizeSchedule.parse("0:1K, 8K:2K").entries == [(0, K), (8 * K, 2 * K)]


def test_constant():
    for schedule in (
        BatchSizeSchedule.constant(524288),
        BatchSizeSchedule.parse(524288),
        BatchSizeSchedule.parse("512K"),
    ):
        assert schedule.entries == [(0, 524288)]
        assert schedule.tokens_per_step(0) == schedule.tokens_per_step(10**15) == 524288


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("10:256K 50M:512K", r"entry 0 \(10:262144\).*first threshold must be 0"),
        ("0:1K 5M:2K 5M:4K", r"entry 2 \(5242880:4096\).*strictly increase"),
        ("0:1K 5M:2K 1M:4K", r"entry 2 \(1048576:4096\)"),
        ("0:0", "batch size must be positive"),
        ("0:1K:2", "bad batch-size schedule entry '0:1K:2'"),
        ("0:256Q", "bad token count '256Q'"),
        ("", "empty"),
    ],
)
def test_parse_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        BatchSizeSchedule.parse(spec)


def test_micro_batches():
    schedule = BatchSizeSchedule.parse("0:256K 1M:512K")
    kw = dict(micro_batch_size=4, seq_len=4096, dp_world_size=2)
    assert schedule.micro_batches_per_step(0, **kw) == 8  # 262144 / 32768
    assert schedule.micro_batches_per_step(M, **kw) == 16
    schedule.check(**kw)


def test_micro_batch_errors_name_all_numbers():
    schedule = BatchSizeSchedule.parse("0:256K")
    with pytest.raises(ValueError) as info:
        schedule.micro_batches_per_step(0, micro_batch_size=3, seq_len=4096, dp_world_size=2)
    for number in ("262144", "(3)", "(4096)", "(2)", "24576"):
        assert number in str(info.value)
    # Fewer tokens than one micro-batch on every rank is not a positive integer either.
    with pytest.raises(ValueError, match="not a positive multiple"):
        BatchSizeSchedule.constant(4096).micro_batches_per_step(
            0, micro_batch_size=2, seq_len=4096, dp_world_size=1
        )
    with pytest.raises(ValueError, match="dp_world_size must be positive, got 0"):
        schedule.micro_batches_per_step(0, micro_batch_size=1, seq_len=8, dp_world_size=0)
    # check() finds a bad later entry at startup.
    with pytest.raises(ValueError, match="393216"):
        BatchSizeSchedule.parse("0:256K 1M:384K").check(
            micro_batch_size=1, seq_len=4096, dp_world_size=64
        )


def test_state_dict_round_trip():
    schedule = BatchSizeSchedule.parse("0:256K 50M:512K")
    other = BatchSizeSchedule.constant(1)
    other.load_state_dict(schedule.state_dict())
    assert other.entries == schedule.entries
