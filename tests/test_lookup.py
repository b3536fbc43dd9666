# Prompt lookup drafting: the continuation of the longest, then latest, earlier n-gram match.
import torch

import lookup


def draft(tokens, k=3, pad=4, max_ngram=3, found=True):
    history = torch.tensor(tokens + [99] * pad)  # slots past the known tokens hold garbage
    drafts, hit = lookup.ngram_draft(history, torch.tensor(len(tokens)), k, max_ngram)
    assert bool(hit) == found
    return drafts.tolist()


def test_continues_the_latest_match_of_the_longest_ngram():
    # "1 2 3" appeared twice: the latest occurrence's continuation wins over the earlier one
    assert draft([1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1]
    assert draft([1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 1, 2, 3], k=5) == [7, 8, 1, 2, 3]
    # the 3-gram "5 1 2" matches once, the shorter "1 2" matches later: the longer match wins
    assert draft([5, 1, 2, 6, 6, 1, 2, 9, 0, 5, 1, 2]) == [6, 6, 1]


def test_a_continuation_that_reaches_the_present_keeps_its_period():
    assert draft([7, 7, 7, 7]) == [7, 7, 7]
    assert draft([1, 2, 1, 2, 1], k=5) == [2, 1, 2, 1, 2]
    assert draft([4, 5, 6, 1, 2, 3, 1, 2, 3, 1, 2], k=5) == [3, 1, 2, 3, 1]


def test_without_a_match_the_draft_repeats_the_last_token():
    assert draft([1, 2, 3, 4], found=False) == [4, 4, 4]
    assert draft([5], found=False) == [5, 5, 5]
    assert draft([3, 1, 2, 3], found=False) == [3, 3, 3]  # a shared single token is no match


def test_the_suffix_never_matches_itself():
    assert draft([1, 2, 3, 4], max_ngram=2, found=False) == [4, 4, 4]
