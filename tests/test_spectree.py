import random
import math
from math import inf

import pytest
import torch

import sampling
import spectree
from sampling import Sampling
from speculate import SpecState

pytestmark = pytest.mark.usefixtures("single_thread")


# ---- EAGLE-2 expansion and rerank: a worked example in the spirit of the paper's Figure 7 ----
#
# Draft confidences over V = 6 tokens; k = 2, depth 3, m = 8. A node's value is the product of the
# confidences on its path (grow works with summed log-probs, the same order).
#   root -> 0: .6 (A)   1: .2 (B)   others .05      level 1 is A, B
#   A    -> 2: .5 (A2)  3: .3 (A3)  others .05      values A2 .30, A3 .18
#   B    -> 4: .8 (B4)  5: .1 (B5)  others .025     values B4 .16, B5 .02
# Level 2 expands the two best *values*, A2 and A3; B4 is the most confident child but loses.
#   A2   -> 5: .7       0: .2       others .025     values A2-5 .21, A2-0 .06
#   A3   -> 1: .4       4: .3       others .075     values A3-1 .072, A3-4 .054
# Rerank keeps the 8 best of the 10: all but A3-4 (.054) and B5 (.02). So the deep A2-5 (.21) outranks
# the shallow B (.2), and the unexpanded B4 (.16) outranks the expanded A3-4.
# The tree, in topological order (the root token 9 is never looked up):
#   node    0  1  2  3   4   5   6     7     8
#   is      r  A  B  A2  A3  B4  A2-5  A2-0  A3-1
#   token   9  0  1  2   3   4   5     0     1
#   parent  0  0  0  1   1   2   3     3     4
#   depth   0  1  1  2   2   2   3     3     3
FIG7_ROOT = [0.6, 0.2, 0.05, 0.05, 0.05, 0.05]
FIG7_ROWS = {  # (level, token) -> the draft's confidences for that node's children
    (1, 0): [0.05, 0.05, 0.5, 0.3, 0.05, 0.05],
    (1, 1): [0.025, 0.025, 0.025, 0.025, 0.8, 0.1],
    (2, 2): [0.2, 0.025, 0.025, 0.025, 0.025, 0.7],
    (2, 3): [0.075, 0.4, 0.075, 0.075, 0.3, 0.075],
}
FIG7_ANCESTORS = [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 2, 5}, {0, 1, 3, 6}, {0, 1, 3, 7}, {0, 1, 4, 8}]


def pool_paths(pool_tok, pool_parent):
    """The token path from the root to each pool entry."""
    paths = []
    for i in range(len(pool_tok)):
        path, j = [], i
        while j >= 0:
            path.append(pool_tok[j].item())
            j = pool_parent[j].item()
        paths.append(tuple(reversed(path)))
    return paths


def fig7_grow(calls):
    def step(level, tokens, parent):
        calls.append((level, tokens.tolist(), parent.tolist()))
        return torch.tensor([FIG7_ROWS[level, t] for t in tokens.tolist()]).log()

    return spectree.grow(torch.tensor(FIG7_ROOT).log(), step, k=2, depth=3, m=8)


def fig7_tree():
    sel, pool_tok, pool_parent, _ = fig7_grow([])
    return spectree.tree_from_pool(sel, pool_tok, pool_parent, torch.tensor(9))


def test_fig7_expands_the_top_k_nodes_by_value():
    calls = []
    fig7_grow(calls)
    # level 1: A, B (children of the root); level 2: A2, A3, both children of level-1 node 0 (A)
    assert calls == [(1, [0, 1], [0, 0]), (2, [2, 3], [0, 0])]


def test_fig7_rerank_keeps_the_m_best_values():
    sel, pool_tok, pool_parent, _ = fig7_grow([])
    paths = pool_paths(pool_tok, pool_parent)
    assert len(paths) == 10 and len(sel) == 8
    assert {paths[i] for i in range(10) if i not in sel.tolist()} == {(0, 3, 4), (1, 5)}  # A3-4, B5


def test_fig7_tree_tokens_and_parents():
    tokens, parents = fig7_tree()
    assert tokens.tolist() == [9, 0, 1, 2, 3, 4, 5, 0, 1]
    assert parents.tolist() == [0, 0, 0, 1, 1, 2, 3, 3, 4]


