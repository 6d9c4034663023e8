import pytest

from draftflow.vocab import coverage_curve


def test_coverage_counts_top_k_occurrences():
    freq = {5: 50, 7: 30, 9: 15, 11: 5}
    curve = coverage_curve(freq, [1, 2, 4, 100])
    assert curve == pytest.approx({1: 0.5, 2: 0.8, 4: 1.0, 100: 1.0})
