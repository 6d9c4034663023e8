"""The pilot's curve (issue 59): a saturating fit through nested fractions' acceptance, its
bootstrap interval, back-test and the reasons not to trust it, on points of known curves."""

from __future__ import annotations

import math

import pytest

from draftflow.pilot_fit import Replayed, back_test, bootstrap, fit_saturating, trust_problems

SIZES = [125, 250, 500, 1000]


def on_curve(n: float, ceiling: float = 4.0, scale: float = 30.0, exponent: float = 0.5) -> float:
    return ceiling - scale * n**-exponent


def replayed(samples: int, tau: float, requests: int = 40, drafts: int = 50) -> Replayed:
    """Requests whose replay gives ``tau`` overall: each ``drafts`` drafts, accepted tokens spread
    around the mean (alternately one above and one below), so a resampling moves τ a little."""
    mean = (tau - 1) * drafts
    accepted = [round(mean + (1 if i % 2 else -1) * (i % 5)) for i in range(requests)]
    shift = round(mean * requests) - sum(accepted)
    accepted[0] += shift
    return Replayed(samples, [drafts] * requests, accepted)


def test_a_known_curve_is_recovered_and_predicts_past_its_points():
    fit = fit_saturating(SIZES, [on_curve(n) for n in SIZES])
    assert (fit.ceiling, fit.scale, fit.exponent) == pytest.approx((4.0, 30.0, 0.5), rel=0.02)
    assert fit.predict(8000) == pytest.approx(on_curve(8000), abs=0.01)
    assert fit.samples_for(3.5) == pytest.approx((30.0 / 0.5) ** 2, rel=0.05)
    assert fit.samples_for(4.5) == math.inf


def test_acceptance_that_does_not_rise_has_no_saturating_fit_and_says_so():
    falling = [3.0, 2.9, 2.8, 2.7]
    assert fit_saturating(SIZES, falling) is None
    points = [replayed(n, tau) for n, tau in zip(SIZES, falling)]
    assert any("does not rise" in problem for problem in trust_problems(points, None))
    assert fit_saturating(SIZES[:2], [2.0, 2.5]) is None  # fewer points than parameters


def test_the_back_test_predicts_the_largest_fraction_from_the_others():
    points = [replayed(n, on_curve(n)) for n in SIZES]
    tested = back_test(points)
    assert tested["samples"] == 1000 and tested["measured"] == pytest.approx(on_curve(1000), abs=0.01)
    assert abs(tested["error"]) < 0.05
    assert back_test(points[:3]) is None


def test_the_bootstrap_interval_holds_the_fit_and_widens_past_the_points():
    points = [replayed(n, on_curve(n)) for n in SIZES]
    fit = fit_saturating(SIZES, [p.tau() for p in points])
    intervals = bootstrap(points, [500, 16000], draws=100)
    assert intervals == bootstrap(points, [500, 16000], draws=100)  # seeded
    for n, (low, high) in intervals.items():
        assert low <= fit.predict(n) <= high
    assert intervals[16000][1] - intervals[16000][0] > intervals[500][1] - intervals[500][0]


def test_a_fit_without_curvature_or_with_few_points_is_flagged():
    straight = [replayed(n, 1.5 + 0.3 * i) for i, n in enumerate(SIZES)]  # the same gain every doubling
    assert any("no curvature" in problem for problem in trust_problems(straight, fit_saturating(SIZES, [p.tau() for p in straight])))
    curved = [replayed(n, on_curve(n)) for n in SIZES]
    assert trust_problems(curved, fit_saturating(SIZES, [p.tau() for p in curved])) == []
    assert any("3 points" in problem for problem in trust_problems(curved[:3], fit_saturating(SIZES[:3], [p.tau() for p in curved[:3]])))
