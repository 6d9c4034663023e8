"""Which target layers feed the drafter (EAGLE-3's aux layers plus the final one)."""

from __future__ import annotations


MIN_LAYERS_FOR_DEFAULT = 4  # three distinct aux layers below N, not all at the bottom


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Early, middle and late layers: vLLM's and speculators' default [2, N//2, N-3]
    where its ids are distinct (N >= 7), else [1, N//2, N-1], the same spread on
    4 to 6 layers. A drafter records the ids it was trained on, so vLLM serves it
    with these, not its own default."""
    if num_layers < MIN_LAYERS_FOR_DEFAULT:
        raise ValueError(
            f"The target has {num_layers} layers: too few for the default aux layers (three distinct "
            f"ids below {num_layers}, from {MIN_LAYERS_FOR_DEFAULT} layers up). Set extract.layer_ids "
            f"to distinct ids below {num_layers}, e.g. {list(range(num_layers))[-3:] or [0]}."
        )
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    return [1, num_layers // 2, num_layers - 1]


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