def test_fig7_mask_marks_exactly_the_ancestors_and_positions_are_depths():
    _, parents = fig7_tree()
    mask = spectree.ancestor_mask(parents, 3)
    expected = torch.tensor([[j in row for j in range(9)] for row in FIG7_ANCESTORS])
    assert torch.equal(mask, expected)
    assert (mask.sum(-1) - 1).tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3]


def test_rerank_breaks_ties_toward_the_shallower_node():
    # Pool: A (-1), B (-5), then A's child with log-prob exactly 0, so it ties with A.
    assert spectree.rerank(torch.tensor([-1.0, -5.0, -1.0]), 1).tolist() == [0]
    assert spectree.rerank(torch.tensor([-1.0, -5.0, -1.0]), 2).tolist() == [0, 2]


# ---- EAGLE-2 properties on random draft scores ----

def random_grow(rng: random.Random, g: torch.Generator, ties: bool):
    """grow with a fake draft whose log-probs are a fixed random function of the node's token path.
    Returns everything needed to check the result against slow references."""
    V = rng.randint(3, 10)
    k = rng.randint(1, min(V, 4))
    depth = rng.randint(1, 5)
    m = rng.randint(1, k + (depth - 1) * k * k)

    def logp():
        if ties:  # exact zeros and repeated values: children that score exactly their parent's value
            return -0.5 * torch.randint(0, 3, (V,), generator=g).float()
        return torch.log_softmax(2 * torch.randn(V, generator=g), -1)

    rows = {(): logp()}  # token path -> log-probs of that node's children
    expanded = {}  # level -> token paths of the nodes the draft was run on
    paths = [()]

    def step(level, tokens, parent):
        nonlocal paths
        paths = [paths[p] + (t,) for p, t in zip(parent.tolist(), tokens.tolist())]
        expanded[level] = paths
        for p in paths:
            rows.setdefault(p, logp())
        return torch.stack([rows[p] for p in paths])

    sel, pool_tok, pool_parent, pool_score = spectree.grow(rows[()], step, k, depth, m)
    return dict(k=k, depth=depth, m=m, rows=rows, expanded=expanded, sel=sel, pool_tok=pool_tok, pool_parent=pool_parent,
                pool_score=pool_score)


def path_value(rows, path):
    # float32, summed root-first like grow, so ties stay exact
    value = torch.tensor(0.0)
    for i in range(len(path)):
        value = value + rows[path[:i]][path[i]]
    return value.item()


def slow_ancestors(parents, i):
    out = {i}
    while i:
        i = parents[i]
        out.add(i)
    return out


def check_grown_tree(r):
    sel, pool_tok, pool_parent = r["sel"], r["pool_tok"], r["pool_parent"]
    s = sel.tolist()
    assert len(s) == r["m"] and s == sorted(set(s))
    closed = set(s) | {-1}
    assert all(pool_parent[i].item() in closed for i in s)

    tokens, parents = spectree.tree_from_pool(sel, pool_tok, pool_parent, torch.tensor(0))
    p = parents.tolist()
    assert p[0] == 0 and all(p[i] < i for i in range(1, len(p)))
    assert torch.equal(tokens[1:], pool_tok[sel])
    for i in range(1, len(p)):
        want = pool_parent[s[i - 1]].item()
        assert (p[i] == 0) if want < 0 else (s[p[i] - 1] == want)

    mask = spectree.ancestor_mask(parents, r["depth"])
    slow = torch.tensor([[j in slow_ancestors(p, i) for j in range(len(p))] for i in range(len(p))])
    assert torch.equal(mask, slow)
    paths = pool_paths(pool_tok, pool_parent)
    assert (mask.sum(-1) - 1).tolist() == [0] + [len(paths[i]) for i in s]


def check_values(r):
    paths = pool_paths(r["pool_tok"], r["pool_parent"])
    values = [path_value(r["rows"], p) for p in paths]
    assert r["pool_score"].tolist() == values
    s = set(r["sel"].tolist())
    assert min(values[i] for i in s) >= max((v for i, v in enumerate(values) if i not in s), default=-inf)
    for level, chosen in r["expanded"].items():
        at_level = [(values[i], paths[i]) for i in range(len(paths)) if len(paths[i]) == level]
        assert len(set(chosen)) == r["k"]
        assert min(v for v, p in at_level if p in chosen) >= max((v for v, p in at_level if p not in chosen), default=-inf)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied-and-zero-log-probs"])
