"""vLLM extraction backend: a server with the ``extract_hidden_states`` method.

The requests go through speculators' client (``generate_hidden_states``) and
its checks; draftflow keeps the shard loop, so that files land in the shard's
directory with its journal and heartbeat (``generate-offline-data`` writes a
whole dataset's files into one directory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, as_completed, wait
from pathlib import Path

import openai
import torch
from hs_connectors import FP8Backend
from safetensors.torch import load_file
from speculators.data_generation.offline import check_hidden_states
from speculators.data_generation.vllm_client import generate_hidden_states, wait_for_lock

from draftflow.extract.hidden_states import Fp8States, payload_states
from draftflow.extract.layout import Sample
from draftflow.vllm_server import ServerGoneError, log_excerpt, vllm_server

# The connector that writes each request's states: (device, extract.storage) -> its config;
# on a GPU in fp8, hs_connectors' FP8HiddenStatesConnector as hs_connectors configures it.
CPU_CONNECTOR_MODULE = "draftflow.extract.vllm_connector"  # the server imports it, not this process
_FP8_GPU = FP8Backend.build_kv_transfer_config(argparse.Namespace(hidden_states_path=None))
CONNECTORS = {
    ("cpu", "full"): {"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path": CPU_CONNECTOR_MODULE},
    ("cpu", "fp8"): {"kv_connector": "CPUFP8HiddenStatesConnector", "kv_connector_module_path": CPU_CONNECTOR_MODULE},
    ("cuda", "full"): {"kv_connector": "ExampleHiddenStatesConnector"},
    ("cuda", "fp8"): {key: _FP8_GPU[key] for key in ("kv_connector", "kv_connector_module_path")},
}  # fmt: skip


def extraction_server_args(layer_ids: list[int], staging_dir: Path, device: str, storage: str) -> list[str]:
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    transfer = {
        **CONNECTORS[device, storage],
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(staging_dir)},
    }
    return [
        "--speculative-config", json.dumps(speculative),
        "--kv-transfer-config", json.dumps(transfer),
        "--no-enable-prefix-caching",
    ]  # fmt: skip


class VllmExtractor:
    def __init__(
        self, base_url: str, model: str, concurrency: int, max_retries: int, server_log: Path
    ):
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0)
        self.base_url = base_url
        self.model = model
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.server_log = server_log

    def fetch(self, sample: Sample) -> tuple[Sample, torch.Tensor | Fp8States]:
        try:
            path, _ = generate_hidden_states(
                self.client, self.model, {"input_ids": sample.token_ids}, max_retries=self.max_retries
            )
        except openai.APIConnectionError as error:
            raise ServerGoneError(
                f"The vLLM server at {self.base_url} died during extraction: sample "
                f"{sample.sample_id} got no answer, retried with backoff (extract.max_retries="
                f"{self.max_retries}): {error} The files finished before stay journaled; rerun "
                f"to resume the shard. {log_excerpt(self.server_log, 10)}"
            ) from error
        if Path(f"{path}.lock").exists():
            wait_for_lock(f"{path}.lock")
        payload = load_file(path)
        Path(path).unlink()
        states = payload_states(payload)
        values = states.dequantized() if isinstance(states, Fp8States) else states  # the check reads values
        check_hidden_states({**payload, "hidden_states": values}, sample.token_ids)
        return sample, states

    def __call__(self, samples: list[Sample]) -> Iterator[tuple[Sample, torch.Tensor]]:
        """Keep ``concurrency`` requests in flight; yield results as they finish."""
        with ThreadPoolExecutor(self.concurrency) as pool:
            in_flight = set()
            for sample in samples:
                if len(in_flight) >= self.concurrency:
                    finished, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
                    yield from (future.result() for future in finished)
                in_flight.add(pool.submit(self.fetch, sample))
            yield from (future.result() for future in as_completed(in_flight))


@contextlib.contextmanager
def vllm_extractor(
    model_path: str,
    layer_ids: list[int],
    *,
    server: dict,
    device: str,
    storage: str,
    concurrency: int,
    max_retries: int,
    server_log: Path,
) -> Iterator[VllmExtractor]:
    staging_dir = Path(tempfile.mkdtemp(prefix="draftflow-hs-"))
    args = [*server["args"], *extraction_server_args(layer_ids, staging_dir, device, storage)]
    try:
        with vllm_server(model_path, log_path=server_log, **{**server, "args": args}) as url:
            yield VllmExtractor(url, model_path, concurrency, max_retries, server_log)
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)
