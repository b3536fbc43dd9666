import math

import pytest
import torch

from bench import calibration
from eaglet import Generator
from sampling import Sampling
from speculate import TreeSpec

# root(9) -> 1:3 (0.93, accepted) -> 3:4 (0.55, rejected) -> 6:8 (0.35, untested)
#                                  -> 4:6 (0.42, accepted)
#         -> 2:5 (0.07, rejected)  -> 5:7 (0.99, untested)
TOKENS = torch.tensor([9, 3, 5, 4, 6, 7, 8])
PARENTS = torch.tensor([0, 0, 0, 1, 1, 2, 3])
CONFIDENCES = [1.0, 0.93, 0.07, 0.55, 0.42, 0.99, 0.35]
DRAWS = torch.tensor([3, 6, 0, 8, 0, 0, 0])  # node 6 matches node 3's draw, but node 3 was rejected


def record_scores():
    """Summed log-probs along each node's path, as draft_dynamic returns them."""
    scores = [0.0]
    for i in range(1, len(CONFIDENCES)):
        scores.append(scores[PARENTS[i]] + math.log(CONFIDENCES[i]))
    return torch.tensor(scores)


def test_counts_only_tested_nodes_in_their_confidence_bins():
    calib = calibration.Calibration(bins=10, depth=3)
    calib("draft")
    calib("accept", tokens=TOKENS, parents=PARENTS, draws=DRAWS, scores=record_scores())
    report = calib.report()
    assert report["tested"] == [1, 0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert report["accepted"] == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert report["acceptance_rate"] == [0.0, None, None, None, 1.0, 0.0, None, None, None, 1.0]
    assert report["mean_confidence"] == [0.07, None, None, None, 0.42, 0.55, None, None, None, 0.93]
    assert report["overall"] == {"tested": 4, "accepted": 2, "acceptance_rate": 0.5, "mean_confidence": 0.4925,
                                 "calibration_error": round((0.07 + 0.58 + 0.55 + 0.07) / 4, 4)}
    assert report["bin_edges"][:3] == [0.0, 0.1, 0.2] and report["bin_edges"][-1] == 1.0


def test_hook_leaves_greedy_output_unchanged_and_counts_every_accepted_draft(single_thread, tiny_args, random_model, random_head):
    args = tiny_args()
    target, head = random_model(args, seed=0), random_head(args, seed=1)
    gen = Generator(target, TreeSpec("eagle2", 6, 10, 16), head=head)
    prompts = [torch.randint(0, args.vocab_size, (10,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
    calib = calibration.Calibration(bins=20, depth=6)
    hooked = [gen.generate(p, 40, Sampling(), lap=calib) for p in prompts]
    assert [r.token_ids for r in hooked] == [gen.generate(p, 40, Sampling()).token_ids for p in prompts]
    assert calib.accepted.sum() == sum(a * n for r in hooked for a, n in enumerate(r.accept_hist)) > 0
    assert calib.tested.sum() > calib.accepted.sum()


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    calib = calibration.Calibration(bins=20, depth=3)
    calib("accept", tokens=TOKENS, parents=PARENTS, draws=DRAWS, scores=record_scores())
    calibration.plot(calib.report(), tmp_path / "calibration.png", "test")
    assert (tmp_path / "calibration.png").read_bytes()[:4] == b"\x89PNG"
