"""The benches' paired ratio: per round, then summarised (kvferry.bench.harness.paired_ratio)."""

import pytest

from kvferry.bench.harness import paired_ratio, spread


def test_ratio_is_taken_within_each_round_not_of_the_medians():
    # round 2 is slow for every call (drift): per round the bound is 0.5 of the call each time
    times = {"get": [1.0, 10.0, 1.0], "floor": [1.0, 10.0, 1.0], "hit": [4.0, 40.0, 4.0]}
    r = paired_ratio(times, ("get", "floor"), ("hit",))
    assert r == {"median": 0.5, "q1": 0.5, "q3": 0.5}


def test_quartiles_show_the_spread_over_rounds():
    times = {"a": [1.0, 2.0, 3.0, 4.0, 5.0], "b": [1.0] * 5}
    r = paired_ratio(times, ("a",), ("b",))
    assert r["median"] == 3.0 and r["q1"] == 2.0 and r["q3"] == 4.0
    assert spread(r) == "3.00 [2.00, 4.00]"


def test_one_round_has_no_spread():
    assert paired_ratio({"a": [2.0], "b": [4.0]}, ("a",), ("b",)) == pytest.approx(
        {"median": 0.5, "q1": 0.5, "q3": 0.5}
    )
