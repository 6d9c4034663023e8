"""Stage 7: how often the drafter's tokens would be accepted, from held-out hidden states.

For every start position in an assistant turn the drafter proposes K tokens as
a chain (greedy, as vLLM drafts), and each is weighed as vLLM's rejection sampling
weighs it, from the target's own norm and lm_head over the final-layer state: at
temperature 0 accepted when it is the target's greedy token, at T > 0 with the
target's probability of it. A proposal counts only while every earlier one was
accepted, as at serving time, and only while the data holds the target's state
after it (the earlier drafts are the answer's tokens).

Two averages come from those chains. The every-position one (the training metric)
scores a chain at each start. Decoding drafts only where it stands and jumps a + 1
after a accepted tokens, so it visits the stretches a drafter finds easy about once
a chain and the hard ones at every step: the decoding replay walks each answer so,
from the prompt's end to the served ``max_tokens``, and predicts what vLLM's own
counters will say when it serves the drafter on the same prompts: at temperature 0
exactly but for near ties where the answers follow the target's greedy path, and at the
temperature they were sampled at as one draw of serving (``predicts_serving``).

The gate reads the held-out slice at K = ``evaluate.draft_tokens`` and the temperature the
target is served at (``sampling.gate_temperature``); the trained drafter
is also measured on each evaluation set (``evaluate.datasets``), per category, at
each K of the sweep (``measure``), as published drafters are compared.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import load_from_disk
from safetensors import safe_open

from draftflow.acceptance_tables import sets_table, shares_text
from draftflow.extract.hidden_states import read_hidden_states
from draftflow.extract.layout import view_file_name
from draftflow.io import atomic_path, write_json
from draftflow.plots import pyplot, save_png
from draftflow.prepared_rows import CATEGORY, EVALUATION_SET
from draftflow.prompt_sources import HELDOUT
from draftflow.sampling import temperature_key
from draftflow.target_model import TargetModel, read_target_model


class LayerIdMismatch(ValueError):
    pass


def check_layer_ids(drafter_config: dict, extracted_layer_ids: list[int], drafter_dir: Path) -> None:
    aux = drafter_config["eagle_aux_hidden_state_layer_ids"]
    if list(aux) != list(extracted_layer_ids[:-1]):
        raise LayerIdMismatch(
            f"{drafter_dir}/config.json has eagle_aux_hidden_state_layer_ids {aux}, but the "
            f"hidden states were extracted from layers {extracted_layer_ids[:-1]} (+ final "
            f"{extracted_layer_ids[-1]}). Retrain the drafter on these hidden states."
        )


def target_tensors(target: TargetModel, names: list[str]) -> dict[str, torch.Tensor]:
    """Read a few of the target's weights (from any of its safetensors shards)."""
    files = target.head_weights.files
    tensors = {}
    for name in names:
        with safe_open(str(target.folder / files[name]), framework="pt") as shard:
            tensors[name] = shard.get_tensor(name).float()
    return tensors


class TargetHead:
    """The target's final norm and lm_head on ``device``: its logits from final-layer states."""

    def __init__(self, target: Path, device: str = "cpu"):
        model = read_target_model(target)
        head = model.head_weights
        weights = target_tensors(model, [head.final_norm, head.lm_head])
        self.device = device
        self.norm = model.final_norm(weights[head.final_norm]).to(device)
        self.lm_head = weights[head.lm_head].to(device)

    @torch.inference_mode()
    def logits(self, final_states: torch.Tensor) -> torch.Tensor:
        return self.norm(final_states.to(self.device).float()) @ self.lm_head.T

    def greedy(self, final_states: torch.Tensor) -> torch.Tensor:
        return self.logits(final_states).argmax(-1)


@torch.inference_mode()
def draft_chains(drafter, token_ids: torch.Tensor, aux_states: torch.Tensor, steps: int) -> torch.Tensor:
    """[steps, T-1] target-vocab tokens (on the CPU, drafted on the drafter's device); row k at j
    proposes position j+2+k."""
    length, device = token_ids.numel() - 1, drafter.d2t.device
    drafts = drafter(
        hidden_states=aux_states[:-1].flatten(1).unsqueeze(0).to(device, drafter.fc.weight.dtype),
        input_ids=token_ids[1:].unsqueeze(0).to(device),
        document_ids=torch.zeros(1, length, dtype=torch.long, device=device),
        position_ids=torch.arange(1, length + 1, device=device).unsqueeze(0),
        ttt_steps=steps,
    )
    draft = torch.cat(drafts, dim=0)
    return (draft + drafter.d2t[draft]).cpu()


