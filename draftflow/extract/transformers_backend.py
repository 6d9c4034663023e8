"""In-process extraction backend: one forward pass of the target per batch, no logits.

On a GPU the extractor is a pipeline, so the card never waits for the disk
and the disk never waits for the card:

- samples are sorted by length and batched by ``token_budget`` tokens;
- a batch is one row of its samples packed end to end, each attending only to
  itself (``packed_attention``): no work is spent on padding. A decoder whose
  layers attend otherwise (sliding windows, chunks, sinks) gets right-padded
  rows instead, run without an attention mask: under causal attention a real
  position never sees the padding after it, so its states are exactly those
  of the unpadded sample;
- only the decoder runs (no lm_head, no logits); forward hooks keep the
  chosen layers, stacked on the GPU into ``[tokens, n_layer_ids, hidden]``
  (padded: ``[batch, seq, n_layer_ids, hidden]``);
- that block is copied to pinned host memory on a side stream
  (asynchronous device-to-host copy) while the next batch is already queued
  on the compute stream: ``in_flight`` batches are launched ahead of the one
  whose samples are being handed out, and the consumer (``run_shard``
  writing files) works on batch i while the GPU computes batch i+1 (packed
  batches build no mask, so a launch does not wait for the GPU; padded ones
  do: transformers looks for packed sequences at the start of each forward);
- with ``compile_layers`` each decoder layer's body is compiled
  (``torch.compile``, dynamic shapes: one graph serves every batch shape and
  every layer), which fuses the norms, rotary embedding and activation
  around the matrix multiplies; the hooks stay outside the compiled code;
- each sample is handed out as a view of its batch's pinned block (no copy);
  the block goes back to PyTorch's pinned-memory cache once every view of it
  is gone, so a consumer that keeps samples for a while (writes on threads)
  is safe.

``TransformersExtractor.timings`` says where the wall time went: seconds the
generator waited for the GPU (forward + copy), seconds the consumer held
control (writing files), and seconds spent launching batches; ``tokens`` and
``padded_tokens`` give the padding's share.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from collections.abc import Iterator

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from draftflow.extract import packed_attention
from draftflow.extract.hidden_states import Fp8States, to_storage
from draftflow.extract.layout import Sample
from draftflow.target_model import final_norm_module, read_target_model

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def batches_by_token_budget(samples: list[Sample], token_budget: int, packed: bool = True) -> Iterator[list[Sample]]:
    """Length-sorted batches of at most ``token_budget`` tokens (padded: rows x the longest)."""
    ordered = sorted(samples, key=lambda s: len(s.token_ids), reverse=True)
    batch: list[Sample] = []
    tokens = 0
    for sample in ordered:
        length = len(sample.token_ids)
        grown = tokens + length if packed else (len(batch) + 1) * (len(batch[0].token_ids) if batch else length)
        if batch and grown > token_budget:
            yield batch
            batch, grown = [], length
        batch.append(sample)
        tokens = grown
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
        modules = {0: decoder.get_input_embeddings()} | {
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
        """[batch, seq, n_layer_ids, hidden] in the order of ``layer_ids``; drops the captures."""
        states = torch.stack([self.captured[k] for k in self.layer_ids], dim=2)
        self.captured.clear()
        return states

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _Launched:
    """A batch whose forward pass (and, on a GPU, its copy to the host) is queued."""

    __slots__ = ("batch", "places", "states", "copied")

    def __init__(self, batch: list[Sample], places: list[tuple], states: list[torch.Tensor], copied):
        self.batch = batch
        self.places = places  # each sample's index into the batch's states
        self.states = states  # [states] or fp8 [values, scales]; on the host once ``copied`` has completed
        self.copied = copied  # a CUDA event, or None on the CPU

    def row(self, row: int) -> torch.Tensor | Fp8States:
        views = [tensor[self.places[row]] for tensor in self.states]
        return Fp8States(*views) if len(views) == 2 else views[0]


def load_target(model_path: str, **from_pretrained):
    """The target in transformers. A multimodal checkpoint (its text model under
    text_config) loads through its image-text class; its decoder is the text
    model, run text-only."""
    multimodal = bool(read_target_model(model_path).section)
    auto_class = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    return auto_class.from_pretrained(model_path, **from_pretrained)


def text_decoder(model) -> torch.nn.Module:
    """The decoder holding the embedding, the layers and the final norm. Llama-4's
    get_decoder() answers its causal LM, one level above."""
    decoder = model.get_decoder()
    while not hasattr(decoder, "layers") and hasattr(decoder, "model"):
        decoder = decoder.model
    return decoder


class TransformersExtractor:
    def __init__(
        self, model, layer_ids: list[int], token_budget: int, device: str, in_flight: int = 2, storage: str = "full",
        padded_rows: bool = False,
    ):  # fmt: skip
        self.decoder = text_decoder(model)
        self.head = model.get_output_embeddings()
        # None when the samples of a batch run packed; else why they run padded
        self.packing_refusal = (
            "padded rows were asked for" if padded_rows else packed_attention.packing_refusal(self.decoder.config)
        )
        if self.packing_refusal is None:
            packed_attention.use_packed_attention(self.decoder.config)
        self.storage = storage  # fp8: quantized where the states are, before the copy to the host
        self.capture = LayerCapture(self.decoder, layer_ids)
        self.token_budget = token_budget
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.in_flight = max(1, in_flight) if self.on_gpu else 1  # on a CPU nothing overlaps
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_gpu else None
        self.timings = {"launch_s": 0.0, "wait_gpu_s": 0.0, "consumer_s": 0.0, "batches": 0, "tokens": 0, "padded_tokens": 0}

    @property
    def packed(self) -> bool:
        return self.packing_refusal is None

    def _forward_packed(self, batch: list[Sample], lengths: list[int]) -> tuple[torch.Tensor, list[tuple]]:
        """States [tokens, n_layer_ids, hidden] of the batch's samples end to end."""
        input_ids = torch.tensor([t for s in batch for t in s.token_ids], dtype=torch.long)[None]
        positions = packed_attention.position_ids(lengths)
        if self.on_gpu:
            input_ids, positions = input_ids.pin_memory(), positions.pin_memory()
        offsets = packed_attention.sample_offsets(lengths)
        self.decoder(
            input_ids=input_ids.to(self.device, non_blocking=True),
            position_ids=positions.to(self.device, non_blocking=True),
            use_cache=False,
            **packed_attention.packed_keywords(offsets, self.device),
        )
        return self.capture.stacked()[0], [(slice(start, end),) for start, end in itertools.pairwise(offsets)]

    def _forward_padded(self, batch: list[Sample], lengths: list[int]) -> tuple[torch.Tensor, list[tuple]]:
        """States [batch, longest, n_layer_ids, hidden], each sample right-padded."""
        input_ids = torch.zeros(len(batch), max(lengths), dtype=torch.long, pin_memory=self.on_gpu)
        for row, sample in enumerate(batch):
            input_ids[row, : lengths[row]] = torch.as_tensor(sample.token_ids, dtype=torch.long)
        # Right padding, causal attention and no mask: real positions never attend to
        # the padding after them, so their states equal those of the unpadded sample.
        self.decoder(input_ids=input_ids.to(self.device, non_blocking=True), use_cache=False)
        return self.capture.stacked(), [(row, slice(0, n)) for row, n in enumerate(lengths)]

    def _launch(self, batch: list[Sample]) -> _Launched:
        lengths = [len(s.token_ids) for s in batch]
        states, places = (self._forward_packed if self.packed else self._forward_padded)(batch, lengths)
        self.timings["batches"] += 1
        self.timings["tokens"] += sum(lengths)
        self.timings["padded_tokens"] += states.shape[:-2].numel()
        parts = [states]
        if self.storage == "fp8":
            stored = to_storage(states.flatten(0, -3), "fp8")  # one scale per token, over its layers
            parts = [stored.values.view(states.shape), stored.scales.view(*states.shape[:-2], 1, 1)]
        if not self.on_gpu:
            return _Launched(batch, places, parts, None)
        hosts = [torch.empty(part.shape, dtype=part.dtype, pin_memory=True) for part in parts]
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for host, part in zip(hosts, parts, strict=True):
                host.copy_(part, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        for part in parts:
            part.record_stream(self.copy_stream)  # the allocator keeps it until the copy is done
        return _Launched(batch, places, hosts, copied)

    @torch.inference_mode()
    def __call__(self, samples: list[Sample]) -> Iterator[tuple[Sample, torch.Tensor | Fp8States]]:
        batches = batches_by_token_budget(samples, self.token_budget, self.packed)
        launched: deque[_Launched] = deque()
        timings = self.timings
        while True:
            started = time.perf_counter()
            while len(launched) < self.in_flight and (batch := next(batches, None)) is not None:
                launched.append(self._launch(batch))
            timings["launch_s"] += time.perf_counter() - started
            if not launched:
                return
            ready = launched.popleft()
            if ready.copied is not None:
                started = time.perf_counter()
                ready.copied.synchronize()
                timings["wait_gpu_s"] += time.perf_counter() - started
            for row, sample in enumerate(ready.batch):
                handed = time.perf_counter()
                yield sample, ready.row(row)
                timings["consumer_s"] += time.perf_counter() - handed
            del ready

    @torch.inference_mode()
    def greedy_next_tokens(self, states: torch.Tensor) -> list[int]:
        """The target's greedy choice after each position of a sample: its last layer's
        states before the final norm (the last slot of ``states``, as extracted) through
        the final norm and the output head."""
        last = states[:, -1].to(self.device, self.head.weight.dtype)
        return self.head(final_norm_module(self.decoder)(last)).argmax(-1).tolist()

    def close(self) -> None:
        """Remove the hooks and give the decoder back its SDPA attention."""
        self.capture.remove()
        if self.packed:
            packed_attention.use_sdpa(self.decoder.config)


def compile_decoder_layers(decoder: torch.nn.Module) -> None:
    """Compile each layer's ``forward``, not the module: forward hooks run around it, uncompiled."""
    for layer in decoder.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


@contextlib.contextmanager
def transformers_extractor(
    model_path: str,
    layer_ids: list[int],
    *,
    dtype: str,
    device: str,
    token_budget: int,
    trust_remote_code: bool = False,
    compile_layers: bool | None = None,
    storage: str = "full",
) -> Iterator[TransformersExtractor]:
    """``compile_layers`` None compiles on CUDA only: there compiled states were as close to
    float32 as eager ones on trained weights, and faster; on a CPU compiling costs more than it saves."""
    model = load_target(model_path, dtype=TORCH_DTYPES[dtype], trust_remote_code=trust_remote_code)
    model.to(device).eval()
    if compile_layers is None:
        compile_layers = torch.device(device).type == "cuda"
    if compile_layers:
        compile_decoder_layers(text_decoder(model))
    extractor = TransformersExtractor(model, layer_ids, token_budget, device, storage=storage)
    try:
        yield extractor
    finally:
        extractor.close()
        del model, extractor
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
