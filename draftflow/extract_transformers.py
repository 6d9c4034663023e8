"""In-process extraction backend: one forward pass of the target per batch, no logits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AutoModelForCausalLM

from draftflow.extraction import Sample

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def batches_by_token_budget(samples: list[Sample], token_budget: int) -> Iterator[list[Sample]]:
    """Length-sorted batches whose padded size stays within ``token_budget``."""
    ordered = sorted(samples, key=lambda s: len(s.token_ids), reverse=True)
    batch: list[Sample] = []
    for sample in ordered:
        longest = len(batch[0].token_ids) if batch else len(sample.token_ids)
        if batch and (len(batch) + 1) * longest > token_budget:
            yield batch
            batch = []
        batch.append(sample)
    if batch:
        yield batch


class LayerCapture:
    """Forward hooks that keep the residual stream after chosen numbers of layers.

    Id k >= 1 is the output of decoder layer k-1 (so id N is the last layer's
    output before the final norm); id 0 is the embedding output.
    """

    def __init__(self, decoder: torch.nn.Module, layer_ids: list[int]):
        self.layer_ids = layer_ids
        self.captured: dict[int, torch.Tensor] = {}
        modules = {0: decoder.embed_tokens} | {
            k: decoder.layers[k - 1] for k in layer_ids if k > 0
        }
        self.handles = [
            modules[k].register_forward_hook(self._keep(k)) for k in layer_ids
        ]

    def _keep(self, layer_id: int):
        def hook(module, args, output):
            self.captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def stacked(self) -> torch.Tensor:
        """[batch, seq, n_layer_ids, hidden] in the order of ``layer_ids``."""
        return torch.stack([self.captured[k] for k in self.layer_ids], dim=2)


class TransformersExtractor:
    def __init__(self, model, layer_ids: list[int], token_budget: int, device: str):
        self.decoder = model.get_decoder()
        self.capture = LayerCapture(self.decoder, layer_ids)
        self.token_budget = token_budget
        self.device = device

    @torch.inference_mode()
    def __call__(self, samples: list[Sample]) -> Iterator[tuple[Sample, torch.Tensor]]:
        for batch in batches_by_token_budget(samples, self.token_budget):
            lengths = [len(s.token_ids) for s in batch]
            input_ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, sample in enumerate(batch):
                input_ids[row, : lengths[row]] = torch.tensor(sample.token_ids)
                attention_mask[row, : lengths[row]] = 1
            self.decoder(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                use_cache=False,
            )
            states = self.capture.stacked().cpu()
            for row, sample in enumerate(batch):
                yield sample, states[row, : lengths[row]]


@contextlib.contextmanager
def transformers_extractor(
    model_path: str,
    layer_ids: list[int],
    *,
    dtype: str,
    device: str,
    token_budget: int,
    trust_remote_code: bool = False,
) -> Iterator[TransformersExtractor]:
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=TORCH_DTYPES[dtype], trust_remote_code=trust_remote_code
    )
    model.to(device).eval()
    try:
        yield TransformersExtractor(model, layer_ids, token_budget, device)
    finally:
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
