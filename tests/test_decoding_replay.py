"""The decoding replay on hand-made chains: it walks an answer as greedy decoding does, so
it parts from the every-position average where acceptance is uneven (issue 43)."""

import pytest
import torch

from draftflow.evaluate import accepted_lengths, replayed_lengths, summarize

PROMPT = [11, 12, 13]


def sample(answer: list[int]):
    """Token ids and loss mask of the prompt and ``answer``, whose tokens are the target's
    greedy choices; the target's choice after the answer is 0."""
    ids = torch.tensor(PROMPT + answer)
    mask = [0] * len(PROMPT) + [1] * len(answer)
    greedy = torch.tensor(PROMPT[1:] + answer + [0])  # greedy[j]: the target's choice for x[j+1]
    return ids, mask, greedy


def drafts_that_know(greedy: torch.Tensor, steps: int, wrong_starts: set[int]) -> torch.Tensor:
    """Drafts that propose the target's tokens, but for every chain at ``wrong_starts``."""
    columns = greedy.numel() - 1
    drafts = torch.full((steps, columns), -1)
    for j in range(columns):
        for k in range(steps):
            if j not in wrong_starts and j + 1 + k < greedy.numel():
                drafts[k, j] = greedy[j + 1 + k]
    return drafts


def test_a_perfect_drafter_accepts_k_per_step_until_max_tokens_or_the_answers_end():
    ids, mask, greedy = sample(list(range(1, 11)))  # 10 answer tokens
    drafts = drafts_that_know(greedy, 3, set())
    # prefill gives token 1; each step accepts 3 and emits 4: 5, 9, then the answer's end
    assert replayed_lengths(ids, mask, greedy, drafts, 64).tolist() == [3, 3, 2]
    assert replayed_lengths(ids, mask, greedy, drafts, 5).tolist() == [3]  # 1 + 4 = 5 generated


def test_the_replay_visits_only_the_starts_decoding_stands_on():
    ids, mask, greedy = sample(list(range(1, 13)))  # 12 answer tokens, at positions 3..14
    # the chains at starts 2, 7 and 12 miss: 2 of the 9 full chains of every start
    drafts = drafts_that_know(greedy, 3, {2, 7, 12})
    every_position = accepted_lengths(ids, torch.tensor(mask), greedy, drafts)
    assert summarize(every_position, 3)["mean_acceptance_length"] == pytest.approx(1 + 7 * 3 / 9)
    # decoding stands on every miss: one emits one token, then a full chain emits four and
    # lands on the next miss (starts 2, 3, 7, 8, 12, then the answer's last token)
    replay = replayed_lengths(ids, mask, greedy, drafts, 64)
    assert replay.tolist() == [0, 3, 0, 3, 0]
    assert summarize(replay, 3)["mean_acceptance_length"] == pytest.approx(2.2)


def test_drafts_are_checked_only_while_the_data_follows_the_targets_greedy_path():
    ids, mask, greedy = sample([1, 2, 3, 4, 5, 6])
    greedy[4] = 99  # the target would say 99 where the answer (sampled) says 3
    drafts = drafts_that_know(greedy, 3, set())
    # the first chain accepts 2 and 99, the target's; its third draft would follow 99, which
    # the data does not: no state of that path was extracted
    assert replayed_lengths(ids, mask, greedy, drafts, 64).tolist()[0] == 2
