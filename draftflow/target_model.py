"""The text model of a target checkpoint: its settings and the names of its head weights.

Multimodal checkpoints keep the language model's settings in a section of
config.json (``text_config``, as transformers' ``get_text_config`` finds it)
and its weights under a prefix (``language_model.model.norm.weight``); a
model with tied embeddings has no lm_head weight of its own. Only
config.json, generation_config.json and the safetensors headers are read (no
torch, no transformers), so the Snakefile and the progress check use it too;
``final_norm`` asks transformers, importing it when called, and so does the
drafter's norm check where config.json lacks ``rms_norm_eps``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

# Keys under which composite configs keep their language model: transformers'
# get_text_config looks for text_config, decoder and generator; remote-code
# models use the others.
TEXT_SECTIONS = ("text_config", "decoder", "generator", "language_config", "llm_config", "language_model")
LAYER_LISTS = ("layers_block_type", "layer_types")
# A decoder's embedding and final norm, as transformers names them: embed_tokens and
# norm, or embeddings and norm_f in Mamba-style backbones (Nemotron-H).
EMBEDDINGS, FINAL_NORMS = ("embed_tokens", "embeddings"), ("norm", "norm_f")
LM_HEAD = "lm_head.weight"


class TargetModelError(ValueError):
    """The target's config or weights lack what the workflow needs; the message names the file."""


@dataclass(frozen=True)
class HeadWeights:
    """Safetensors names of the text model's embedding, final norm and lm_head."""

    embed_tokens: str
    final_norm: str
    lm_head: str  # the embedding when tied
    tied: bool
    files: dict[str, str]  # each name above -> its safetensors file, relative to the target


