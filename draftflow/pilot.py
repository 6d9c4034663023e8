"""What more data buys (issue 59): the pilot's record, ``pilot/pilot.json``, written and read
here: drafters trained on nested fractions of a run's training samples
(``draftflow.pilot_training``, rule ``pilot``), each measured along the decoding replay on the
same held-out requests, and the saturating curve through them (``draftflow.pilot_fit``) that
predicts larger runs, with its interval, its back-test and what speaks against trusting it.
``draftflow pilot`` (``draftflow.pilot_command``) runs a pilot and prints it beside the plan's
cost of the larger runs.
"""

from __future__ import annotations

import math
from pathlib import Path

PILOT_FILE = "pilot/pilot.json"
INTERVAL = 0.9  # the bootstrap interval's level


def fit_points(points, train_share: float, predict_for: list[int], target_tau: float | None, draws: int, seed: int) -> dict:
    """The fit through ``points`` (``pilot_fit.Replayed``), its interval at each size of
    ``predict_for`` (data.num_samples; training samples = ``train_share`` of them), the back-test
    and what speaks against trusting it."""
    from draftflow.pilot_fit import back_test, bootstrap, fit_saturating, trust_problems

    fit = fit_saturating([p.samples for p in points], [p.tau() for p in points])
    sizes = {n: n * train_share for n in predict_for}
    interval = bootstrap(points, list(sizes.values()), draws, seed, INTERVAL) if fit else {}
    predictions = [{"num_samples": n, "training_samples": round(m), "predicted": fit.predict(m) if fit else None,
                    "interval": list(interval[m]) if fit else None} for n, m in sizes.items()]  # fmt: skip
    needed = None
    if fit and target_tau is not None:
        samples = fit.samples_for(target_tau)
        needed = {"acceptance_length": target_tau, "training_samples": samples,
                  "num_samples": samples / train_share if math.isfinite(samples) else samples}  # fmt: skip
    return {
        "fit": None if fit is None else {"ceiling": fit.ceiling, "scale": fit.scale, "exponent": fit.exponent,
                                         "rms_error": fit.rms_error, "formula": "tau(n) = ceiling - scale * n^-exponent"},  # fmt: skip
        "interval_level": INTERVAL,
        "predictions": predictions,
        "back_test": back_test(points),
        "trust_problems": trust_problems(points, fit),
        "needed": needed,
    }


def pilot_result(points, train_share: float, num_samples: int, settings: dict) -> dict:
    """pilot.json: the points (training samples, τ, per-request drafts and accepted) and the fit."""
    fitted = fit_points(points, train_share, settings["predict_for"], settings["target_acceptance_length"],
                        settings["bootstrap_draws"], settings["seed"])  # fmt: skip
    return {"num_samples": num_samples, "train_share": train_share,
            "points": [{"training_samples": p.samples, "mean_acceptance_length": p.tau(), "drafts": p.drafts, "accepted": p.accepted}
                       for p in points], **fitted}  # fmt: skip


def summary_lines(pilot: dict) -> list[str]:
    """The pilot in Markdown: the points, the back-test, the predictions and the warnings."""
    lines = ["| training samples | mean acceptance length (decoding replay) |", "| ---: | ---: |"]
    lines += [f"| {p['training_samples']} | {p['mean_acceptance_length']:.3f} |" for p in pilot["points"]]
    fit = pilot["fit"]
    if fit is None:
        lines += ["", "No saturating curve fits these points."]
    else:
        lines += ["", f"Fit: τ(n) = {fit['ceiling']:.3f} − {fit['scale']:.3f}·n^−{fit['exponent']:.2f} "
                      f"(n: training samples; rms error {fit['rms_error']:.3f} at its points)."]  # fmt: skip
    if back := pilot["back_test"]:
        lines.append(f"Back-test: fitted on all but the largest point, it predicts {back['predicted']:.3f} at {back['samples']} "
                     f"training samples, where {back['measured']:.3f} was measured: error {back['error']:+.3f}.")  # fmt: skip
    level = round(100 * pilot["interval_level"])
    for p in pilot["predictions"]:
        if p["predicted"] is not None:
            low, high = p["interval"]
            lines.append(f"At data.num_samples {p['num_samples']} ({p['training_samples']} training samples): "
                         f"{p['predicted']:.3f}, {level}% interval {low:.3f} to {high:.3f}.")  # fmt: skip
    if needed := pilot["needed"]:
        count = "never (at or above the curve's ceiling)" if not math.isfinite(needed["num_samples"]) else f"about {needed['num_samples']:,.0f}"
        lines.append(f"Mean acceptance length {needed['acceptance_length']} needs data.num_samples {count}.")
    lines += [f"Not to be trusted as it stands: {problem}." for problem in pilot["trust_problems"]]
    return lines


def plot_pilot(pilot: dict, output: Path) -> None:
    """The points, the fit out to the largest size predicted and its interval there."""
    from draftflow.pilot_fit import SaturatingFit
    from draftflow.plots import pyplot, save_png

    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    samples = [p["training_samples"] for p in pilot["points"]]
    axis.plot(samples, [p["mean_acceptance_length"] for p in pilot["points"]], "o", label="measured (decoding replay)")
    if fit := pilot["fit"]:
        curve = SaturatingFit(fit["ceiling"], fit["scale"], fit["exponent"], fit["rms_error"])
        end = max([*samples, *(p["training_samples"] for p in pilot["predictions"])])
        grid = [samples[0] * (end / samples[0]) ** (i / 99) for i in range(100)]
        axis.plot(grid, [curve.predict(n) for n in grid], "-", label=f"fit, ceiling {fit['ceiling']:.2f}")
        for p in pilot["predictions"]:
            low, high = p["interval"]
            axis.errorbar([p["training_samples"]], [p["predicted"]], yerr=[[p["predicted"] - low], [high - p["predicted"]]],
                          fmt="s", capsize=4, label=f"predicted at {p['num_samples']} samples ({round(100 * pilot['interval_level'])}%)")  # fmt: skip
    axis.set(xscale="log", xlabel="training samples", ylabel="mean acceptance length",
             title="What more data buys (pilot)")  # fmt: skip
    axis.xaxis.set_major_formatter(lambda value, _: f"{value:g}")
    axis.xaxis.set_minor_formatter(lambda value, _: "")
    axis.legend(fontsize="small")
    save_png(figure, output)
