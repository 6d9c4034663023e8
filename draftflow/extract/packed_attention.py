"""Attention over packed samples: several samples in one row, each attending only to itself.

A batch is one row of the samples' tokens end to end; ``position_ids`` restart at
each sample and ``cu_seq_lens`` (the offsets where samples start, transformers'
flash-attention keywords) tell the attention where one ends. No work is spent on
padding, and attention costs the sum of the samples' squared lengths, not the
square of the row's.

The implementation is registered with transformers' ``AttentionInterface`` and
has no mask function, so transformers builds no mask for it (and does not
synchronize with the GPU to look for packed sequences). Called without
``cu_seq_lens`` it is plain SDPA, so the model stays usable for a single
unpadded sequence. On CUDA in 16-bit it runs PyTorch's variable-length flash
kernel (``torch.nn.attention.varlen``) in one call; elsewhere (CPU, float32)
it runs SDPA once per sample, so each sample's attention is exactly that of
the sample alone.
"""

from __future__ import annotations

import inspect
import itertools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # a torch before variable-length attention
    varlen_attn = None

IMPLEMENTATION = "draftflow_packed"
VARLEN_PARAMETERS = inspect.signature(varlen_attn).parameters if varlen_attn is not None else {}
VARLEN_GQA = "enable_gqa" in VARLEN_PARAMETERS
# torch 2.11 asks for is_causal; later releases express causality as a window of (all before, none after)
VARLEN_CAUSAL = {"is_causal": True} if "is_causal" in VARLEN_PARAMETERS else {"window_size": (-1, 0)}
# Keywords of attention features the packed kernels do not apply: sliding windows, sinks.
UNSUPPORTED_KEYWORDS = ("sliding_window", "s_aux", "sinks")


def packing_refusal(config) -> str | None:
    """Why the decoder of ``config`` cannot run packed samples, or None when it can:
    every layer must attend causally to the whole sample with SDPA."""
    if config._attn_implementation not in ("sdpa", IMPLEMENTATION):
        return f"its attention implementation is {config._attn_implementation}"
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"its layers attend as {sorted(kinds)}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "it attends within a sliding window"
    if getattr(config, "attention_chunk_size", None):
        return "it attends within chunks"
    return None


def use_packed_attention(config) -> None:
    config._attn_implementation = IMPLEMENTATION


def use_sdpa(config) -> None:
    config._attn_implementation = "sdpa"


def sample_offsets(lengths: list[int]) -> list[int]:
    """Where each sample of a packed row starts, and where the last one ends."""
    return [0, *itertools.accumulate(lengths)]


def packed_keywords(offsets: list[int], device: torch.device) -> dict:
    """The keywords a decoder's forward passes on to the attention of every layer."""
    longest = max(end - start for start, end in itertools.pairwise(offsets))
    offsets = torch.tensor(offsets, dtype=torch.int32).to(device, non_blocking=True)
    return {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": longest, "max_length_k": longest}


def position_ids(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(length) for length in lengths])[None]


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [1, heads, tokens, dim], key and value [1, kv_heads, tokens, dim];
    returns [1, tokens, heads, value dim] as transformers' attention functions do."""
    offsets = kwargs.pop("cu_seq_lens_q", None)
    if offsets is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if unsupported := [name for name in UNSUPPORTED_KEYWORDS if kwargs.get(name) is not None]:
        raise RuntimeError(f"packed attention cannot apply {unsupported} of {type(module).__name__}")
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and varlen_attn is not None:
        return _varlen_flash(module, query, key, value, offsets, kwargs["max_length_q"], scaling), None
    return _each_sample(module, query, key, value, offsets, scaling, kwargs), None


def _varlen_flash(module, query, key, value, offsets, longest: int, scaling) -> torch.Tensor:
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # [tokens, heads, dim]
    if k.shape[1] != q.shape[1] and not VARLEN_GQA:
        k, v = (tensor.repeat_interleave(q.shape[1] // tensor.shape[1], dim=1) for tensor in (k, v))
    value_dim = v.shape[-1]
    if value_dim != q.shape[-1]:  # MLA: the kernel takes one head size
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - value_dim))
    gqa = {"enable_gqa": True} if VARLEN_GQA and k.shape[1] != q.shape[1] else {}
    out = varlen_attn(q, k, v, offsets, offsets, longest, longest, scale=scaling, **VARLEN_CAUSAL, **gqa)
    return out[..., :value_dim][None]


def _each_sample(module, query, key, value, offsets, scaling, kwargs) -> torch.Tensor:
    kwargs = {name: v for name, v in kwargs.items() if not name.startswith(("cu_seq_lens", "max_length"))}
    bounds = offsets.tolist()
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None, 0.0, scaling, **kwargs
        )[0]
        for start, end in zip(bounds, bounds[1:])
    ]
    return torch.cat(outputs, dim=1)


AttentionInterface.register(IMPLEMENTATION, packed_attention)