@dataclass(frozen=True)
class TargetModel:
    """A target's text model. Each setting is read when asked for, so that a
    config holding only what a caller needs will do, and a missing one fails
    naming the file and the key."""

    folder: Path
    config: dict  # all of config.json
    section: tuple[str, ...]  # keys from the top of config.json to the text model's settings

    @property
    def config_file(self) -> Path:
        return self.folder / "config.json"

    @property
    def text_config(self) -> dict:
        settings = self.config
        for key in self.section:
            settings = settings[key]
        return settings

    @property
    def section_name(self) -> str:
        return ".".join(self.section) or "its top level"

    def setting(self, key: str):
        if key not in self.text_config:
            raise TargetModelError(f"{self.config_file} has no {key!r} in {self.section_name}")
        return self.text_config[key]

    @property
    def num_layers(self) -> int:
        """num_hidden_layers, else the length of the per-layer list that replaces it
        (Nemotron-H's layers_block_type as transformers writes it)."""
        if "num_hidden_layers" not in self.text_config:
            lists = [value for key in LAYER_LISTS if isinstance(value := self.text_config.get(key), list)]
            if lists:
                return len(lists[0])
        return self.setting("num_hidden_layers")

    @property
    def hidden_size(self) -> int:
        return self.setting("hidden_size")

    @property
    def vocab_size(self) -> int:
        return self.setting("vocab_size")

    @property
    def head_dim(self) -> int:
        """Attention head width: ``head_dim`` where the config gives it, else hidden / heads."""
        return self.text_config.get("head_dim") or self.hidden_size // self.setting("num_attention_heads")

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_key_value_heads`` where the config gives it, else the attention heads."""
        return self.text_config.get("num_key_value_heads") or self.setting("num_attention_heads")

    @property
    def parameters_per_token(self) -> int:
        """The weights one token is multiplied with, from the config (an estimate): each layer's
        attention projections and MLP (for an MoE the experts a token is routed to and the
        shared ones), and the output head. What a forward pass's compute per token goes as."""
        text, hidden = self.text_config, self.hidden_size
        heads = self.setting("num_attention_heads")
        attention = hidden * self.head_dim * 2 * (heads + self.kv_heads)
        routed = text.get("num_experts_per_tok") or text.get("num_experts_per_token")
        if routed and text.get("moe_intermediate_size"):
            shared = text.get("n_shared_experts") or text.get("num_shared_experts") or 0
            mlp = 3 * hidden * text["moe_intermediate_size"] * (routed + shared)
        else:
            mlp = 3 * hidden * self.setting("intermediate_size")
        return self.num_layers * (attention + mlp) + hidden * self.vocab_size

    def kv_cache_bytes_per_token(self, dtype_bytes: int, tensor_parallel_size: int) -> int:
        """One token's KV cache on each GPU of a server splitting the target over
        ``tensor_parallel_size``: MLA's compressed latent (``kv_lora_rank`` + ``qk_rope_head_dim``,
        whole on every GPU), else the keys and values of its KV heads (split over the GPUs, at
        least one head each). Every layer counted at full length: an upper bound for models
        with sliding-window layers."""
        text = self.text_config
        if text.get("kv_lora_rank"):
            per_layer = text["kv_lora_rank"] + text.get("qk_rope_head_dim", 0)
        else:
            per_layer = 2 * max(1, self.kv_heads // tensor_parallel_size) * self.head_dim
        return self.num_layers * per_layer * dtype_bytes

    def check_draft_vocab_size(self, draft_vocab_size: int) -> None:
        if draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"vocab.draft_vocab_size={draft_vocab_size} is larger than the target's "
                f"vocabulary ({self.vocab_size}, {self.config_file}); choose at most that."
            )

    @property
    def model_type(self) -> str:
        """The model type that loads (``kimi_k25`` for Kimi-K2.5, not its text model's)."""
        if "model_type" not in self.config:
            raise TargetModelError(f"{self.config_file} has no 'model_type'")
        return self.config["model_type"]

    @property
    def architectures(self) -> list[str]:
        return self.config.get("architectures") or []

    @property
    def eos_token_ids(self) -> list[int]:
        """From the text model's settings, the top level or generation_config.json; [] when none says."""
        eos = self.token_id("eos_token_id")
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_id("pad_token_id")

    def token_id(self, key: str):
        generation_file = self.folder / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.exists() else {}
        for settings in (self.text_config, self.config, generation):
            if settings.get(key) is not None:
                return settings[key]
        return None

    @property
    def declared_tied(self) -> bool | None:
        """tie_word_embeddings of the text model's settings, else of the top level."""
        for settings in (self.text_config, self.config):
            if "tie_word_embeddings" in settings:
                return bool(settings["tie_word_embeddings"])
        return None

    @property
    def weight_bytes(self) -> int | None:
        """Bytes of the safetensors weights (the index's total_size where it says), None without weights."""
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
            if total:
                return int(total)
        files = list(self.folder.glob("*.safetensors"))
        return sum(path.stat().st_size for path in files) if files else None

    def check_output_head(self) -> None:
        """Stop on a checkpoint whose weights lack the output head its config says it has."""
        if self.weight_bytes is not None:
            _ = self.head_weights  # raises naming the file and what to do

    def check_drafter_norm_epsilon(self, trust_remote_code: bool = False) -> None:
        """Stop where speculators can build no drafter for the target: it gives the
        drafter's norms the target's ``rms_norm_eps`` as transformers' config class reads
        it, which some families lack (Nemotron-H calls it layer_norm_epsilon, Cohere2-MoE
        layer_norm_eps). At parse time, not in drafter_init after generation."""
        if self.text_config.get("rms_norm_eps") is not None or "model_type" not in self.config:
            return  # set, or a config.json transformers cannot read (no model_type): nothing to ask
        if transformers_rms_norm_eps(self.folder, trust_remote_code) is not None:
            return
        others = [key for key in self.text_config if key.endswith(("_eps", "_epsilon"))]
        instead = f" (it has {', '.join(others)})" if others else ""
        raise TargetModelError(
            f"{self.config_file}: speculators builds the EAGLE-3 drafter's norms with the target's "
            f"rms_norm_eps, which {'/'.join(self.architectures) or 'its text model'} does not set{instead}, "
            "so no drafter can be built for this target with the installed speculators. Nothing was run."
        )

    def final_norm(self, weight=None):
        """transformers' final norm of the text model, on the CPU in float32, with ``weight``
        (a tensor) or zeros: it knows the norm's kind, its epsilon and whether it scales by
        weight or by 1 + weight (Gemma-3, Qwen3-Next)."""
        return transformers_final_norm(self.folder, weight)

    @cached_property
    def final_norm_offset(self) -> float:
        """What the text model's final norm adds to its weight before scaling: 1.0 for
        Gemma-style norms (``1 + weight``), else 0.0. Where speculators applies the
        target's norm weight itself, it scales by norm weight + this."""
        return norm_offset(self.final_norm(), self.config_file)

    @cached_property
    def head_weights(self) -> HeadWeights:
        files = weight_files(self.folder)
        embed_tokens, final_norm = decoder_weights(files, self.folder)
        candidates = lm_head_candidates(embed_tokens)
        lm_head = next((name for name in candidates if name in files), None)
        # A config silent on tying is tied when there is no lm_head to use.
        tied = lm_head is None if self.declared_tied is None else self.declared_tied
        if not tied and lm_head is None:
            raise TargetModelError(
                f"{self.config_file} says tie_word_embeddings is false, but the weights in "
                f"{self.folder} hold no lm_head ({' or '.join(candidates)}): vLLM would serve an "
                "output layer of zeros without a warning, and every answer would be empty or one token repeated. "
                "Add the checkpoint's lm_head weights, or set tie_word_embeddings: true if the model ties them."
            )
        head = embed_tokens if tied else lm_head
        return HeadWeights(
            embed_tokens, final_norm, head, tied, {name: files[name] for name in (embed_tokens, final_norm, head)}
        )