def test_grow_on_random_scores_expands_and_keeps_the_best_values_in_closed_trees(ties):
    rng, g = random.Random(int(ties)), torch.Generator().manual_seed(int(ties))
    for _ in range(200):
        r = random_grow(rng, g, ties=ties)
        check_grown_tree(r)
        check_values(r)


# ---- sampling's tree: grow_coupled ----

def markov_grow(widths, V=12, seed=0, draft_error=0.0):
    """grow_coupled over a Markov chain target (log P[t] follows t) whose draft is the chain's log-probs plus
    draft_error noise; -> (tokens, parents, depths, scores, noise, log P) with the root at node 0 (token 0)."""
    g = torch.Generator().manual_seed(seed)
    logP = torch.log_softmax(torch.randn(V, V, generator=g) * 2, -1)
    logQ = torch.log_softmax(logP + draft_error * torch.randn(V, V, generator=g), -1)
    noise = -torch.log(-torch.log(torch.rand(len(widths) + 1, V, generator=g)))
    tok, par, score = spectree.grow_coupled(logQ[0], lambda level, t, parent: logQ[t], widths, noise)
    tokens, parents = torch.cat([torch.zeros(1, dtype=torch.long), tok]), torch.cat([torch.zeros(1, dtype=torch.long), par])
    depths = spectree.ancestor_mask(parents, len(widths)).sum(-1) - 1
    return tokens, parents, depths, torch.cat([torch.zeros(1), score]), noise, logP


@pytest.mark.parametrize("widths", [(4,), (3, 2), (2, 5, 1), (1, 1, 1, 1)])
def test_coupled_tree_has_its_widths_and_keeps_the_best_children_of_each_level(widths):
    for seed in range(20):
        tokens, parents, depths, scores, noise, _ = markov_grow(widths, seed=seed, draft_error=1.0)
        assert [int((depths == d).sum()) for d in range(1, len(widths) + 1)] == list(widths)
        assert bool((depths[1:] == depths[parents[1:]] + 1).all()) and bool((depths[1:-1] <= depths[2:]).all())
        for d in range(1, len(widths) + 1):  # no sibling set holds a token twice, and no child outscores its parent
            at = (depths == d).nonzero().flatten()
            pairs = {(int(parents[i]), int(tokens[i])) for i in at}
            assert len(pairs) == len(at) and bool((scores[at] <= scores[parents[at]] + 1e-6).all())


def test_a_coupled_draft_equal_to_the_target_foresees_its_samples():
    # The target's draw at a depth-d node is argmax(log p + noise[d]); a draft with q = p ranks that very token first, so
    # every cycle accepts the whole depth. Noise one level off (or none) would leave this to chance.
    widths = (3, 2, 2, 1)
    for seed in range(30):
        tokens, parents, depths, _, noise, logP = markov_grow(widths, seed=seed)
        draws = sampling.draw(logP[tokens], "sample", noise=noise[depths])
        accept_len, _, _ = spectree.accept(tokens, parents, depths, draws, len(widths))
        assert accept_len == len(widths)


def rule(samp: Sampling, key: int = 0) -> SpecState:
    """A sequence's rule and key as a step reads them."""
    st = SpecState(None, 1, "cpu")
    st.set_rule(samp, key)
    return st


def test_coupled_draws_sample_the_distribution(chi2_pvalue):
    # one sequence's draws at 40000 positions: the keyed Gumbels times T, over top-p's kept tokens
    samp = Sampling(0.8, top_p=0.95)
    st = rule(samp, sampling.key_of(0))
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0, -inf, 1.0])
    draws = sampling.draw(logits.expand(40000, -1), samp.kind, st, sampling.noise(st, torch.tensor(0), 40000, 6))
    assert chi2_pvalue(torch.bincount(draws, minlength=6), samp.probs(logits)) > 1e-3


def test_level_widths_are_the_prior_trees_levels():
    assert spectree.level_widths(1, 6, 10) == (1,)
    for m, depth, k in [(8, 2, 10), (16, 3, 4), (60, 6, 10)]:
        widths = spectree.level_widths(m, depth, k)
        assert sum(widths) == m and len(widths) <= depth and widths[0] <= k
        assert all(w <= k * before for before, w in zip(widths, widths[1:]))


