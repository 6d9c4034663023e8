"""Do the two extraction backends agree? Catches wrong layer ids and norm mix-ups.

The check loads the whole target in transformers on one device, so it runs
only where the target fits; otherwise ``fidelity.json`` says why it did not.
Importable without torch: the Snakefile decides at parse time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from draftflow.io import atomic_path, read_json, write_json
from draftflow.units import fmt_bytes

if TYPE_CHECKING:
    import torch

# An accelerator's memory when extract.fidelity_device_memory_gb is not set:
# the smallest of the common 8-GPU nodes' (A100/H100 80 GB).
DEFAULT_GPU_MEMORY_GB = 80
# Room beyond the weights for activations, buffers and the allocator.
LOAD_OVERHEAD = 1.2
GB = 1e9


@dataclass(frozen=True)
class FidelityDecision:
    check: bool
    reason: str


def device_memory(device: str, configured_gb: float | None) -> tuple[float, str]:
    """One device's memory in bytes, and where the number comes from."""
    if configured_gb is not None:
        return configured_gb * GB, "extract.fidelity_device_memory_gb"
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
    return DEFAULT_GPU_MEMORY_GB * GB, "default for one GPU; set extract.fidelity_device_memory_gb"


def decide(setting: str, weight_bytes: int | None, memory_bytes: float, memory_source: str) -> FidelityDecision:
    """Whether the fidelity rule loads the target (``extract.fidelity``: auto, always, never)."""
    if setting == "never":
        return FidelityDecision(False, "not checked: turned off (extract.fidelity: never)")
    if setting == "always":
        return FidelityDecision(True, "checked: extract.fidelity is always")
    if weight_bytes is None:
        return FidelityDecision(True, "checked if the target fits one device, decided once it exists")
    need = LOAD_OVERHEAD * weight_bytes
    sizes = (
        f"{fmt_bytes(weight_bytes)} of weights, {fmt_bytes(need)} to load; one device has "
        f"{fmt_bytes(memory_bytes)} ({memory_source})"
    )
    if need <= memory_bytes:
        return FidelityDecision(True, f"checked: the target fits one device ({sizes})")
    return FidelityDecision(
        False,
        f"not checked: transformers would load the whole target on one device, which it does not fit "
        f"({sizes}). Set extract.fidelity: always to force the check, or "
        f"extract.fidelity_device_memory_gb if the device is larger.",
    )


def decide_for_config(config: dict, weight_bytes: int | None) -> FidelityDecision:
    """:func:`decide` with a complete config's settings (``extract.fidelity``, the device's memory)."""
    memory = device_memory(config["device"], config["extract"]["fidelity_device_memory_gb"])
    return decide(config["extract"]["fidelity"], weight_bytes, *memory)


def vllm_states_from_extraction(config: dict) -> bool:
    """Whether the fidelity check takes vLLM's states from the extraction's files (the
    vllm backend) rather than from a vLLM server of its own (the transformers backend)."""
    return config["extract"]["backend"] == "vllm"


def fidelity_jobs(config: dict, check: bool, server_gpus: int) -> dict[str, tuple[int, int]]:
    """GPUs and model loads of the two fidelity jobs: the reference (transformers' load
    on one device) and the comparison (a vLLM server of its own, or none)."""
    if not check:
        return {"fidelity_reference": (0, 0), "fidelity": (0, 0)}
    comparison = (0, 0) if vllm_states_from_extraction(config) else (server_gpus, 1)
    return {"fidelity_reference": (min(1, server_gpus), 1), "fidelity": comparison}


# The reference, beside fidelity.json: its record (the decision, the samples, the layer
# ids, transformers' greedy agreement) and transformers' states.
REFERENCE_RECORD, REFERENCE_STATES = "reference.json", "reference.safetensors"


def write_reference(folder: Path | str, record: dict, states: dict[str, torch.Tensor]) -> None:
    """Transformers' states by sample id (as computed, not widened), then their record."""
    from safetensors.torch import save_file

    with atomic_path(Path(folder) / REFERENCE_STATES) as tmp:
        save_file({sample_id: hs.contiguous() for sample_id, hs in states.items()}, tmp)
    write_json(Path(folder) / REFERENCE_RECORD, record)


