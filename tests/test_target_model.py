"""One place resolves a target's text model: plain, tied and nested (multimodal) checkpoints."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import Gemma3Config, Gemma3TextConfig, LlamaConfig, NemotronHConfig, Qwen3NextConfig

from draftflow.target_model import TargetModelError, read_target_model
from tests.conftest import snakemake
from tests.test_example_configs import example_config

TEXT_MODEL = {"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 32, "rms_norm_eps": 1e-6}


def write_target(folder, config, weight_names, generation_config=None):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if generation_config:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    save_file({name: torch.zeros(2) for name in weight_names}, str(folder / "model.safetensors"))
    return read_target_model(folder)


def test_a_plain_llama_target(tmp_path):
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False,
              "eos_token_id": 2, "pad_token_id": None, **TEXT_MODEL}  # fmt: skip
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
    target = write_target(tmp_path / "llama", config, names, generation_config={"pad_token_id": 0})
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (4, 8, 32)
    assert (target.model_type, target.architectures, target.section) == ("llama", ["LlamaForCausalLM"], ())
    assert (target.eos_token_ids, target.pad_token_id) == ([2], 0)
    head = target.head_weights
    assert (head.embed_tokens, head.final_norm, head.lm_head, head.tied) == (
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", False
    )  # fmt: skip
    assert set(head.files.values()) == {"model.safetensors"}


def test_tied_embeddings_use_the_embedding_as_lm_head(tmp_path):
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    declared = write_target(tmp_path / "declared", {**TEXT_MODEL, "tie_word_embeddings": True}, names)
    silent = write_target(tmp_path / "silent", TEXT_MODEL, names)
    for target in (declared, silent):
        assert target.head_weights.tied and target.head_weights.lm_head == "model.embed_tokens.weight"


def test_a_kimi_k25_style_target_nests_its_text_model(tmp_path):
    """Kimi-K2.5: DeepSeek-V3 under text_config, weights under language_model., the top level tied by default."""
    config = {
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
        "tie_word_embeddings": True,
        "vision_config": {"hidden_size": 16},
        "text_config": {"model_type": "deepseek_v3", "tie_word_embeddings": False, "eos_token_id": [5, 6],
                        **TEXT_MODEL},  # fmt: skip
    }
    names = ["vision_tower.patch_embed.weight", "mm_projector.proj.weight", "language_model.model.embed_tokens.weight",
             "language_model.model.layers.0.mlp.gate.weight", "language_model.model.norm.weight",
             "language_model.lm_head.weight"]  # fmt: skip
    target = write_target(tmp_path / "kimi", config, names)
    assert (target.section, target.num_layers, target.hidden_size) == (("text_config",), 4, 8)
    assert (target.model_type, target.eos_token_ids) == ("kimi_k25", [5, 6])
    head = target.head_weights
    assert (head.final_norm, head.lm_head, head.tied) == (
        "language_model.model.norm.weight", "language_model.lm_head.weight", False
    )  # fmt: skip


def test_a_mamba_style_backbone_names_its_embedding_and_final_norm_otherwise(tmp_path):
    """Nemotron-H as transformers saves it: backbone.embeddings and backbone.norm_f, beside
    per-layer norms that must not be taken for the final one."""
    names = ["backbone.embeddings.weight", "backbone.layers.0.norm.weight", "backbone.layers.0.mixer.in_proj.weight",
             "backbone.norm_f.weight", "lm_head.weight"]  # fmt: skip
    head = write_target(tmp_path / "nemotron_h", {**TEXT_MODEL, "tie_word_embeddings": False}, names).head_weights
    assert (head.embed_tokens, head.final_norm, head.lm_head) == (
        "backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head.weight"
    )  # fmt: skip


def test_sections_nested_deeper_and_sharded_weights(tmp_path):
    """transformers 5's VLM layout: model.language_model.* with lm_head.weight at the top, in shards."""
    target = tmp_path / "nested"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"language_model": {"text_config": TEXT_MODEL}}))
    save_file({"model.language_model.embed_tokens.weight": torch.zeros(2)}, str(target / "a.safetensors"))
    save_file({name: torch.zeros(2) for name in ("model.language_model.norm.weight", "lm_head.weight")},
              str(target / "b.safetensors"))  # fmt: skip
    weight_map = {"model.language_model.embed_tokens.weight": "a.safetensors",
                  "model.language_model.norm.weight": "b.safetensors", "lm_head.weight": "b.safetensors"}  # fmt: skip
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    resolved = read_target_model(target)
    assert resolved.section == ("language_model", "text_config") and resolved.num_layers == 4
    assert resolved.head_weights.lm_head == "lm_head.weight"
    assert resolved.head_weights.files["model.language_model.norm.weight"] == "b.safetensors"


