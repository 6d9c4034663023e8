"""The fidelity check runs where the target fits one device, and says so where it does not;
with greedy answers it counts those the target's own greedy choice agrees with."""

import json

from draftflow.extract.fidelity import GB, decide, device_memory, fidelity_failure, greedy_agreement, greedy_not_checked, not_checked
from draftflow.report import fidelity_line
from draftflow.target_model import read_target_model


def target_with_index(folder, total_size):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    index = {"metadata": {"total_size": total_size}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return read_target_model(folder)


def test_weight_bytes_from_the_index_or_the_files(tmp_path):
    assert target_with_index(tmp_path / "sharded", 594_000_000_000).weight_bytes == 594_000_000_000
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert read_target_model(plain).weight_bytes is None
    (plain / "model.safetensors").write_bytes(b"x" * 1234)
    assert read_target_model(plain).weight_bytes == 1234


def test_auto_checks_a_target_that_fits_and_records_why_not_otherwise():
    fits = decide("auto", int(60 * GB), 80 * GB, "default")
    assert fits.check and "72.00 GB to load" in fits.reason and "80.00 GB" in fits.reason
    too_big = decide("auto", int(594 * GB), 80 * GB, "default for one GPU")
    assert not too_big.check
    assert too_big.reason.startswith("not checked:")
    assert "594.00 GB of weights" in too_big.reason and "extract.fidelity: always" in too_big.reason
    # The 20% load overhead decides at the edge.
    assert not decide("auto", int(70 * GB), 80 * GB, "x").check


def test_always_and_never_override_the_size():
    assert decide("always", int(594 * GB), 80 * GB, "x").check
    never = decide("never", 1, 80 * GB, "x")
    assert not never.check and "extract.fidelity: never" in never.reason
    assert decide("auto", None, 80 * GB, "x").check  # decided again once the target exists


def test_device_memory_comes_from_the_config_the_machine_or_the_gpu_default():
    assert device_memory("cuda", 141) == (141 * GB, "extract.fidelity_device_memory_gb")
    assert device_memory("cuda", None)[0] == 80 * GB
    with open("/proc/meminfo") as meminfo:
        total_kb = int(meminfo.readline().split()[1])
    assert abs(device_memory("cpu", None)[0] - total_kb * 1024) < GB


def test_the_report_says_not_checked_and_why():
    decision = decide("auto", int(594 * GB), 80 * GB, "default")
    line = fidelity_line(not_checked(decision))
    assert "not checked" in line and "594.00 GB" in line
    checked = {"checked": True, "max_relative_error_per_layer": {"2": 3.8e-7, "8": 3e-7}}
    greedy = {"checked": True, "share": 0.998, "answer_tokens": 812}
    assert fidelity_line(checked | {"greedy_agreement": greedy}).endswith(
        "2: 3.8e-07, 8: 3.0e-07; transformers' greedy choice agrees with 99.8% of 812 answer tokens"
    )
    sampled = fidelity_line(checked | {"greedy_agreement": greedy_not_checked(0.8)})
    assert sampled.endswith("greedy agreement not checked: answers sampled at generate.temperature 0.8: greedy answers (0) are compared")


def test_greedy_agreement_counts_each_answer_token_against_the_choice_after_the_answer_so_far():
    token_ids, mask = [5, 6, 7, 8, 9], [0, 0, 1, 1, 1]
    after_each_position = [0, 7, 8, 0, 0]  # after 6: 7, after 7: 8 (both answered so), after 8: 0, not 9
    result = greedy_agreement({"s": (token_ids, mask)}, {"s": after_each_position}, 0.5)
    assert (result["agreeing"], result["answer_tokens"], result["passed"]) == (2, 3, True)
    assert result["per_sample"] == {"s": 2 / 3}
    one_ahead = [7, 8, 9, 0, 0]  # each choice compared with the token it precedes, not the one after
    assert greedy_agreement({"s": (token_ids, mask)}, {"s": one_ahead}, 0.5)["agreeing"] == 0


def test_a_greedy_agreement_below_its_minimum_fails_naming_the_share_the_samples_and_the_causes():
    answers = {"q1": ([1, 2, 3], [0, 1, 1]), "q2": ([1, 2, 3], [0, 1, 1])}
    result = {"checked": True, "passed": True,
              "greedy_agreement": greedy_agreement(answers, {"q1": [2, 3, 0], "q2": [0, 0, 0]}, 0.95)}  # fmt: skip
    failure = fidelity_failure(result)
    assert failure.startswith("transformers' greedy choice agrees with 50.0% of the 4 answer tokens generation produced, "
                              "below extract.fidelity_min_greedy_agreement 0.95 (lowest: q2 0%, q1 100%)")  # fmt: skip
    assert "zeroed lm_head or final norm" in failure and "hidden states" not in failure
    assert fidelity_failure(result | {"greedy_agreement": greedy_agreement(answers, {"q1": [2, 3, 0]} | {"q2": [2, 3, 0]}, 0.95)}) is None
