"""Which target layers feed the drafter (EAGLE-3's aux layers plus the final one)."""

from __future__ import annotations


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """speculators' and vLLM's default: early, middle and late layers."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_layer_ids(aux_layer_ids: list[int] | None, num_layers: int) -> list[int]:
    """Aux layer ids (config, or the default) followed by the final layer id N.

    Id k is the residual stream after k decoder layers (vLLM's numbering,
    equal to Hugging Face ``output_hidden_states[k]`` for k < N); id N is the
    last layer's output before the final norm.
    """
    aux = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(num_layers)
    problems = []
    if any(not 0 <= k < num_layers for k in aux):
        problems.append(f"each must be in 0..{num_layers - 1}")
    if len(set(aux)) != len(aux):
        problems.append("they must be distinct")
    if problems:
        raise ValueError(
            f"extract.layer_ids {aux} do not fit the target's {num_layers} layers: "
            f"{' and '.join(problems)}. Set extract.layer_ids to distinct ids below "
            f"{num_layers} (the final layer {num_layers} is added automatically)."
        )
    return [*aux, num_layers]
