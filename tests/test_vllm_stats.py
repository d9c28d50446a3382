"""The connector's per-interval figures (``stats.IntervalStats``): what vLLM sums across
ranks and intervals, and what its log line says. Plain Python, no vLLM."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvxfer.client.integrations.vllm.stats import (
    COUNTS,
    LISTS,
    IntervalStats,
    empty_figures,
    is_empty,
    merge,
    summary,
)

events = st.lists(st.one_of(
    st.tuples(st.sampled_from(["load", "save"]), st.floats(0, 30), st.integers(0, 2**34),
              st.integers(1, 4096)),
    st.tuples(st.sampled_from(COUNTS), st.sampled_from(["A", "B", "C"]))), max_size=30)


def recorded(batch: list[tuple]) -> IntervalStats:
    stats = IntervalStats()
    for event in batch:
        if event[0] == "load":
            stats.load(*event[1:])
        elif event[0] == "save":
            stats.save(*event[1:])
        else:
            stats.count(*event)
    return stats


@given(events, st.integers(0, 30))
def test_figures_split_between_ranks_or_intervals_sum_to_the_whole(batch, cut) -> None:
    whole = recorded(batch).take() or empty_figures()
    first = recorded(batch[:cut]).take() or empty_figures()
    second = recorded(batch[cut:]).take() or empty_figures()
    merged = merge(first, second)
    for name in LISTS:
        assert sorted(merged[name]) == sorted(whole[name])
    for name in COUNTS:
        assert merged[name] == whole[name]


@given(events)
def test_take_hands_over_the_interval_once(batch) -> None:
    stats = recorded(batch)
    taken = stats.take()
    assert (taken is None) == (len(batch) == 0)
    assert stats.take() is None


def test_a_failure_alone_is_not_an_empty_interval_and_the_summary_counts_it() -> None:
    stats = IntervalStats()
    stats.count("failed_loads", "INTEGRITY_CHECK_FAILED")
    figures = stats.take()
    assert figures is not None and not is_empty(figures)
    assert summary(figures)["Failed loads"] == 1 and summary(figures)["Loads"] == 0


def test_the_summary_of_two_loads() -> None:
    stats = IntervalStats()
    stats.load(0.002, 2**20, 1)
    stats.load(0.006, 3 * 2**20, 2)
    out = summary(stats.take() or empty_figures())
    assert out["Loads"] == 2 and out["Avg load time (ms)"] == 4.0 and out["Max load time (ms)"] == 6.0
    assert out["Load throughput (MB/s)"] == 500.0


def test_figures_from_another_version_missing_keys_merge_as_empty() -> None:
    merged = merge(empty_figures(), {"load_seconds": [0.5], "failed_loads": {"X": 2}})
    assert merged["load_seconds"] == [0.5] and merged["load_bytes"] == []
    assert merged["failed_loads"] == {"X": 2} and merged["errors"] == {}
