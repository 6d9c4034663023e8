"""``draftflow pilot`` on the demo's target (issue 59): the demo's run is the pilot of a run four
times its size (data.num_samples 960, pilot.num_samples 240: the demo's own), so its stages are
copied and kept (``--rerun-triggers mtime``) and the pilot trains drafters on an eighth, a
quarter and half of its training samples; the demo's drafter is the whole's."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from datasets import load_from_disk

from draftflow.pilot_fit import Replayed, fit_saturating
from tests.conftest import DRAFTFLOW, config_file, demo_config

pytestmark = pytest.mark.slow

FRACTIONS = (0.125, 0.25, 0.5, 1)


def test_draftflow_pilot_prints_the_fit_its_interval_and_back_test_and_the_report_shows_them(tmp_path, demo_run):
    for folder in ("resources", "benchmarks"):
        shutil.copytree(demo_run.parents[1] / folder, tmp_path / folder)
    results = tmp_path / "results/demo"
    shutil.copytree(demo_run, results, symlinks=True)
    config = config_file(tmp_path, demo_config(data={"num_samples": 960}, pilot={"num_samples": 240, "target_acceptance_length": 2.5}))
    process = subprocess.run([str(DRAFTFLOW), "pilot", "--configfile", str(config), "--directory", str(tmp_path), "--cores", "2",
                              "--", "--rerun-triggers", "mtime"], capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-6000:]
    assert "rule pilot:" in process.stderr and "rule train:" not in process.stderr  # the demo's run is the pilot's
    pilot = json.loads((results / "pilot/pilot.json").read_text())

    # nested fractions of the training view, each a prefix of the next, the whole the run's own
    train_ids = load_from_disk(str(results / "training_data/train")).with_format(None)["sample_id"]
    rows = [max(1, round(fraction * len(train_ids))) for fraction in FRACTIONS]
    assert [point["training_samples"] for point in pilot["points"]] == rows
    for count in rows[:-1]:
        view = load_from_disk(str(results / f"pilot/work/rows-{count}/view")).with_format(None)
        assert view["sample_id"] == train_ids[:count]
    # the whole's point is the evaluation's decoding replay of the same held-out requests
    replay = json.loads((results / "evaluation/evaluation.json").read_text())["trained"]["decoding_replay"]
    whole = pilot["points"][-1]
    assert (sum(whole["drafts"]), sum(whole["accepted"]), len(whole["drafts"])) == (replay["drafts"], replay["accepted_tokens"], replay["requests"])
    assert whole["mean_acceptance_length"] == pytest.approx(replay["mean_acceptance_length"])

    # the back-test: the curve through the three smaller points, asked for the whole
    points = [Replayed(p["training_samples"], p["drafts"], p["accepted"]) for p in pilot["points"]]
    three = fit_saturating([p.samples for p in points[:-1]], [p.tau() for p in points[:-1]])
    back = pilot["back_test"]
    assert back["predicted"] == pytest.approx(three.predict(rows[-1])) and back["measured"] == whole["mean_acceptance_length"]
    (prediction,) = pilot["predictions"]
    low, high = prediction["interval"]
    assert prediction["num_samples"] == 960 and low <= prediction["predicted"] <= high

    printed = process.stdout
    assert f"Back-test: fitted on all but the largest point, it predicts {back['predicted']:.3f}" in printed
    assert f"error {back['error']:+.3f}" in printed and "Fit: τ(n) = " in printed
    assert f"At data.num_samples 960 ({prediction['training_samples']} training samples): {prediction['predicted']:.3f}, 90% interval" in printed
    assert "Mean acceptance length 2.5 needs data.num_samples" in printed
    assert f"| 960 | {prediction['predicted']:.3f} | {low:.3f} to {high:.3f} |" in printed  # beside the plan's cost
    report = (results / "report/report.md").read_text()
    assert "## What more data buys (pilot)" in report and f"error {back['error']:+.3f}" in report
    assert (results / "pilot/pilot.png").stat().st_size > 10_000

    # the pilot rule forced to run again: each fraction's training key resumes at its end, so no
    # epoch is trained or measured again (their files untouched) and the points are the same
    def epoch_files() -> dict[Path, int]:
        return {path: path.stat().st_mtime_ns for path in sorted((results / "pilot/work").glob("rows-*/work/*/epochs/*/*"))}

    before = epoch_files()
    assert {path.parts[-6] for path in before} == {f"rows-{count}" for count in rows[:-1]}
    again = subprocess.run([str(DRAFTFLOW), "pilot", "--configfile", str(config), "--directory", str(tmp_path), "--cores", "2",
                            "--", "--rerun-triggers", "mtime", "--forcerun", "pilot"], capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert again.returncode == 0, again.stderr[-6000:]
    assert "rule pilot:" in again.stderr and "rule train:" not in again.stderr
    assert json.loads((results / "pilot/pilot.json").read_text())["points"] == pilot["points"]
    assert epoch_files() == before