def read_reference(folder: Path | str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The record and transformers' states in float32, by sample id."""
    from safetensors.torch import load_file

    states = load_file(Path(folder) / REFERENCE_STATES)
    return read_json(Path(folder) / REFERENCE_RECORD), {sample_id: hs.float() for sample_id, hs in states.items()}


def compare_with_reference(record: dict, reference: dict[str, torch.Tensor], states: dict[str, torch.Tensor],
                           tolerance: float) -> dict:  # fmt: skip
    """:func:`compare` of vLLM's ``states`` (by sample id) with transformers' at the
    record's layer ids."""
    return compare({sample_id: reference[sample_id] for sample_id in states}, states, record["layer_ids"], tolerance)


def not_checked(decision: FidelityDecision) -> dict:
    return {"checked": False, "reason": decision.reason, "passed": None}


# float8_e4m3fn keeps 3 mantissa bits: rounding moves a value by at most 2**-4 of itself,
# so at most 2**-4 of its layer slot's largest value, the scale the error is measured in.
FP8_ROUNDING = 2**-4


def fidelity_tolerance(dtype_tolerance: float, storage: str) -> float:
    """The dtype's tolerance, plus fp8's rounding bound when the states are stored as fp8."""
    return dtype_tolerance + (FP8_ROUNDING if storage == "fp8" else 0.0)


def relative_errors(reference: torch.Tensor, other: torch.Tensor) -> list[float]:
    """Per layer slot: max |difference| over max |reference| ([seq, n_ids, hidden])."""
    difference = (other.float() - reference.float()).abs().amax(dim=(0, 2))
    scale = reference.float().abs().amax(dim=(0, 2)).clamp_min(1e-12)
    return (difference / scale).tolist()


def compare(
    reference: dict,
    other: dict,
    layer_ids: list[int],
    tolerance: float,
) -> dict:
    worst = [0.0] * len(layer_ids)
    for index, states in reference.items():
        if other[index].shape != states.shape:
            raise ValueError(
                f"sample {index}: backends disagree on shape "
                f"{tuple(states.shape)} vs {tuple(other[index].shape)}"
            )
        worst = [max(w, e) for w, e in zip(worst, relative_errors(states, other[index]), strict=True)]
    return {
        "checked": True,
        "samples": len(reference),
        "tolerance": tolerance,
        "max_relative_error_per_layer": dict(zip(map(str, layer_ids), worst, strict=True)),
        "passed": all(error <= tolerance for error in worst),
    }


def greedy_agreement(answers: dict[str, tuple[list[int], list[int]]], greedy: dict[str, list[int]], minimum: float) -> dict:
    """How many answer tokens (loss mask 1) the target's own greedy choice agrees with,
    taken after the answer so far (``greedy[sample][j]``: transformers' argmax after
    position j); ``answers``: each sample's token ids and loss mask."""
    per_sample = {}
    for sample_id, (token_ids, loss_mask) in answers.items():
        answer = [j for j in range(1, len(token_ids)) if loss_mask[j]]
        per_sample[sample_id] = (sum(greedy[sample_id][j - 1] == token_ids[j] for j in answer), len(answer))
    agreeing, tokens = (sum(counts) for counts in zip(*per_sample.values(), strict=True))
    share = agreeing / max(tokens, 1)
    return {
        "checked": True, "answer_tokens": tokens, "agreeing": agreeing, "share": share, "minimum": minimum,
        "per_sample": {sample_id: a / max(n, 1) for sample_id, (a, n) in per_sample.items()},
        "passed": share >= minimum,
    }  # fmt: skip


def greedy_not_checked(temperature: float) -> dict:
    return {"checked": False, "passed": None,
            "reason": f"answers sampled at generate.temperature {temperature:g}: greedy answers (0) are compared"}  # fmt: skip


def fidelity_failure(result: dict) -> str | None:
    """The message that fails the run: each checked layer id that differs beyond the
    tolerance, and a greedy agreement below its minimum, named."""
    failures = []
    if result["passed"] is False:
        tolerance = result["tolerance"]
        beyond = {layer: error for layer, error in result["max_relative_error_per_layer"].items() if error > tolerance}
        layers = ", ".join(f"layer {layer}: {error:.3g}" for layer, error in beyond.items())
        failures.append(
            f"vLLM and transformers hidden states differ beyond extract.fidelity_tolerance {tolerance:g} "
            f"(max relative error) at {layers} ({result['samples']} samples). "
            "Check extract.layer_ids and the target's dtype before training on them."
        )
    if greedy := greedy_failure(result.get("greedy_agreement", {})):
        failures.append(greedy)
    return " ".join(failures) or None


def greedy_failure(greedy: dict) -> str | None:
    """A greedy agreement below its minimum, named with its likely causes."""
    if greedy.get("passed") is not False:
        return None
    worst = ", ".join(f"{sample_id} {share:.0%}" for sample_id, share in sorted(greedy["per_sample"].items(), key=lambda item: item[1])[:3])
    return (
        f"transformers' greedy choice agrees with {greedy['share']:.1%} of the {greedy['answer_tokens']} answer "
        f"tokens generation produced, below extract.fidelity_min_greedy_agreement {greedy['minimum']:g} "
        f"(lowest: {worst}): the server that answered runs the target otherwise than its checkpoint "
        "(another model or dtype behind generate.endpoint, a missing or zeroed lm_head or final norm, "
        "another rope). Check generation's server log and the target before training on these answers."
    )