def read_target_model(folder: str | Path) -> TargetModel:
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise TargetModelError(f"{config_file} does not exist: target.path must be a model folder")
    config = json.loads(config_file.read_text())
    return TargetModel(folder, config, text_section(config, config_file))


def text_section(config: dict, config_file: Path) -> tuple[str, ...]:
    """Keys leading to the text model's settings, descending while a section nests another."""
    section: tuple[str, ...] = ()
    settings = config
    while nested := [key for key in TEXT_SECTIONS if isinstance(settings.get(key), dict)]:
        if len(nested) > 1:
            raise TargetModelError(
                f"{config_file}: more than one section could hold the text model "
                f"({', '.join('.'.join((*section, key)) for key in nested)})"
            )
        section += (nested[0],)
        settings = settings[nested[0]]
    return section


def weight_files(folder: Path) -> dict[str, str]:
    """Weight name -> the safetensors file holding it, relative to ``folder``."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TargetModelError(
            f"{folder} holds no safetensors weights (model.safetensors or model.safetensors.index.json)"
        )
    return {name: path.name for path in files for name in safetensors_names(path)}


def safetensors_names(path: Path) -> list[str]:
    """Tensor names from a safetensors file's header (8-byte length, then JSON)."""
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    return [name for name in header if name != "__metadata__"]


def decoder_weights(names: dict[str, str], folder: Path) -> tuple[str, str]:
    """The text decoder's embedding and final norm weights (``model.embed_tokens.weight``,
    ``language_model.model.norm.weight``, ``backbone.norm_f.weight``): both under one prefix."""
    found = [
        (f"{prefix}{embedding}.weight", f"{prefix}{norm}.weight")
        for name in names
        for embedding in EMBEDDINGS
        if name == f"{embedding}.weight" or name.endswith(f".{embedding}.weight")
        for prefix in [name.removesuffix(f"{embedding}.weight")]
        for norm in FINAL_NORMS
        if f"{prefix}{norm}.weight" in names
    ]
    if len(found) != 1:
        listed = f"several ({', '.join(' and '.join(pair) for pair in found)})" if found else "none"
        raise TargetModelError(
            f"the weights in {folder} must hold one text decoder, a PREFIX with both its embedding "
            f"(PREFIX{{{','.join(EMBEDDINGS)}}}.weight) and its final norm (PREFIX{{{','.join(FINAL_NORMS)}}}.weight), "
            f"e.g. model.embed_tokens.weight and model.norm.weight; found {listed}"
        )
    return found[0]


def lm_head_candidates(embedding: str) -> list[str]:
    """Beside the decoder (``language_model.lm_head.weight`` for ``language_model.model.embed_tokens.weight``), or at the top."""
    decoder = embedding.rsplit(".", 2)[0]  # language_model.model
    parent = decoder.rpartition(".")[0]  # language_model
    return [f"{parent}.{LM_HEAD}", LM_HEAD] if parent else [LM_HEAD]


def final_norm_module(decoder):
    """The final norm of a transformers text decoder (``norm``, or ``norm_f``)."""
    import torch

    for name in FINAL_NORMS:
        if isinstance(module := getattr(decoder, name, None), torch.nn.Module):
            return module
    raise TargetModelError(f"{type(decoder).__name__} has no final norm ({' or '.join(FINAL_NORMS)})")


def transformers_rms_norm_eps(folder: Path, trust_remote_code: bool) -> float | None:
    """The target's rms_norm_eps as speculators reads it: transformers' config class, its
    text_config where it has one."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    return getattr(getattr(config, "text_config", config), "rms_norm_eps", None)


def transformers_final_norm(folder: Path, weight=None):
    """The target's final norm as transformers builds it for its text model (on the meta
    device first: no other weight is made, however large the model)."""
    import torch
    from transformers import AutoConfig, AutoModel

    text_config = AutoConfig.from_pretrained(folder).get_text_config()
    with torch.device("meta"):
        decoder = AutoModel.from_config(text_config)
    norm = final_norm_module(decoder).to_empty(device="cpu").float()
    with torch.no_grad():
        norm.weight.copy_(torch.zeros(norm.weight.shape) if weight is None else weight)
    return norm


def norm_offset(norm, config_file: Path) -> float:
    """What a final norm given a zero weight scales by: 0 or 1 (``1 + weight``)."""
    import torch

    with torch.no_grad():
        scale = norm(torch.ones(1, norm.weight.shape[-1]))
    for offset in (0.0, 1.0):
        if torch.allclose(scale, torch.full_like(scale, offset), atol=1e-3):
            return offset
    raise TargetModelError(
        f"{config_file}: transformers' final norm for this model ({type(norm).__name__}) "
        f"scales by neither its weight nor 1 + weight (with a zero weight ones became {scale.flatten()[:4].tolist()})"
    )