def test_transformers_says_which_final_norms_scale_by_one_plus_weight(tmp_path):
    """Llama's norm (and Nemotron-H's norm_f) scales by its weight, Gemma-3's and
    Qwen3-Next's by 1 + weight, also under a multimodal config's text_config; config.json
    alone is read."""
    tiny = {"num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 32}  # fmt: skip
    offsets = {}
    for config in (LlamaConfig(**tiny), Gemma3TextConfig(**tiny), Gemma3Config(text_config=tiny),
                   Qwen3NextConfig(**tiny, linear_num_key_heads=1, linear_num_value_heads=1),
                   NemotronHConfig(**tiny, layers_block_type=["attention"])):  # fmt: skip
        config.save_pretrained(tmp_path / config.model_type)
        offsets[config.model_type] = read_target_model(tmp_path / config.model_type).final_norm_offset
    assert offsets == {"llama": 0.0, "gemma3_text": 1.0, "gemma3": 1.0, "qwen3_next": 1.0, "nemotron_h": 0.0}


def test_a_target_without_rms_norm_eps_stops_at_parse_time(tmp_path):
    """speculators builds the drafter's norms with the target's rms_norm_eps as transformers'
    config class reads it: a Llama config.json without the key gets the class's default and
    passes; Nemotron-H's class has layer_norm_epsilon instead, and the run stops, naming it."""
    tiny = {"num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 32}  # fmt: skip
    llama = LlamaConfig(**tiny).to_dict()
    del llama["rms_norm_eps"]
    write_target(tmp_path / "llama", llama, ["model.embed_tokens.weight"]).check_drafter_norm_epsilon()
    NemotronHConfig(**tiny, layers_block_type=["attention"], architectures=["NemotronHForCausalLM"]).save_pretrained(
        tmp_path / "nemotron_h"
    )
    with pytest.raises(TargetModelError, match="rms_norm_eps, which NemotronHForCausalLM does not set") as stopped:
        read_target_model(tmp_path / "nemotron_h").check_drafter_norm_epsilon()
    assert "(it has layer_norm_epsilon)" in str(stopped.value) and "config.json" in str(stopped.value)


def test_what_is_missing_is_named_with_its_file(tmp_path):
    target = write_target(tmp_path / "bare", {"text_config": {"hidden_size": 8}}, ["model.norm.weight"])
    with pytest.raises(TargetModelError, match=r"bare/config.json has no 'num_hidden_layers' in text_config"):
        target.num_layers
    with pytest.raises(TargetModelError, match=r"bare must hold one text decoder.*found none"):
        target.head_weights
    untied = write_target(tmp_path / "untied", {**TEXT_MODEL, "tie_word_embeddings": False},
                          ["language_model.model.embed_tokens.weight", "language_model.model.norm.weight"])  # fmt: skip
    with pytest.raises(TargetModelError, match=r"tie_word_embeddings is false.*language_model.lm_head.weight or lm_"):
        untied.head_weights
    with pytest.raises(TargetModelError, match=r"nowhere/config.json does not exist"):
        read_target_model(tmp_path / "nowhere")


def test_the_parse_time_check_reads_a_nested_text_model(tmp_path):
    config = example_config("llama-8b-1gpu.yaml", tmp_path, 32)
    kimi = {"model_type": "kimi_k25", "text_config": {"num_hidden_layers": 61, "vocab_size": 163840}}
    (tmp_path / "target/config.json").write_text(json.dumps(kimi))
    assert "extract_server" in snakemake(tmp_path, config, "-n").stdout
    config["extract"] = {**config["extract"], "layer_ids": [2, 70]}
    refused = snakemake(tmp_path, config, "-n", check=False)
    assert refused.returncode != 0 and "do not fit the target's 61 layers" in refused.stdout + refused.stderr


def test_a_checkpoint_without_its_output_head_stops_at_parse_time_naming_the_consequence(tmp_path):
    config = example_config("llama-8b-1gpu.yaml", tmp_path, 32)
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]  # no lm_head.weight
    save_file({name: torch.zeros(2) for name in names}, str(tmp_path / "target/model.safetensors"))
    untied = {"num_hidden_layers": 32, "vocab_size": 128256, "tie_word_embeddings": False}
    (tmp_path / "target/config.json").write_text(json.dumps(untied))
    refused = snakemake(tmp_path, config, "-n", check=False)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "Job stats" not in output
    assert f"{tmp_path / 'target/config.json'} says tie_word_embeddings is false" in output
    assert "every answer would be empty or one token repeated" in output
    (tmp_path / "target/config.json").write_text(json.dumps({**untied, "tie_word_embeddings": True}))
    assert "Job stats" in snakemake(tmp_path, config, "-n").stdout
