"""The family matrix: every architecture the pinned vLLM pairs with EAGLE-3 has a tiny
twin built from transformers' own classes (tests/families.py), or the reason none can
be built. Each twin resolves through draftflow.target_model, gets valid default layer
ids and the decision vLLM itself gives for each stage, the transformers backend's
states equal transformers' own ``output_hidden_states``, evaluation's greedy head
picks transformers' own greedy tokens, and speculators builds its untrained drafter. The family table (docs/families.md)
is generated from these findings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from draftflow.evaluate import TargetHead
from draftflow.extract.fidelity import relative_errors
from draftflow.extract.layout import Sample
from draftflow.extract.transformers_backend import TransformersExtractor, load_target
from draftflow.layers import resolve_layer_ids
from draftflow.target_model import TargetModelError, final_norm_module, read_target_model, weight_files
from draftflow.train import DrafterShape, init_drafter
from draftflow.vllm_registry import CACHE_DIR_ENV, architecture_support, installed_version, vllm_build
from draftflow.vllm_support import (
    WAYS_OUT,
    UnsupportedArchitecture,
    check_architecture,
)
from tests import families as matrix

REPO = Path(__file__).resolve().parents[1]
# Families the issue names, which the matrix must hold whatever else vLLM adds.
NAMED_FAMILIES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3VLForConditionalGeneration", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration", "GptOssForCausalLM", "Gemma4ForConditionalGeneration",
    "Mistral3ForConditionalGeneration", "LlavaForConditionalGeneration", "Llama4ForConditionalGeneration",
    "MiniMaxM2ForCausalLM", "NemotronHForCausalLM", "GraniteForCausalLM", "MiniCPMForCausalLM", "Step1ForCausalLM",
)  # fmt: skip
SAMPLE_LENGTHS = (5, 17, 11)
STATES_TOLERANCE = 1e-5  # fp32, relative: a packed (or padded) batch against a batch of one
DRAFT_VOCAB, DRAFTER = 32, DrafterShape(num_layers=1, attention="sdpa", seed=0)


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> dict[str, Path | str]:
    return matrix.built_twins(tmp_path_factory.mktemp("families"))


def states_errors(folder: Path) -> tuple[list[float], int]:
    """Worst relative error per layer id: the extractor's states (a packed batch, or a padded
    one where the decoder's attention cannot pack) against transformers'
    output_hidden_states of each sample alone; the final id through the final norm. And
    the positions where evaluation's greedy head, given the extracted final states, picks
    another token than transformers' own logits (beyond a tie)."""
    target = read_target_model(folder)
    layer_ids = resolve_layer_ids(None, target.num_layers)
    model = load_target(str(folder), dtype=torch.float32).eval()
    head = TargetHead(folder)
    generator = torch.Generator().manual_seed(0)
    samples = [
        Sample(index, f"s{index}", torch.randint(0, target.vocab_size, (length,), generator=generator).tolist())
        for index, length in enumerate(SAMPLE_LENGTHS)
    ]
    extractor = TransformersExtractor(model, layer_ids, token_budget=64, device="cpu")
    worst, wrong_greedy = [0.0] * len(layer_ids), 0
    with torch.inference_mode():
        for sample, states in extractor(samples):
            output = model(input_ids=torch.tensor([sample.token_ids]), output_hidden_states=True)
            hidden, logits = output.hidden_states, output.logits[0]
            final = final_norm_module(extractor.decoder)(states[:, -1])
            expected = torch.stack([*(hidden[k][0] for k in layer_ids[:-1]), hidden[-1][0]], dim=1)
            extracted = torch.cat([states[:, :-1], final[:, None]], dim=1)
            worst = [max(a, b) for a, b in zip(worst, relative_errors(expected, extracted), strict=True)]
            greedy = head.greedy(states[:, -1])[:, None]
            margin = logits.amax(-1, keepdim=True) - logits.gather(-1, greedy)
            wrong_greedy += int((margin > 1e-4 * logits.abs().amax(-1, keepdim=True)).sum())
    extractor.close()
    return worst, wrong_greedy


def test_the_matrix_lists_every_supports_eagle3_architecture_of_the_pinned_vllm():
    found = {family.architecture: family for family in matrix.vllm_families()}
    assert set(NAMED_FAMILIES) <= set(found), sorted(set(NAMED_FAMILIES) - set(found))
    assert "Gemma3ForConditionalGeneration" not in found and "Gemma3ForCausalLM" not in found
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
    # a twin fails to build only where BUILD_GAPS says, as it says (built_twins raises otherwise)
    assert {architecture for architecture, reason in reasons.items() if "do not shrink" in reason} == set(matrix.BUILD_GAPS), reasons
    assert len(built) >= 45, reasons
    assert {"Qwen3VLForConditionalGeneration", "Mistral3ForConditionalGeneration", "Llama4ForConditionalGeneration",
            "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"} <= set(built)  # fmt: skip
    # where no twin is built for want of a class, transformers has none under vLLM's name either
    classless = {architecture for architecture, reason in reasons.items() if "has no class" in reason}
    assert {architecture for architecture in classless if hasattr(transformers, architecture)} == set()


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
    assert set(problems) == set(matrix.KNOWN_GAPS), problems
    # each for the reason the matrix gives, not for any failure
    unexplained = {a: found for a, found in problems.items() if not any(matrix.KNOWN_GAPS[a].seen in f for f in found)}
    assert unexplained == {}, unexplained


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
    errors, wrong_greedy = states_errors(folder)
    if max(errors) >= STATES_TOLERANCE:
        found.append(f"states off by {max(errors):.2e}")
    if wrong_greedy:
        found.append(f"evaluation's greedy head disagrees with transformers' logits at {wrong_greedy} positions")
    failure = drafter_init_failure(folder, target.vocab_size, resolve_layer_ids(None, target.num_layers)[:-1])
    if failure:
        found.append(failure)
    try:
        target.check_drafter_norm_epsilon()
        refusal = None
    except TargetModelError as stopped:
        refusal = str(stopped)
    if (refusal is None) != (failure is None):  # the parse-time check foresees speculators' failure
        found.append(f"the parse-time drafter check says {refusal!r}, speculators {failure!r}")
    return found


def drafter_init_failure(folder: Path, vocab_size: int, aux_layer_ids: list[int]) -> str | None:
    """What stops the drafter_init rule's call, speculators building the untrained drafter, if anything."""
    mapping = folder.parent / f"{folder.name}-vocab"
    mapping.mkdir()
    np.save(mapping / "d2t.npy", np.zeros(DRAFT_VOCAB, dtype=np.int64))
    np.save(mapping / "t2d.npy", np.arange(vocab_size) < DRAFT_VOCAB)
    try:
        init_drafter(str(folder), aux_layer_ids, mapping / "d2t.npy", mapping / "t2d.npy", DRAFTER, mapping / "drafter")
    except Exception as failure:
        return f"speculators builds no drafter for it ({type(failure).__name__}: {str(failure).splitlines()[0][:120]})"
    return None


def test_the_support_decision_at_parse_time_is_vllms_own(twins, tmp_path, monkeypatch):
    """draftflow.vllm_support, asking vLLM as a run's parse does (its cache emptied), stops
    before any job on exactly the families whose class does not load here, naming the cause."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
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


def test_the_readme_family_table_is_the_matrix(twins):
    readme = (REPO / "docs/families.md").read_text()
    table = matrix.family_table(matrix.family_rows(matrix.vllm_families(), twins))
    assert matrix.replace_table(readme, table) == readme, "run: python -m tests.families docs/families.md"
