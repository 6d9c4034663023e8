"""A target vLLM serves but gives no hidden states for: Gemma-3's text model (issue 25).

vLLM's ``Gemma3ForCausalLM`` does not implement SupportsEagle3, so the workflow refuses
extraction, its fidelity check and serving a drafter through vLLM, and names the ways
out (tests/test_vllm_support.py). This runs the Gemma-3 twin (tests/twins.py) with them,
prompts to report on CPU: vLLM generates, transformers extracts, nothing serves the
drafter; the tests read what the run leaves.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftflow import run_folder
from draftflow.extract import layout
from draftflow.extract.hidden_states import read_hidden_states
from draftflow.extract.shards import load_samples
from tests.conftest import demo_config, snakemake
from tests.test_twin_workflows import QUESTIONS
from tests.twins import build_gemma3_text

pytestmark = pytest.mark.slow

NUM_SAMPLES = 32
NUM_LAYERS = 6  # the twin's
# Not the default on 6 layers ([1, 3, 5]): the files must hold the configured layers.
LAYER_IDS = [2, 3, 4]
EXTRACTED_LAYER_IDS = [*LAYER_IDS, NUM_LAYERS]  # the aux layers, then the last layer before the final norm
MIN_ACCEPTANCE_LENGTH = 1.2  # the floor the trained drafter must reach
STATE_TOLERANCE = 1e-5  # float32 states against transformers' full forward pass


def ways_out_config(target, prompts) -> dict:
    return demo_config(
        False,
        run="gemma3-ways-out",
        target={"path": str(target)},
        data={"prompt_files": [str(prompts)], "num_samples": NUM_SAMPLES},
        vllm={"max_model_len": 512},
        generate={"max_tokens": 64, "max_degenerate_fraction": 1.0},  # random weights: every answer loops to the end
        prepare={"max_seq_length": 256},
        vocab={"draft_vocab_size": 64, "coverage_sizes": [16, 32, 64]},
        extract={"backend": "transformers", "fidelity": "never", "shards": 1, "layer_ids": LAYER_IDS},
        train={"epochs": 10, "heldout_fraction": 0.2},
        evaluate={"serve_check": False, "min_acceptance_length": MIN_ACCEPTANCE_LENGTH},
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gemma3-ways-out")
    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                               for i, q in enumerate(QUESTIONS)))  # fmt: skip
    config = ways_out_config(build_gemma3_text(workdir / "target"), prompts)
    snakemake(workdir, config)
    return workdir / run_folder.RESULTS / config["run"]


def read(path):
    return json.loads(path.read_text())


def test_the_run_reaches_its_report_without_vllm_extracting_or_serving_the_drafter(run):
    report = (run_folder.stage_dir(run, "report") / "report.md").read_text()
    assert report.startswith("# draftflow report: gemma3-ways-out\n")
    assert "| generate | 1 |" in report and "| evaluate | 1 |" in report and "| serve_check |" not in report
    assert read(run_folder.hidden_states_dir(run) / layout.SUMMARY)["backend"] == "transformers"
    assert not (run_folder.stage_dir(run, "serve_check") / "served.json").exists()
    not_checked = "not checked: turned off (extract.fidelity: never)"
    assert read(run_folder.stage_dir(run, "fidelity") / "fidelity.json") == {"checked": False, "reason": not_checked, "passed": None}
    assert not_checked in report


def test_the_extraction_manifests_list_every_sample_once(run):
    hs_dir = run_folder.hidden_states_dir(run)
    sample_ids = sorted(sample.sample_id for sample in load_samples(run_folder.stage_dir(run, "prepare") / "dataset"))
    summary = read(hs_dir / layout.SUMMARY)
    listed = [entry["sample_id"] for name in summary["shards"] for entry in read(hs_dir / name)["files"]]
    assert len(sample_ids) == summary["samples"] == read(hs_dir / layout.PLAN)["samples"] > 0.9 * NUM_SAMPLES
    assert sorted(listed) == sample_ids
    assert sorted(layout.file_sample_id(path.name) for path in layout.hidden_state_files(hs_dir)) == sample_ids


def test_the_files_hold_the_configured_layers_as_transformers_computes_them(run):
    """Each aux slot is transformers' hidden state after that many layers; the last slot
    is the last layer's output before the final norm, so through it transformers' last one.
    The samples (about 100 tokens) are longer than the twin's sliding window (64)."""
    hs_dir = run_folder.hidden_states_dir(run)
    assert read(hs_dir / layout.PLAN)["layer_ids"] == read(hs_dir / layout.SUMMARY)["layer_ids"] == EXTRACTED_LAYER_IDS
    files = {layout.file_sample_id(path.name): path for path in layout.hidden_state_files(hs_dir)}
    model = AutoModelForCausalLM.from_pretrained(str(run.parents[1] / "target"), dtype=torch.float32).eval()
    for sample in load_samples(run_folder.stage_dir(run, "prepare") / "dataset"):
        extracted = read_hidden_states(files[sample.sample_id])
        with torch.inference_mode():
            reference = model(torch.tensor([sample.token_ids]), output_hidden_states=True).hidden_states
        expected = [reference[k][0] for k in LAYER_IDS] + [reference[NUM_LAYERS][0]]
        found = [extracted[:, slot] for slot in range(len(LAYER_IDS))] + [model.model.norm(extracted[:, -1])]
        assert extracted.shape == (len(sample.token_ids), len(EXTRACTED_LAYER_IDS), model.config.hidden_size)
        for layer_id, state, reference_state in zip(EXTRACTED_LAYER_IDS, found, expected, strict=True):
            assert torch.allclose(state, reference_state, atol=STATE_TOLERANCE), (sample.sample_id, layer_id)


def test_the_evaluation_measures_both_drafters_and_the_gate_passes(run):
    evaluation = read(run_folder.stage_dir(run, "evaluate") / "evaluation.json")
    assert evaluation["heldout_samples"] > 0
    assert all(evaluation[name]["positions"] > 100 for name in ("trained", "untrained"))
    # the configured floor, not the default (1.5); that it passed needs no check: a failed gate stops the run
    assert evaluation["gate"]["min_acceptance_length"] == MIN_ACCEPTANCE_LENGTH


def test_the_trained_drafter_beats_the_untrained_floor(run):
    evaluation = read(run_folder.stage_dir(run, "evaluate") / "evaluation.json")
    trained, untrained = (evaluation[name]["mean_acceptance_length"] for name in ("trained", "untrained"))
    assert trained > untrained + 0.3, (trained, untrained)
