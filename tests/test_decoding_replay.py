"""The decoding replay and acceptance at a temperature on hand-made chains: the replay walks
an answer as decoding does, so it parts from the every-position average where acceptance is
uneven (issue 43); at T > 0 a greedy draft is accepted with the target's probability of it,
and answers sampled at T are draws of serving there (issue 49)."""

import pytest
import torch

from draftflow import evaluate
from draftflow.evaluate import (
    GREEDY,
    acceptance_probability,
    assistant_starts,
    chain_reach,
    on_data,
    reach_of,
    replayed_lengths,
    sampled_reach,
    summarize,
    tensor_logits,
    verifying_positions,
)

PROMPT = [11, 12, 13]
VOCAB = 128


def sample(answer: list[int]):
    """Token ids, loss mask and target logits of the prompt and ``answer``, whose tokens are the
    target's greedy choices (logit 10 against 0); the target's choice after the answer is 0."""
    ids = torch.tensor(PROMPT + answer)
    mask = [0] * len(PROMPT) + [1] * len(answer)
    greedy = torch.tensor(PROMPT[1:] + answer + [0])  # greedy[j]: the target's choice for x[j+1]
    return ids, mask, 10 * torch.nn.functional.one_hot(greedy, VOCAB).float()


def drafts_that_know(logits: torch.Tensor, steps: int, wrong_starts: set[int]) -> torch.Tensor:
    """Drafts that propose the target's greedy tokens, but for every chain at ``wrong_starts``."""
    greedy = logits.argmax(-1)
    columns = greedy.numel() - 1
    drafts = torch.full((steps, columns), -1)
    for j in range(columns):
        for k in range(steps):
            if j not in wrong_starts and j + 1 + k < greedy.numel():
                drafts[k, j] = greedy[j + 1 + k]
    return drafts


def greedy_lengths(ids, logits, drafts) -> torch.Tensor:
    return chain_reach(acceptance_probability(tensor_logits(logits), len(logits), drafts, GREEDY), on_data(ids, drafts)).sum(0).long()


def test_a_perfect_drafter_accepts_k_per_step_until_max_tokens_or_the_answers_end():
    ids, mask, logits = sample(list(range(1, 11)))  # 10 answer tokens
    lengths = greedy_lengths(ids, logits, drafts_that_know(logits, 3, set()))
    # prefill gives token 1; each step accepts 3 and emits 4: 5, 9, then the answer's end
    assert replayed_lengths(lengths, mask, 64).tolist() == [3, 3, 2]
    assert replayed_lengths(lengths, mask, 5).tolist() == [3]  # 1 + 4 = 5 generated


def test_the_replay_visits_only_the_starts_decoding_stands_on():
    ids, mask, logits = sample(list(range(1, 13)))  # 12 answer tokens, at positions 3..14
    # the chains at starts 2, 7 and 12 miss: 2 of the 9 full chains of every start
    drafts = drafts_that_know(logits, 3, {2, 7, 12})
    reach = chain_reach(acceptance_probability(tensor_logits(logits), len(logits), drafts, GREEDY), on_data(ids, drafts))
    assert summarize(reach[:, assistant_starts(mask, 3)])["mean_acceptance_length"] == pytest.approx(1 + 7 * 3 / 9)
    # decoding stands on every miss: one emits one token, then a full chain emits four and
    # lands on the next miss (starts 2, 3, 7, 8, 12, then the answer's last token)
    replay = replayed_lengths(reach.sum(0).long(), mask, 64)
    assert replay.tolist() == [0, 3, 0, 3, 0]
    assert summarize(reach_of(replay, 3))["mean_acceptance_length"] == pytest.approx(2.2)


def test_drafts_are_checked_only_while_the_data_follows_the_targets_greedy_path():
    ids, mask, logits = sample([1, 2, 3, 4, 5, 6])
    logits[4] = 10 * torch.nn.functional.one_hot(torch.tensor(99), VOCAB)  # the target says 99 where the answer (sampled) says 3
    drafts = drafts_that_know(logits, 3, set())
    # the first chain accepts 2 and 99, the target's; its third draft would follow 99, which
    # the data does not: no state of that path was extracted
    assert replayed_lengths(greedy_lengths(ids, logits, drafts), mask, 64).tolist()[0] == 2


