"""extract.storage fp8 on the demo's own samples (issue 15; the run: tests/conftest.py
fp8_run): half the bytes, read by speculators' FP8Transfer, and the drafter trained on it
beside the demo's (fp32 storage)."""

import json

import numpy as np
import pytest
import torch
from datasets import load_from_disk
from hs_connectors import FP8Transfer
from safetensors.torch import load_file

from draftflow.extract.fidelity import FP8_ROUNDING
from draftflow.extract.hidden_states import safetensors_parts
from draftflow.extract.layout import HEADER_BYTES_MAX, view_file_name

pytestmark = pytest.mark.slow


def files(results):
    summary = json.loads((results / "hidden_states/manifest.json").read_text())
    for name in summary["shards"]:
        for entry in json.loads((results / "hidden_states" / name).read_text())["files"]:
            yield results / "hidden_states" / entry["file"], entry


def test_fp8_files_take_at_most_52_percent_of_bf16_files_of_the_same_states(fp8_run):
    summary = json.loads((fp8_run / "hidden_states/manifest.json").read_text())
    assert summary["storage"] == "fp8"
    slots, hidden = len(summary["layer_ids"]), summary["hidden_size"]
    fp8 = bf16 = 0
    for path, entry in files(fp8_run):
        fp8 += path.stat().st_size
        states = torch.zeros(entry["tokens"], slots, hidden, dtype=torch.bfloat16)
        bf16 += sum(part.nbytes for part in safetensors_parts(states, torch.zeros(entry["tokens"], dtype=torch.int64)))
    assert fp8 / bf16 <= 0.52
    plan = json.loads((fp8_run / "hidden_states/plan.json").read_text())
    assert 0 <= plan["bytes"] - fp8 <= summary["samples"] * HEADER_BYTES_MAX  # projected exactly, up to headers


def view_rows(results):
    """(sample id, token ids, speculators' FP8Transfer read) of every row of both training views."""
    for view in ("train", "heldout"):
        dataset = load_from_disk(str(results / "training_data" / view)).with_format(None)
        reader = FP8Transfer(results / "training_data" / view / "hidden_states", dequantize_dtype=torch.float32)
        for row, (sample_id, token_ids) in enumerate(zip(dataset["sample_id"], dataset["input_ids"], strict=True)):
            assert (results / "training_data" / view / "hidden_states" / view_file_name(row)).exists()
            yield sample_id, token_ids, reader.get_cached(row)


def test_speculators_fp8_transfer_reads_every_file(fp8_run):
    dataset = load_from_disk(str(fp8_run / "prepared/dataset")).with_format(None)
    seen = set()
    for sample_id, token_ids, read in view_rows(fp8_run):
        assert set(read) == {"hidden_states", "token_ids"} and read["hidden_states"].dtype == torch.float32
        assert read["token_ids"].tolist() == token_ids
        seen.add(sample_id)
    assert seen == set(dataset["sample_id"])


def errors_per_slot(reference: torch.Tensor, other: torch.Tensor) -> list[float]:
    """Per layer slot, the largest difference over the slot's largest value: the fidelity
    check's measure, computed here in float64 numpy, apart from its code."""
    reference, other = reference.double().numpy(), other.double().numpy()
    return [float(np.abs(other[:, k] - reference[:, k]).max() / np.abs(reference[:, k]).max()) for k in range(reference.shape[1])]


def test_fp8_states_are_the_demos_within_fp8_rounding_and_fidelity_says_so(fp8_run, demo_run):
    """Same samples, same server: the fp8 files dequantize to the demo's fp32 files within 2**-4 of each
    layer slot's largest value (what the fidelity check measures, with that bound added to its tolerance)."""
    demo_files = {entry["sample_id"]: path for path, entry in files(demo_run)}
    for sample_id, _, read in list(view_rows(fp8_run))[:20]:
        full = load_file(demo_files[sample_id])["hidden_states"]
        errors = errors_per_slot(full, read["hidden_states"])
        assert all(error <= FP8_ROUNDING + 1e-4 for error in errors), errors
    fidelity = json.loads((fp8_run / "fidelity/fidelity.json").read_text())
    # its figures are the fp8 files' error against transformers' states, computed again here
    reference = load_file(fp8_run / "fidelity/reference.safetensors")
    stored = {sample_id: read["hidden_states"] for sample_id, _, read in view_rows(fp8_run) if sample_id in reference}
    worst = np.max([errors_per_slot(reference[sample_id], stored[sample_id]) for sample_id in reference], axis=0)
    assert list(fidelity["max_relative_error_per_layer"].values()) == pytest.approx(worst.tolist(), rel=1e-4)
    assert 0.005 < max(fidelity["max_relative_error_per_layer"].values()) <= FP8_ROUNDING + 1e-4


def test_the_drafter_trained_on_fp8_accepts_as_the_full_precision_one(fp8_run, demo_run):
    results = {}
    for name, run in (("fp8", fp8_run), ("full", demo_run)):
        offline = json.loads((run / "evaluation/evaluation.json").read_text())["trained"]["mean_acceptance_length"]
        served = json.loads((run / "evaluation/served.json").read_text())["mean_acceptance_length"]
        results[name] = (offline, served)
    print(results)
    assert results["fp8"][0] == pytest.approx(results["full"][0], abs=0.05)
    assert results["fp8"][1] == pytest.approx(results["full"][1], abs=0.05)
    report = (fp8_run / "report/report.md").read_text()
    assert "## Compared runs" in report and "| demo | full |" in report and "| fp8 | fp8 |" in report
    assert "- hidden states: fp8 storage (float32 model)" in report