# ---- EAGLE-1 static tree ----

def test_static_tree_matches_the_published_paths():
    parents, depths, ranks = spectree.static_tree()
    assert len(parents) == 26 and (depths == 1).sum() == 4 and depths.max() == 5
    paths = [()]
    for i in range(1, 26):
        assert parents[i] < i
        paths.append(paths[parents[i]] + (ranks[i].item(),))
    assert set(paths[1:]) == {tuple(p) for p in spectree.EAGLE1_TREE}
    assert paths[1:] == sorted(paths[1:], key=lambda p: (len(p), p))
    assert depths.tolist() == [len(p) for p in paths]
    assert torch.equal(spectree.ancestor_mask(parents, 5).sum(-1) - 1, depths)


# ---- verification ----

# root(9) -> 1:3 -> 3:4 -> 6:8
#         |       -> 4:6
#         -> 2:5 -> 5:7
ACC_TOKENS = torch.tensor([9, 3, 5, 4, 6, 7, 8])
ACC_PARENTS = torch.tensor([0, 0, 0, 1, 1, 2, 3])
ACC_DEPTHS = torch.tensor([0, 1, 1, 2, 2, 2, 3])


def run_accept(draws):
    accept_len, path, bonus = spectree.accept(ACC_TOKENS, ACC_PARENTS, ACC_DEPTHS, torch.tensor(draws), 3)
    return accept_len.item(), path.tolist(), bonus.item()


def test_accept_follows_matching_draws_to_a_leaf():
    assert run_accept([3, 4, 0, 8, 0, 0, 2]) == (3, [0, 1, 3, 6], 2)


def test_accept_stops_at_the_first_miss_and_takes_the_bonus_there():
    assert run_accept([5, 0, 1, 0, 0, 0, 0]) == (1, [0, 2, 2, 2], 1)
    assert run_accept([0, 4, 7, 8, 0, 0, 0]) == (0, [0, 0, 0, 0], 0)


def test_accept_ignores_matches_below_a_rejected_parent():
    # node 3 (token 4) matches node 1's draw and node 6 (token 8) matches node 3's, but node 1 lost
    assert run_accept([5, 4, 2, 8, 0, 0, 0]) == (1, [0, 2, 2, 2], 2)


def test_accepted_nodes_are_the_matched_path_from_the_root():
    draws = torch.tensor([5, 4, 2, 8, 0, 0, 0])  # nodes 3 and 6 match their parents' draws, under the rejected node 1
    assert spectree.accepted_nodes(ACC_TOKENS, ACC_PARENTS, draws, 3).tolist() == [True, False, True, False, False, False, False]
    draws = torch.tensor([3, 4, 0, 8, 0, 0, 2])
    assert spectree.accepted_nodes(ACC_TOKENS, ACC_PARENTS, draws, 3).tolist() == [True, True, False, True, False, False, True]


def test_accept_with_greedy_draws_takes_the_argmax_path():
    logits = torch.full((7, 10), -1.0)
    for node, tok in enumerate([3, 6, 7, 1, 0, 0, 0]):
        logits[node, tok] = 1.0
    accept_len, path, bonus = spectree.accept(ACC_TOKENS, ACC_PARENTS, ACC_DEPTHS, sampling.draw(logits, "greedy"), 3)
    assert (accept_len.item(), path.tolist(), bonus.item()) == (2, [0, 1, 4, 4], 0)


def test_accept_chain_keeps_tokens_the_target_agrees_with():
    one_hot = torch.eye(6)
    draft = torch.tensor([1, 2, 3])
    p = one_hot[[1, 2, 3, 5]]  # target agrees on every draft token, then wants 5
    accept_len, bonus = spectree.accept_chain(draft, p, one_hot[draft])
    assert (accept_len.item(), bonus.item()) == (3, 5)


def test_accept_chain_rejects_a_token_the_target_never_picks():
    one_hot = torch.eye(6)
    draft = torch.tensor([1, 2, 3])
    p = one_hot[[4, 2, 3, 5]]
    accept_len, bonus = spectree.accept_chain(draft, p, one_hot[draft])
    assert (accept_len.item(), bonus.item()) == (0, 4)


# ---- the sampling rule ----

