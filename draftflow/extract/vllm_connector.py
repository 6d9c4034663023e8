"""CPU-safe variant of vLLM's ``ExampleHiddenStatesConnector``.

vLLM's ``extract_hidden_states`` speculative method stores the requested
layers' hidden states in a KV-cache-like buffer; a KV connector then writes
them to ``<shared_storage_path>/<request_id>.safetensors`` and returns that path
in the response's ``kv_transfer_params.hidden_states_path``.

The stock ``ExampleHiddenStatesConnector`` writes asynchronously: it copies on
a CUDA stream into pinned host memory and saves from a thread pool. On a CPU
build of vLLM that crashes (``pin_memory=True`` needs CUDA; CUDA
events/streams do not exist). This subclass overrides only that write: on a
CPU KV cache it gathers and saves the tensors synchronously, atomically
(temporary name in the same directory, then ``os.replace``), and releases the
per-file ``.lock`` the stock connector pre-creates, so clients that wait on the
lock (speculators' ``generate-offline-data``) keep working. On a CUDA KV cache
it defers to the stock asynchronous write.

Use it from the vLLM command line with::

    --kv-transfer-config '{"kv_connector": "CPUHiddenStatesConnector",
        "kv_connector_module_path": "draftflow.extract.vllm_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": DIR}}'

(``draftflow`` must be importable by the server, e.g. via ``PYTHONPATH``.)
The file holds ``hidden_states`` ``[seq, n_layer_ids, hidden]`` (model dtype)
and ``token_ids`` ``[seq]`` (int64). ``CPUFP8HiddenStatesConnector`` writes
hs_connectors' fp8 format instead, as its ``FP8HiddenStatesConnector`` does on
a GPU: ``hidden_states`` in float8_e4m3fn and ``hidden_states_scales``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
from safetensors.torch import save_file
from vllm.logger import init_logger
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E501
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["CPUFP8HiddenStatesConnector", "CPUHiddenStatesConnector", "save_atomically"]

logger = init_logger(__name__)


class _CompletedCopy:
    """Stands in for the CUDA event ``get_finished`` polls: already done."""

    @staticmethod
    def query() -> bool:
        return True


def save_atomically(tensors: dict[str, torch.Tensor], filename: str) -> None:
    """Write ``tensors`` to ``filename`` via a temporary file and ``os.replace``.

    Readers never see a partially written file under ``filename``.
    """
    directory = os.path.dirname(os.path.abspath(filename))
    os.makedirs(directory, exist_ok=True)
    # A hidden name that no reader globs for (hs_*.safetensors, *.safetensors).
    # Request ids are unique; the pid guards against two servers sharing a dir.
    # (safetensors >= 0.8 creates files with mode 0600, as in the stock path.)
    tmp = os.path.join(
        directory, f".{os.path.basename(filename)}.{os.getpid()}.tmp"
    )
    try:
        save_file(tensors, tmp)
        os.replace(tmp, filename)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous write on CPU."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.device.type == "cuda":
            # Stock asynchronous path (CUDA stream + pinned memory + threads).
            super()._submit_async_write(pending)
            return

        # Same slot mapping as the stock connector.
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (
            offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size
        ).flatten()
        num_tokens = pending.token_ids.shape[0]

        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            hidden_states = extract_from_kv_cache(
                self._kv_cache, slot_mapping.to(self._kv_cache.device), num_tokens
            )
            tensors = {
                # Advanced indexing already copies; .cpu()/.contiguous() are no-ops
                # on CPU but keep the file independent of the cache buffer.
                "hidden_states": hidden_states.to("cpu").contiguous(),
                "token_ids": pending.token_ids.clone(),
            }
            save_atomically(self._stored(tensors), pending.filename)
        except Exception as exc:  # as the stock writer thread: log, keep serving
            logger.error(
                "Hidden-states write failed for req_id=%s: %r", pending.req_id, exc
            )
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX; waiting clients proceed
        # get_finished reports the request as sent (and frees its blocks) once
        # its "copy event" answers query() == True.
        done: Any = _CompletedCopy()
        self._req_copy_events[pending.req_id] = done

    @staticmethod
    def _stored(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors


class CPUFP8HiddenStatesConnector(CPUHiddenStatesConnector):
    """The CPU connector writing hs_connectors' fp8 format (a CPU KV cache only)."""

    @staticmethod
    def _stored(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        values, scales = quantize_tensor_to_fp8(tensors["hidden_states"])
        return {**tensors, "hidden_states": values, SCALES_KEY: scales}