GREEDY = {"temperature": 0}


def verifying_positions(drafts: torch.Tensor) -> torch.Tensor:
    """[K, starts]: the position whose target logits verify each draft (row k at j: j+1+k)."""
    steps, starts = drafts.shape
    return torch.arange(starts)[None, :] + 1 + torch.arange(steps)[:, None]


def on_data(token_ids: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Whether each draft is the data's token at the position it proposes (False past the data)."""
    proposed = verifying_positions(drafts) + 1
    inside = proposed < token_ids.numel()
    return inside & (drafts == token_ids[proposed.clamp(max=token_ids.numel() - 1)])


# The target's logits are made this many positions at a time, [positions, vocabulary] float32
# (600 MB at a 150k vocabulary), never the whole answer's (4.9 GB at 8k tokens).
POSITION_CHUNK = 1024


def cut_logits(logits: torch.Tensor, sampling: dict) -> torch.Tensor:
    """Logits at ``sampling``'s temperature (> 0), cut to its top_k and top_p as vLLM's rejection
    sampler cuts them: top_k alone by each row's k-th value, as vLLM's top-k-only path does (no
    sorted copy of the rows); with top_p by vLLM's own function. Penalties and min_p, which that
    sampler leaves out or applies from the generated text, are not modelled."""
    logits = logits / sampling["temperature"]
    top_k, top_p = sampling.get("top_k"), sampling.get("top_p")
    top_k = top_k if top_k and 0 < top_k < logits.shape[-1] else None
    if top_p is None or top_p >= 1:
        return logits if top_k is None else logits.masked_fill(logits < logits.topk(top_k, -1).values[:, -1:], float("-inf"))
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p  # here: only with top_p

    rows = logits.shape[0]
    cut_k = torch.full((rows,), top_k, dtype=torch.long, device=logits.device) if top_k else None
    return apply_top_k_top_p(logits, cut_k, torch.full((rows,), float(top_p), device=logits.device))


def acceptance_probability(logits_of, length: int, drafts: torch.Tensor, sampling: dict) -> torch.Tensor:
    """[K, starts]: the chance vLLM accepts each draft given the data before it. vLLM's drafts
    are greedy (one-hot), so its rejection sampling accepts one with the target's probability
    of it: at temperature 0, whether it is the target's greedy token. 0 past the data.
    ``logits_of(a, b)``: the target's logits at positions a to b of the ``length``, asked
    POSITION_CHUNK at a time; of each chunk only the drafted tokens' probabilities are kept
    (a log-sum-exp per row and a gather)."""
    positions = verifying_positions(drafts)
    inside = positions < length
    accepted = torch.zeros(drafts.shape)
    for start in range(0, length, POSITION_CHUNK):
        chunk = inside & (positions >= start) & (positions < start + POSITION_CHUNK)
        if not chunk.any():
            continue
        logits = logits_of(start, min(start + POSITION_CHUNK, length))
        rows, tokens = (positions[chunk] - start).to(logits.device), drafts[chunk].to(logits.device)
        if sampling["temperature"] == 0:
            accepted[chunk] = (logits.argmax(-1)[rows] == tokens).float().cpu()
        else:
            cut = cut_logits(logits, sampling)
            logp = cut[rows, tokens.clamp(min=0)] - cut.logsumexp(-1)[rows]
            accepted[chunk] = (logp.exp() * (tokens >= 0)).float().cpu()
    return accepted


def head_logits(head: TargetHead, final_states: torch.Tensor):
    """``acceptance_probability``'s ``logits_of`` for the target's head over final-layer states."""
    return lambda a, b: head.logits(final_states[a:b])


def tensor_logits(logits: torch.Tensor):
    """``acceptance_probability``'s ``logits_of`` for logits at hand."""
    return lambda a, b: logits[a:b]


def chain_reach(acceptance: torch.Tensor, drafts_on_data: torch.Tensor) -> torch.Tensor:
    """[K, starts]: the chance the chain at each start has its first k + 1 drafts accepted.
    The target's state after an accepted draft exists only where that draft is the data's
    token, so a chain is followed past a draft only there: exact at temperature 0 while the
    data follows the target's greedy path, a lower bound at T > 0."""
    follows = torch.cat([torch.ones_like(acceptance[:1]), drafts_on_data[:-1].float()]).cumprod(0)
    return acceptance.cumprod(0) * follows


def sampled_reach(drafts_on_data: torch.Tensor) -> torch.Tensor:
    """Chains accepted as decoding at the temperature the answers were sampled at accepts them
    along the data: a greedy draft is accepted exactly when it is the token sampled (vLLM's
    recovered token never repeats a rejected draft), so each answer is one draw of serving."""
    return drafts_on_data.float().cumprod(0)


def assistant_starts(loss_mask: list[int], steps: int) -> list[int]:
    """Starts j of full chains whose verified token x[j+1] is the assistant's."""
    return [j for j in range(len(loss_mask) - steps - 1) if loss_mask[j + 1]]


def answer_start(loss_mask: list[int]) -> int:
    """Where a sample's first answer begins: serve_check sends the tokens before it as the
    prompt, and the decoding replay starts there."""
    return loss_mask.index(1)


def replayed_lengths(chain_lengths: torch.Tensor, loss_mask: list[int], max_tokens: int) -> torch.Tensor:
    """Accepted chain length of each step decoding takes through the sample's first answer, as
    vLLM serves the prompt before it (``chain_lengths``: accepted drafts of the chain at each
    start): the prefill gives the answer's first token, then each step drafts from the last
    token, accepts a and emits a + 1 tokens, until ``max_tokens`` are generated or the
    answer's last token (its end of turn) is."""
    first = answer_start(loss_mask)
    answer_end = first + 1
    while answer_end < len(loss_mask) and loss_mask[answer_end]:
        answer_end += 1
    last, generated, lengths = first, 1, []
    while generated < max_tokens and last < answer_end - 1:
        accepted = int(chain_lengths[last - 1])
        lengths.append(accepted)
        generated += accepted + 1
        last += accepted + 1
    return torch.tensor(lengths, dtype=torch.long)


def reach_of(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """[K, n]: whether each chain of ``lengths`` accepted at least k + 1 drafts."""
    return (lengths[None, :] >= torch.arange(1, steps + 1)[:, None]).float()


def summarize(reach: torch.Tensor) -> dict:
    """Acceptance of chains by their reach ([K, n]: the chance each accepts its first k + 1)."""
    at_least = reach.mean(1).tolist()
    conditional = [at_least[0]] + [
        at_least[k] / at_least[k - 1] if at_least[k - 1] else 0.0 for k in range(1, len(at_least))
    ]
    accepted = float(reach.sum(0).mean())
    return {
        "positions": int(reach.shape[1]),
        "acceptance_per_position": at_least,
        "conditional_acceptance_per_position": conditional,
        "mean_accepted_drafts": accepted,
        # vLLM's convention: the target's own token plus the accepted drafts.
        "mean_acceptance_length": 1.0 + accepted,
    }


@dataclass(frozen=True)
class EvaluationSample:
    row: int  # in the view
    token_ids: list[int]
    loss_mask: list[int]
    category: str = ""  # "" outside an evaluation set's categories


class Acceptance:
    """Chains gathered over samples, per K: their reach at every start, and the accepted
    lengths along the decoding replay of the samples that are served (where it predicts
    serving: ``replays``)."""

    def __init__(self, sweep: list[int], replays: bool = True):
        self.every_position = {k: [] for k in sweep}
        self.replayed = {k: [] for k in sweep}
        self.replays = replays
        self.samples = 0

    def summary(self, max_tokens: int) -> dict:
        """Per K (as a string key, JSON's): the every-position summary and the decoding replay's."""
        by_k = {}
        for k, reaches in self.every_position.items():
            replay = replay_summary(self.replayed[k], k, max_tokens) if self.replays else None
            by_k[str(k)] = {**summarize(torch.cat(reaches, dim=1)), "decoding_replay": replay}
        return {"samples": self.samples, "draft_tokens": by_k}


def replay_summary(requests: list[torch.Tensor], steps: int, max_tokens: int) -> dict:
    """The decoding replay's drafts and accepted tokens over ``requests`` (each its steps'
    accepted lengths), as vLLM's counters count them."""
    replay = torch.cat(requests) if requests else torch.zeros(0, dtype=torch.long)
    spread = float(replay.float().std()) if replay.numel() > 1 else 0.0
    return {"requests": len(requests), "max_tokens": max_tokens, "drafts": int(replay.numel()),
            "accepted_tokens": int(replay.sum()), "accepted_drafts_std": spread, **summarize(reach_of(replay, steps))}  # fmt: skip


def predicts_serving(sampling: dict, sampled_at: float | None) -> bool:
    """Whether the decoding replay predicts serving at ``sampling``'s temperature: at 0, and at
    the temperature the answers were sampled at (``sampled_at``), where each is one draw of it."""
    return sampling["temperature"] in (0, sampled_at)


def replay_reach(reach: torch.Tensor, drafts_on_data: torch.Tensor, sampling: dict) -> torch.Tensor:
    """The chains the decoding replay accepts: at temperature 0 the greedy ones, else the data's draw."""
    return reach if sampling["temperature"] == 0 else sampled_reach(drafts_on_data)


def measure(
    drafter, head: TargetHead, view_dir: Path, samples: list[EvaluationSample], sweep: list[int],
    served_requests: int, max_tokens: int, sampling: dict = GREEDY, sampled_at: float | None = None,
) -> dict[str, Acceptance]:
    """Acceptance of ``drafter`` on ``samples`` at each K of ``sweep`` served at ``sampling``,
    overall ("") and per category; the decoding replay walks the first ``served_requests``
    samples, those serve_check serves, to the served ``max_tokens``. One drafting pass at the
    largest K serves every K: a chain's first k drafts are the chain drafted at k."""
    drafter.eval()
    replays = predicts_serving(sampling, sampled_at)
    groups: dict[str, Acceptance] = {"": Acceptance(sweep, replays)}
    for index, sample in enumerate(samples):
        states = read_hidden_states(view_dir / "hidden_states" / view_file_name(sample.row))
        ids = torch.tensor(sample.token_ids)
        drafts = draft_chains(drafter, ids, states[:, :-1], max(sweep))
        drafts_on_data = on_data(ids, drafts)
        accepted = acceptance_probability(head_logits(head, states[:, -1]), len(ids), drafts, sampling)
        reach = chain_reach(accepted, drafts_on_data)
        replayed = replay_reach(reach, drafts_on_data, sampling) if replays else None
        for group in {"", sample.category}:
            acceptance = groups.setdefault(group, Acceptance(sweep, replays))
            acceptance.samples += 1
            for k in sweep:
                acceptance.every_position[k].append(reach[:k, assistant_starts(sample.loss_mask, k)])
                if replayed is not None and index < served_requests:
                    lengths = replayed[:k].sum(0).round().long()
                    acceptance.replayed[k].append(replayed_lengths(lengths, sample.loss_mask, max_tokens))
    return groups


def evaluation_samples(view_dir: Path) -> dict[str, list[EvaluationSample]]:
    """A view's rows by the evaluation set they belong to (the held-out slice's under HELDOUT)."""
    rows = load_from_disk(str(view_dir)).with_format(None)
    by_set: dict[str, list[EvaluationSample]] = {}
    columns = (rows["input_ids"], rows["loss_mask"], rows[EVALUATION_SET], rows[CATEGORY])
    for row, (ids, mask, name, category) in enumerate(zip(*columns, strict=True)):
        by_set.setdefault(name or HELDOUT, []).append(EvaluationSample(row, ids, mask, category))
    return by_set


def set_results(groups: dict[str, Acceptance], max_tokens: int) -> dict:
    """One set's acceptance per K, and per category where its rows name them."""
    return {**groups[""].summary(max_tokens),
            "categories": {name: acceptance.summary(max_tokens) for name, acceptance in sorted(groups.items()) if name}}  # fmt: skip


def evaluate(
    drafter,
    head: TargetHead,
    view_dir: Path,
    samples: list[EvaluationSample],
    steps: int,
    served: dict,
    sampling: dict = GREEDY,
    sampled_at: float | None = None,
) -> dict:
    """The gate's measure: acceptance at K = ``steps`` on the held-out ``samples`` served at
    ``sampling``, every position and along the decoding replay of the first
    ``served["requests"]``, those serve_check serves up to ``served["max_tokens"]``."""
    groups = measure(drafter, head, view_dir, samples, [steps], served["requests"], served["max_tokens"], sampling, sampled_at)
    return groups[""].summary(served["max_tokens"])["draft_tokens"][str(steps)]


def gate(results: dict, min_acceptance_length: float, temperature: float) -> dict:
    """The evaluation gate: does the trained drafter reach ``evaluate.min_acceptance_length`` on
    the held-out slice at ``temperature`` (``results["temperatures"]`` holds it)?"""
    trained = results["temperatures"][temperature_key(temperature)]["mean_acceptance_length"]
    return {"min_acceptance_length": min_acceptance_length, "temperature": temperature,
            "mean_acceptance_length": trained, "passed": trained >= min_acceptance_length}  # fmt: skip


def gate_failure(results: dict) -> str | None:
    """The message that fails the run when ``results["gate"]`` did not pass."""
    gate = results["gate"]
    if gate["passed"]:
        return None
    trained = results["temperatures"][temperature_key(gate["temperature"])]
    return (
        f"Evaluation gate failed: mean acceptance length {gate['mean_acceptance_length']:.3f} at temperature "
        f"{gate['temperature']:g} < evaluate.min_acceptance_length {gate['min_acceptance_length']} "
        f"(untrained floor at temperature 0 {results['untrained']['mean_acceptance_length']:.3f}; per position "
        f"{[round(a, 3) for a in trained['acceptance_per_position']]}). "
        "Train longer or on more samples, or check the extraction's fidelity report."
    )


# Beside evaluation.json: what a failed gate leaves to read. Snakemake deletes a failed job's
# outputs, so it is no output of the rule; a run whose gate passes removes it.
GATE_FAILED = "gate-failed"


def gate_evidence(evaluation_output: Path) -> Path:
    return evaluation_output.parent / GATE_FAILED


def keep_gate_evidence(results: dict, evaluation_output: Path, plot: Path) -> Path:
    """A failed gate's evaluation, its plot and a report that says why it failed, in
    ``gate_evidence``; the folder."""
    folder = gate_evidence(evaluation_output)
    with atomic_path(folder) as tmp:
        tmp.mkdir()
        write_json(tmp / evaluation_output.name, results)
        shutil.copy2(plot, tmp / plot.name)
        trained, untrained = results["trained"], results["untrained"]
        lines = [
            "# The evaluation gate failed", "", gate_failure(results), "",
            "| drafter | mean acceptance length | accepted through position 1..K |", "| --- | --- | --- |",
            *(f"| {name} | {numbers['mean_acceptance_length']:.3f} | {shares_text(numbers['acceptance_per_position'])} |"
              for name, numbers in (("trained", trained), ("untrained", untrained))),
            "", "Every evaluation set at each K, offline (nothing was served: serve_check runs after the gate):", "",
            *sets_table(results, None), "",
            f"The plot: {plot.name}; the figures: {evaluation_output.name}, both here. A rerun that passes the gate removes this folder.",
        ]  # fmt: skip
        (tmp / "report.md").write_text("\n".join(lines) + "\n")
    return folder


def plot_acceptance(results: dict, output: Path) -> None:
    plt = pyplot()
    positions = range(1, results["draft_tokens"] + 1)
    figure, axis = plt.subplots(figsize=(6, 4))
    width = 0.38
    for offset, name in ((-width / 2, "untrained"), (width / 2, "trained")):
        values = [100 * v for v in results[name]["acceptance_per_position"]]
        label = f"{name} (mean acceptance length {results[name]['mean_acceptance_length']:.2f})"
        axis.bar([p + offset for p in positions], values, width, label=label)
    axis.set(
        xlabel="draft position k",
        ylabel="drafts accepted through position k (%)",
        title="Offline acceptance on held-out samples",
        xticks=list(positions),
        ylim=(0, 100),
    )
    axis.legend()
    save_png(figure, output)