def test_top_k_keeps_exactly_k_tokens_in_softmax_proportion():
    logits = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.9, -0.2, 1.1])
    probs = sampling.logits_to_probs(logits, 1.0, top_k=3)
    assert (probs > 0).nonzero().flatten().tolist() == [1, 3, 6]
    assert torch.allclose(probs[[1, 3, 6]], torch.softmax(logits[[1, 3, 6]], -1))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.15, 0.5, 0.1, 0.25])
    kept = lambda top_p: (sampling.logits_to_probs(probs.log(), 1.0, top_p=top_p) > 0).nonzero().flatten().tolist()
    assert kept(0.4) == [1]
    assert kept(0.7) == [1, 3]
    assert kept(0.8) == [0, 1, 3]
    assert kept(0.95) == [0, 1, 2, 3]
    assert torch.allclose(sampling.logits_to_probs(probs.log(), 1.0, top_p=0.7), torch.tensor([0, 2 / 3, 0, 1 / 3]))


def test_temperature_divides_the_logits():
    logits = torch.tensor([1.0, 0.0, -2.0])
    expected = torch.exp(logits / 0.5) / torch.exp(logits / 0.5).sum()
    assert torch.allclose(sampling.logits_to_probs(logits, 0.5), expected)
    assert torch.allclose(sampling.logits_to_probs(logits, 1.0), torch.softmax(logits, -1))


def test_draw_at_temperature_zero_is_the_argmax():
    # greedy's own kind, and a rule at T = 0 in a step built for sampling (a greedy row of a sampled batch: noise 0)
    logits = torch.randn(50, 9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampling.draw(logits, "greedy"), logits.argmax(-1))
    st = rule(Sampling(0.0, top_k=2), sampling.key_of(1))
    noise = sampling.noise(st, torch.tensor(7), 50, 9)
    assert not noise.any()
    for kind in ("sample", "truncate"):
        assert torch.equal(sampling.draw(logits, kind, st, noise), logits.argmax(-1))


def test_sample_matches_its_distribution(chi2_pvalue):
    torch.manual_seed(0)
    p = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.0, 0.5])
    draws = sampling.sample(p.expand(20000, -1))
    assert chi2_pvalue(torch.bincount(draws, minlength=6), p) > 1e-3


def test_chi2_pvalue_has_the_closed_form_for_two_degrees_of_freedom(chi2_pvalue):
    # three cells, df = 2: P(chi2 > x) = exp(-x / 2)
    counts, probs = torch.tensor([30.0, 50.0, 20.0]), torch.tensor([0.25, 0.5, 0.25])
    stat = (30 - 25) ** 2 / 25 + 0 + (20 - 25) ** 2 / 25
    assert chi2_pvalue(counts, probs) == pytest.approx(torch.exp(torch.tensor(-stat / 2)).item(), rel=1e-6)


# ---- losslessness at unit level ----
#
# A fixed top-k tree over V = 5 with a target distribution per node. The first two committed tokens
# must be distributed as P0(t1) P1(t2 | t1): when a cycle commits only t1, t2 is the next cycle's first
# token, a draw from P1[t1].
V = 5
LL_TOKENS = torch.tensor([3, 0, 1, 2, 3, 0, 4])  # root -> {0 -> {2 -> 4, 3}, 1 -> 0}
LL_PARENTS = torch.tensor([0, 0, 0, 1, 1, 2, 3])
LL_DEPTHS = torch.tensor([0, 1, 1, 2, 2, 2, 3])
SAMPLES = 20000


def toy_target():
    g = torch.Generator().manual_seed(0)
    p0 = torch.tensor([0.3, 0.2, 0.1, 0.25, 0.15])  # the root's children {0, 1} hold half the mass
    p1 = torch.softmax(torch.randn(V, V, generator=g), -1)  # row t: after first token t
    deeper = torch.softmax(torch.randn(4, V, generator=g), -1)
    return p0, p1, torch.cat([p0[None], p1[[0, 1]], deeper])  # per node, in node order


def first_two_tokens(accept_fn):
    torch.manual_seed(0)
    p0, p1, node_probs = toy_target()
    draws = sampling.sample(node_probs.expand(SAMPLES, -1, -1))
    batched = torch.vmap(accept_fn, in_dims=(None, None, None, 0, None), randomness="different")
    accept_len, path, bonus = batched(LL_TOKENS, LL_PARENTS, LL_DEPTHS, draws, 3)
    t1 = torch.where(accept_len >= 1, LL_TOKENS[path[:, 1]], bonus)
    next_cycle = sampling.sample(p1[t1])
    t2 = torch.where(accept_len >= 2, LL_TOKENS[path[:, 2]], torch.where(accept_len == 1, bonus, next_cycle))
    return torch.bincount(t1 * V + t2, minlength=V * V), (p0[:, None] * p1).flatten()


