"""Do the two extraction backends agree? Catches wrong layer ids and norm mix-ups."""

from __future__ import annotations

import torch

DEFAULT_TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


def relative_errors(reference: torch.Tensor, other: torch.Tensor) -> list[float]:
    """Per layer slot: max |difference| over max |reference| ([seq, n_ids, hidden])."""
    difference = (other.float() - reference.float()).abs().amax(dim=(0, 2))
    scale = reference.float().abs().amax(dim=(0, 2)).clamp_min(1e-12)
    return (difference / scale).tolist()


def compare(
    reference: dict[int, torch.Tensor],
    other: dict[int, torch.Tensor],
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
        "samples": len(reference),
        "tolerance": tolerance,
        "max_relative_error_per_layer": dict(zip(map(str, layer_ids), worst, strict=True)),
        "passed": all(error <= tolerance for error in worst),
    }
