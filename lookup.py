# Prompt lookup drafting: the draft is what followed the last time the text's most recent n-gram
# appeared, in the prompt or in the output so far (Saxena's prompt lookup decoding, as in HF transformers).
# No draft model at all, so drafts cost nothing: it pays off when answers quote, summarise or repeat.
# Pure tensor code, fixed shapes, no host syncs: the match runs inside the compiled cycle.
import torch
from torch import Tensor


def ngram_draft(history: Tensor, n_known: Tensor, k: int, max_ngram: int = 3, min_ngram: int = 2):
    """k draft tokens continuing the longest (min_ngram to max_ngram), then most recent, earlier occurrence of
    the text's last n tokens, and whether there was one. history [S]: the tokens so far at [0, n_known),
    anything after; n_known 0-d. A single shared token predicts little, so matches start at 2-grams;
    without a match the draft repeats the last token (any draft is lossless, it is just rejected)."""
    S = history.shape[0]
    idx = torch.arange(S, device=history.device)
    start = torch.full((), -1, dtype=torch.long, device=history.device)  # where the continuation begins
    for n in range(min_ngram, max_ngram + 1):  # a longer match overrides a shorter one
        suffix = history[(n_known - n + idx[:n]).clamp(min=0)]
        after = idx[: S - n + 1] + n  # the token after each window
        # after < n_known: the continuation's first token is known, and the suffix does not match itself
        hit = (history.unfold(0, n, 1) == suffix).all(-1) & (after < n_known) & (n_known >= n)
        best = torch.where(hit, after, -1).max()
        start = torch.where(best >= 0, best, start)
    # A continuation that runs into the present repeats itself: the text from start on is periodic so far
    # (a loop, which small models fall into), so the draft keeps the period instead of reading past the end.
    period = (n_known - start).clamp(min=1)
    pos = torch.where(start >= 0, start + idx[:k] % period, n_known - 1)
    return history[pos.clamp(0, S - 1)], start >= 0