def fresh_bonus_accept(tokens, parents, depths, draws, depth):
    """Broken: the bonus is a new draw at the deepest accepted node instead of the draw that missed."""
    accept_len, path, _ = spectree.accept(tokens, parents, depths, draws, depth)
    return accept_len, path, sampling.sample(toy_target()[2][path[-1]])


def test_tree_accept_commits_the_target_distribution(chi2_pvalue):
    counts, expected = first_two_tokens(spectree.accept)
    assert chi2_pvalue(counts, expected) > 1e-3


def test_tree_accept_test_rejects_a_fresh_bonus_draw(chi2_pvalue):
    counts, expected = first_two_tokens(fresh_bonus_accept)
    assert chi2_pvalue(counts, expected) < 1e-3


def chain_case():
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(1.5 * torch.randn(4, 6, generator=g), -1)
    q = torch.softmax(1.5 * torch.randn(3, 6, generator=g), -1)
    return p, q


def first_chain_token(accept_fn):
    torch.manual_seed(0)
    p, q = chain_case()
    drafts = sampling.sample(q.expand(SAMPLES, -1, -1))
    accept_len, bonus = torch.vmap(accept_fn, in_dims=(0, None, None), randomness="different")(drafts, p, q)
    first = torch.where(accept_len >= 1, drafts[:, 0], bonus)
    return torch.bincount(first, minlength=6), p[0]


def test_accept_chain_commits_the_target_distribution(chi2_pvalue):
    counts, expected = first_chain_token(spectree.accept_chain)
    assert chi2_pvalue(counts, expected) > 1e-3


def test_accept_chain_test_rejects_a_replacement_drawn_from_p(chi2_pvalue, accept_chain_replacing_from_p):
    counts, expected = first_chain_token(accept_chain_replacing_from_p)
    assert chi2_pvalue(counts, expected) < 1e-3


# ---- fuzz: grow + accept on thousands of random trees, extremes included ----

def extreme_logp(g: torch.Generator, V: int, kind: int) -> torch.Tensor:
    """0: ordinary; 1: all equal; 2: some -inf (tokens the draft rules out); 3: huge finite gaps; 4: one certain token."""
    if kind == 1:
        return torch.full((V,), -math.log(V))
    if kind == 2:
        x = torch.log_softmax(torch.randn(V, generator=g), -1)
        return x.masked_fill(torch.rand(V, generator=g) < 0.5, -inf).clamp(max=0).nan_to_num(nan=-inf)
    if kind == 3:
        return -1e30 * torch.randint(0, 3, (V,), generator=g).float()
    if kind == 4:
        return torch.full((V,), -inf).index_fill(0, torch.randint(0, V, (1,), generator=g), 0.0)
    return torch.log_softmax(3 * torch.randn(V, generator=g), -1)


def slow_accept(tokens, parents, draws):
    """The accepted path by walking the tree from the root: the child whose token is the draw at its parent."""
    path, node = [0], 0
    while True:
        children = [c for c in range(1, len(parents)) if parents[c] == node and tokens[c] == draws[node]]
        assert len(children) <= 1  # siblings of a top-k tree hold distinct tokens
        if not children:
            return path
        node = children[0]
        path.append(node)


