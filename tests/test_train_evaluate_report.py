"""The end of the chain on the demo: a servable drafter, its acceptance and the report."""

import csv
import html
import json
import re

import numpy as np
import pytest
from datasets import load_from_disk
from safetensors.torch import load_file
from speculators.models.eagle3 import Eagle3DraftModel

from draftflow.config import schema, with_defaults
from draftflow.evaluate import LayerIdMismatch, check_layer_ids
from tests.acceptance import assert_measured_acceptance, assert_served_as_replayed
from tests.conftest import REPO, copy_demo_run, demo_config, snakemake

pytestmark = pytest.mark.slow


def test_drafter_loads_and_matches_extraction_and_vocab(demo_run):
    drafter_dir = demo_run / "drafter"
    config = json.loads((drafter_dir / "config.json").read_text())
    plan = json.loads((demo_run / "hidden_states/plan.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == plan["layer_ids"][:-1]
    assert config["draft_vocab_size"] == demo_config()["vocab"]["draft_vocab_size"]
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    assert verifier.startswith("/") and verifier.endswith("resources/demo-target")
    weights = load_file(drafter_dir / "model.safetensors")
    np.testing.assert_array_equal(weights["d2t"].numpy(), np.load(demo_run / "vocab/d2t.npy"))
    model = Eagle3DraftModel.from_pretrained(str(drafter_dir))
    assert model.target_layer_ids == plan["layer_ids"][:-1]


# The demo drafter's mean acceptance length, offline (every position) and served, per class of
# host (tests/acceptance.py): 2.898 and 2.764 here on 2026-12-04 (the served one what the
# decoding replay predicted: 576 drafts, 1016 accepted); 2.890 and 2.682 on the hosts of 2026-12-01.
MEASURED_ACCEPTANCE = {"AuthenticAMD AVX512+avx512_bf16": {"demo": (2.898, 2.764)}}


def test_trained_drafter_beats_the_untrained_floor_by_what_this_host_measured(demo_run):
    # (the gate passed, or the run would have failed; the per-position shares fall by construction)
    evaluation = json.loads((demo_run / "evaluation/evaluation.json").read_text())
    trained, untrained = evaluation["trained"], evaluation["untrained"]
    assert trained["mean_acceptance_length"] > untrained["mean_acceptance_length"] + 0.5
    assert_measured_acceptance(demo_run, MEASURED_ACCEPTANCE, "demo", f"{__file__}: MEASURED_ACCEPTANCE")
    assert evaluation["heldout_samples"] > 0


def test_vllm_serves_the_drafter_as_the_decoding_replay_predicts(demo_run):
    served = json.loads((demo_run / "evaluation/served.json").read_text())
    assert served["drafts"] > 0
    replay = assert_served_as_replayed(demo_run)
    heldout = json.loads((demo_run / "evaluation/evaluation.json").read_text())["heldout_samples"]
    assert replay["requests"] == min(heldout, with_defaults(demo_config(), schema())["evaluate"]["serve_check_requests"])
    trained_on = json.loads((demo_run / "hidden_states/plan.json").read_text())["layer_ids"][:-1]
    assert served["aux_layers"] == {"served": trained_on, "from": "the drafter's config"}  # as vLLM logged them
    assert (demo_run / "evaluation/served_acceptance.png").stat().st_size > 1000


def test_heldout_samples_never_reach_training(tmp_path, demo_run):
    """The views are disjoint by sample id and cover the dataset; with every held-out
    hidden-state file deleted from the shards, training still runs: it reads none of them."""
    stages = ("prompts", "synthetic", "prepared", "vocab", "hidden_states", "fidelity", "drafter_untrained",
              "training_data")  # fmt: skip
    results = copy_demo_run(demo_run, tmp_path, *stages)
    config = demo_config(train={"epochs": 1})
    snakemake(tmp_path, config, "results/demo/training_data/split.json", "--forcerun", "train_views")  # this code's views
    views = {name: results / "training_data" / name for name in ("train", "heldout")}
    ids = {name: set(load_from_disk(str(view))["sample_id"]) for name, view in views.items()}
    assert ids["heldout"] and not ids["train"] & ids["heldout"]
    assert ids["train"] | ids["heldout"] == set(load_from_disk(str(results / "prepared/dataset"))["sample_id"])
    sources = {name: {link.resolve() for link in (view / "hidden_states").iterdir()} for name, view in views.items()}
    assert len(sources["heldout"]) == len(ids["heldout"]) and not sources["train"] & sources["heldout"]
    for source in sources["heldout"]:
        source.unlink()
    snakemake(tmp_path, config, "results/demo/train/stats.json")
    assert json.loads((results / "train/stats.json").read_text())["steps"] > 0
    assert not any(source.exists() for source in sources["heldout"])


def test_report_covers_every_stage(demo_run):
    with (demo_run / "report/stage_runtimes.tsv").open() as stream:
        stages = {row["stage"]: row for row in csv.DictReader(stream, delimiter="\t")}
    expected = {"prompts", "generate", "prepare", "vocab_map", "extract_plan", "fidelity_reference", "extract_server",
                "extract", "fidelity", "drafter_init", "train_views", "train", "evaluate", "serve_check"}  # fmt: skip
    assert set(stages) == expected
    assert all(float(row["seconds"]) > 0 for row in stages.values())
    assert stages["extract_server"]["jobs"] == "1"  # both shards, one model load (CPU: one server job)
    report = (demo_run / "report/report.md").read_text()
    assert all(stage in report for stage in expected)
    assert "served by vLLM" in report
    assert (demo_run / "report/stage_runtimes.png").stat().st_size > 1000


def test_evaluate_rejects_a_drafter_trained_on_other_layers(demo_run):
    config = json.loads((demo_run / "drafter/config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]
    with pytest.raises(LayerIdMismatch, match=r"\[1, 3, 5\].*\[2, 4, 5\]"):
        check_layer_ids(config, [2, 4, 5, 8], demo_run / "drafter")


def test_snakemake_report_shows_the_workflow_description_and_every_caption(tmp_path, workdir, demo_run):
    """``snakemake --report`` on the demo renders report/workflow.rst and each output's
    caption; the first sentence of each rst file is looked for, so edits carry over."""
    report = tmp_path / "report.html"
    snakemake(workdir, demo_config(), "--report", str(report))
    page = report.read_text()

    def embedded(script_id: str):
        """The JSON the report's <script id=...> assigns to its variable."""
        start = re.search(rf'<script id="{script_id}">\s*var \w+ = ', page).end()
        return json.JSONDecoder().raw_decode(page, start)[0]

    def text(rendered: str) -> str:
        return " ".join(html.unescape(re.sub(r"<[^>]+>", "", rendered)).split())

    def first_sentence(rst: str) -> str:
        return " ".join((REPO / "report" / rst).read_text().split()).split(". ", 1)[0]

    assert first_sentence("workflow.rst") in text(embedded("workflow-desc"))
    captions = {entry["name"]: text(entry["caption"]) for entry in embedded("results").values()}
    caption_files = {
        "stage_runtimes.png": "stage_runtimes.rst",
        "stage_runtimes.tsv": "stage_runtimes_table.rst",
        "report.md": "summary.rst",
        "coverage.png": "coverage.rst",
        "acceptance.png": "acceptance.rst",
        "served_acceptance.png": "served_acceptance.rst",
    }
    assert set(captions) == set(caption_files)
    for output, rst in caption_files.items():
        assert first_sentence(rst) in captions[output], output