def test_at_a_temperature_a_draft_is_accepted_with_the_targets_probability_of_it():
    ids, mask, logits = sample([1, 2, 3, 4, 5, 6])
    logits[3:6, 50] = 10 - torch.log(torch.tensor(3.0))  # a rival a third as likely as the greedy token, at T = 1
    drafts = drafts_that_know(logits, 2, set())
    at_one = acceptance_probability(tensor_logits(logits), len(logits), drafts, {"temperature": 1.0})
    greedy_share = 1 / (1 + 1 / 3 + (VOCAB - 2) * torch.exp(torch.tensor(-10.0)))
    assert at_one[0, 2] == pytest.approx(float(greedy_share), rel=1e-4)  # verified at position 3
    no_rival = 1 / (1 + (VOCAB - 1) * torch.exp(torch.tensor(-10.0)))
    assert at_one[0, 6] == pytest.approx(float(no_rival), rel=1e-4)  # verified at position 7
    # the chain at start 2 reaches its second draft only through the first: p3 * p4
    reach = chain_reach(at_one, on_data(ids, drafts))
    assert reach[1, 2] == pytest.approx(float(greedy_share) ** 2, rel=1e-4)
    # top_k 1 (vLLM's cut) leaves the greedy token alone: accepted for sure, as at T = 0
    assert acceptance_probability(tensor_logits(logits), len(logits), drafts, {"temperature": 1.0, "top_k": 1})[0, 2] == pytest.approx(1.0)
    assert torch.equal(acceptance_probability(tensor_logits(logits), len(logits), drafts, GREEDY), (drafts >= 0).float() * (at_one > 0.5))


def test_answers_sampled_at_the_temperature_are_one_draw_of_serving():
    ids, mask, logits = sample([1, 2, 3, 4, 5, 6])
    drafts = drafts_that_know(logits, 3, set())
    drafts[1, 2] = 77  # the chain at start 2 proposes 77 where the answer drew 2: rejected there
    lengths = sampled_reach(on_data(ids, drafts)).sum(0).long()
    assert lengths[2] == 1 and lengths[3] == 3
    # whatever the target's probabilities: only what was drawn counts
    assert replayed_lengths(lengths, mask, 64).tolist() == [1, 3]


@pytest.mark.parametrize("sampling", [GREEDY, {"temperature": 0.7}, {"temperature": 1.0, "top_k": 5},
                                      {"temperature": 0.8, "top_p": 0.9}, {"temperature": 1.0, "top_k": 20, "top_p": 0.95}])  # fmt: skip
def test_the_targets_logits_taken_a_chunk_of_positions_at_a_time_weigh_drafts_as_the_whole_at_once(monkeypatch, sampling):
    """Random logits and drafts over 37 positions: chunks of 8 (the last one short) give each
    draft the probability a softmax of the whole [positions, vocabulary] cut by vLLM's own
    apply_top_k_top_p gives it (what evaluation computed before it went chunk by chunk)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(37, VOCAB, generator=generator) * 3
    drafts = torch.randint(0, VOCAB, (3, 36), generator=generator)
    drafts[:, ::5] = logits.argmax(-1)[verifying_positions(drafts).clamp(max=36)][:, ::5]  # some greedy drafts
    monkeypatch.setattr(evaluate, "POSITION_CHUNK", 8)
    chunked = acceptance_probability(tensor_logits(logits), len(logits), drafts, sampling)
    positions = verifying_positions(drafts)
    inside = positions < len(logits)
    if sampling["temperature"] == 0:
        whole = (drafts == logits.argmax(-1)[positions.clamp(max=36)]).float() * inside
    else:
        rows = len(logits)
        top_k, top_p = sampling.get("top_k"), sampling.get("top_p")
        cut = apply_top_k_top_p(logits / sampling["temperature"], torch.full((rows,), top_k) if top_k else None,
                                torch.full((rows,), top_p) if top_p else None)  # fmt: skip
        whole = cut.softmax(-1)[positions.clamp(max=36), drafts] * inside
    assert inside.sum() < inside.numel() and whole.sum() > 0
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-7)