def test_fuzz_grow_and_accept_never_crash_stay_closed_and_accept_matching_paths():
    rng, g = random.Random(7), torch.Generator().manual_seed(7)
    for trial in range(3000):
        V = rng.randint(2, 12)
        k = rng.randint(1, min(V, 4))
        depth = rng.randint(1, 5)
        pool = k + (depth - 1) * k * k
        m = pool if trial % 3 == 0 else rng.randint(1, pool)  # m at its maximum for the depth and k, often
        kind = rng.randint(0, 4)
        rows = {}

        def step(level, tokens, parent):
            return torch.stack([rows.setdefault((level, i), extreme_logp(g, V, kind)) for i in range(len(tokens))])

        sel, pool_tok, pool_parent, pool_score = spectree.grow(extreme_logp(g, V, kind), step, k, depth, m)
        assert len(sel) == m and not pool_score.isnan().any()
        s = sel.tolist()
        assert s == sorted(set(s)) and all(pool_parent[i].item() in set(s) | {-1} for i in s)  # ancestor-closed
        tokens, parents = spectree.tree_from_pool(sel, pool_tok, pool_parent, torch.tensor(0))
        anc = spectree.ancestor_mask(parents, depth)
        depths = anc.sum(-1) - 1
        p = parents.tolist()
        assert all(p[i] < i for i in range(1, len(p))) and depths.max() <= depth
        # draws: mostly a child's token, so paths go deep; sometimes any token
        child_of = {}
        for c in range(1, len(p)):
            child_of.setdefault(p[c], []).append(c)
        draws = torch.tensor([tokens[rng.choice(child_of[i])].item() if i in child_of and rng.random() < 0.8 else rng.randrange(V)
                              for i in range(len(p))])
        accept_len, path, bonus = spectree.accept(tokens, parents, depths, draws, depth)
        want = slow_accept(tokens.tolist(), p, draws.tolist())
        a = accept_len.item()
        assert a == len(want) - 1
        assert path.tolist() == want + [want[-1]] * (depth - a)
        assert bonus.item() == draws[want[-1]].item()
        assert all(tokens[n].item() == draws[p[n]].item() for n in want[1:])


def test_lookup_slots_hold_the_drafts_next_nodes_when_the_chain_adds_nothing():
    # root -> a(5) -> b(7); root -> c(6); the draft's next best: d(8) under c, e(9) under a.
    tokens, parents = torch.tensor([0, 5, 6, 7]), torch.tensor([0, 0, 0, 1])
    spare = torch.tensor([0, 5, 6, 7, 9, 8]), torch.tensor([0, 0, 0, 1, 1, 2])
    for chain, found in ((torch.tensor([3, 4]), torch.tensor(False)), (torch.tensor([5, 7]), torch.tensor(True))):
        t, p, live = spectree.graft_chain(tokens, parents, chain, found, spare)
        assert t.tolist() == spare[0].tolist() and p.tolist() == spare[1].tolist() and live.all()  # no slot left dead
    # A chain with a live slot keeps its graft: 5 is followed, 4 grows under a.
    t, p, live = spectree.graft_chain(tokens, parents, torch.tensor([5, 4]), torch.tensor(True), spare)
    assert t.tolist() == [0, 5, 6, 7, 5, 4] and p.tolist() == [0, 0, 0, 1, 0, 1] and live.tolist() == [True] * 4 + [False, True]


def test_graft_chain_follows_the_tree_and_never_doubles_a_sibling():
    # root -> a(5) -> b(7); root -> c(6). The chain 5 7 9 4 follows a and b, then grows 9 -> 4 under b.
    tokens, parents = torch.tensor([0, 5, 6, 7]), torch.tensor([0, 0, 0, 1])
    t, p, live = spectree.graft_chain(tokens, parents, torch.tensor([5, 7, 9, 4]), torch.tensor(True))
    assert t.tolist() == [0, 5, 6, 7, 5, 7, 9, 4] and p.tolist() == [0, 0, 0, 1, 0, 1, 3, 6]
    assert live.tolist() == [True] * 4 + [False, False, True, True]
    depths = spectree.ancestor_mask(p, 4).sum(-1) - 1
    assert depths[4:].tolist() == [1, 2, 3, 4]  # chain token i sits at depth i+1 whatever it follows
    for node in range(len(t)):  # live siblings never share a token
        sib = [int(t[j]) for j in range(1, len(t)) if live[j] and p[j] == p[node] and j != node]
        assert not live[node] or node == 0 or int(t[node]) not in sib
    _, _, dead = spectree.graft_chain(tokens, parents, torch.tensor([5, 7, 9, 4]), torch.tensor(False))
    assert dead.tolist() == [True] * 4 + [False] * 4  # no match: the slots are there (fixed shape) but dead
    # A chain leaving the tree at once: all four slots live, a path under the root.
    t, p, live = spectree.graft_chain(tokens, parents, torch.tensor([8, 5, 7, 1]), torch.tensor(True))
    assert p.tolist()[4:] == [0, 4, 5, 6] and live[4:].all()
