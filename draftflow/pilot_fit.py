"""What more data buys (issue 59): a saturating curve through the acceptance that nested
fractions of a sample budget trained to, with a bootstrap interval and a back-test.

The curve is the EAGLE-3 paper's shape (Fig. 1: τ rising by less each doubling of ShareGPT),
τ(n) = τ∞ − a·n^(−b) with a, b > 0: for a fixed exponent b the ceiling τ∞ and the scale a are
a linear least-squares fit, so b is searched on a grid and the best of those kept. Each point's
τ is the decoding replay's over the same held-out requests (``Replayed``: each request's drafts
and accepted tokens), so the bootstrap draws requests, the same draw for every point, and
fits again. Where a fit is not to be trusted (too few points, no curvature, acceptance that
does not rise) ``trust_problems`` says so in words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The last fraction's gain must fall under this share of the first's for the curve to show
# that it saturates.
CURVATURE = 0.8
EXPONENTS = torch.logspace(math.log10(0.02), math.log10(3.0), 300, dtype=torch.float64)


@dataclass(frozen=True)
class SaturatingFit:
    ceiling: float  # τ∞, what unlimited data would give
    scale: float  # a
    exponent: float  # b
    rms_error: float  # of the fit at its points

    def predict(self, samples: float) -> float:
        return self.ceiling - self.scale * samples ** (-self.exponent)

    def samples_for(self, tau: float) -> float:
        """Samples the curve reaches ``tau`` at (infinite at or above its ceiling)."""
        if tau >= self.ceiling:
            return math.inf
        return (self.scale / (self.ceiling - tau)) ** (1 / self.exponent)


def fit_saturating(samples: list[float], taus: list[float]) -> SaturatingFit | None:
    """The least-squares τ∞ − a·n^(−b) through the points, a and b positive; None where no such
    curve fits better than a flat line (acceptance that does not rise with data) or with fewer
    than three points (three parameters)."""
    if len(samples) < 3:
        return None
    n = torch.tensor(samples, dtype=torch.float64)
    tau = torch.tensor(taus, dtype=torch.float64)
    powers = n[None, :] ** -EXPONENTS[:, None]  # [exponents, points]
    design = torch.stack([torch.ones_like(powers), -powers], dim=2)
    solution = torch.linalg.lstsq(design, tau.expand(len(EXPONENTS), -1)[:, :, None]).solution[:, :, 0]
    errors = ((design @ solution[:, :, None])[:, :, 0] - tau).pow(2).mean(1).sqrt()
    errors[solution[:, 1] <= 0] = math.inf  # a curve that falls with data
    best = int(errors.argmin())
    if not math.isfinite(float(errors[best])):
        return None
    return SaturatingFit(float(solution[best, 0]), float(solution[best, 1]), float(EXPONENTS[best]), float(errors[best]))


@dataclass(frozen=True)
class Replayed:
    """One point's decoding replay, request by request (the same held-out requests at every point)."""

    samples: int  # training samples it was trained on
    drafts: list[int]  # per request
    accepted: list[int]  # accepted tokens per request

    def tau(self, draw: torch.Tensor | None = None) -> float:
        drafts, accepted = torch.tensor(self.drafts), torch.tensor(self.accepted)
        if draw is not None:
            drafts, accepted = drafts[draw], accepted[draw]
        return 1.0 + float(accepted.sum()) / max(1, int(drafts.sum()))


def bootstrap(points: list[Replayed], at: list[float], draws: int = 200, seed: int = 0, level: float = 0.9) -> dict[float, tuple[float, float]]:
    """The ``level`` interval of the fit's prediction at each sample count of ``at``, over
    ``draws`` resamplings of the held-out requests (one draw shared by every point)."""
    generator = torch.Generator().manual_seed(seed)
    requests = len(points[0].drafts)
    predictions: dict[float, list[float]] = {n: [] for n in at}
    for _ in range(draws):
        draw = torch.randint(0, requests, (requests,), generator=generator)
        fit = fit_saturating([p.samples for p in points], [p.tau(draw) for p in points])
        if fit is None:
            continue
        for n in at:
            predictions[n].append(fit.predict(n))
    low, high = (1 - level) / 2, 1 - (1 - level) / 2
    return {n: (float(torch.tensor(v).quantile(low)), float(torch.tensor(v).quantile(high))) if v else (math.nan, math.nan)
            for n, v in predictions.items()}  # fmt: skip


def back_test(points: list[Replayed]) -> dict | None:
    """The fit through all but the largest point, asked for the largest: predicted, measured, error."""
    if len(points) < 4:
        return None
    fit = fit_saturating([p.samples for p in points[:-1]], [p.tau() for p in points[:-1]])
    if fit is None:
        return None
    measured, predicted = points[-1].tau(), fit.predict(points[-1].samples)
    return {"samples": points[-1].samples, "predicted": predicted, "measured": measured, "error": predicted - measured}


def trust_problems(points: list[Replayed], fit: SaturatingFit | None) -> list[str]:
    """Why the fit is not to be trusted, in words; empty where nothing speaks against it."""
    taus = [p.tau() for p in points]
    problems = []
    if len(points) < 4:
        problems.append(f"{len(points)} points: three parameters leave no point to check the curve against")
    if fit is None:
        problems.append("acceptance does not rise with the data: no saturating curve fits")
        return problems
    gains = [later - earlier for earlier, later in zip(taus, taus[1:])]
    if any(gain <= 0 for gain in gains):
        problems.append("acceptance fell between two fractions: the points are noisier than what more data adds")
    elif gains[-1] >= CURVATURE * gains[0]:
        problems.append("no curvature: the last fraction gained about as much as the first, so the ceiling is a guess")
    if fit.exponent in (float(EXPONENTS[0]), float(EXPONENTS[-1])):
        problems.append(f"the exponent ({fit.exponent:.2f}) lies at the edge of the range searched")
    return problems
