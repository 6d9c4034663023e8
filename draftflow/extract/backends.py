"""Choose an extraction backend by name; both yield ``(sample, hidden_states)``
(the vllm backend in fp8 storage yields them quantized by its connector)."""

from __future__ import annotations

from pathlib import Path

BACKENDS = ("vllm", "transformers")


def open_extractor(backend: str, target: str, layer_ids: list[int], options: dict, server_log: Path):
    """A context manager that loads the target and yields an extractor."""
    if backend == "transformers":
        from draftflow.extract.transformers_backend import transformers_extractor

        return transformers_extractor(
            target,
            layer_ids,
            dtype=options["dtype"],
            device=options["device"],
            token_budget=options["token_budget"],
            trust_remote_code=options["trust_remote_code"],
            compile_layers=options["compile"],
            storage=options["storage"],
        )
    if backend == "vllm":
        from draftflow.extract.vllm_backend import vllm_extractor

        return vllm_extractor(
            target,
            layer_ids,
            server=options["server"],
            device=options["device"],
            storage=options["storage"],
            concurrency=options["concurrency"],
            max_retries=options["max_retries"],
            server_log=server_log,
        )
    raise ValueError(f"extract.backend must be one of {BACKENDS}, not {backend!r}")
