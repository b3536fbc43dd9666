# Draft trees and their verification as pure tensor functions: tensors in, tensors out, fixed shapes,
# no host syncs, nothing about models. A tree of n nodes is (tokens [n], parents [n], depths [n]) in
# topological order, node 0 the root (its own parent, depth 0).
# (Not named tree.py: Dynamo skips modules named like the PyPI package "tree", and compiled cycles call these.)
import functools
import heapq

import torch
from torch import Tensor

import ops
from sampling import sample, uniform

# The EAGLE-1 static tree ("mc_sim_7b_63"): 25 draft nodes as paths of top-k ranks, 5 levels deep.
EAGLE1_TREE = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]  # fmt: skip


# ---- the value of a tree under a static prior (sizing's model, and the widths of sampling's trees) ----

# (a, ratio): the target's next token is the draft's rank-r guess with probability a ratio^r. Greedy: fitted to
# the shipped head's tau at four trees (tests/test_sizing.py). Sampling (coupled drafts, grow_coupled): head 12 at
# T=1 on 40 MT-bench turns, 4 nodes a level took 0.66 of the first level's draws (0.42+0.17+0.07+0.03).
RANK_ACCEPT, RANK_ACCEPT_SAMPLING = (0.58, 0.24), (0.42, 0.4)


def best_first(m: int, depth: int, k: int, a: float, ratio=None) -> list:
    """The m most valuable nodes of the k-ary tree of the given depth, as (value, level) best first, where the target's
    next token is the draft's rank-r guess with probability a ratio^r (ratio: 1-a by default, a geometric law) and a
    node's value is the product of its path's (a child is never worth more than its parent, so the best m form a tree)."""
    ratio = 1 - a if ratio is None else ratio
    heap = [(-a * ratio ** r, 1) for r in range(k)]
    nodes = []
    for _ in range(min(m, k * (k ** depth - 1) // (k - 1) if k > 1 else depth)):  # m, or the whole tree
        neg, d = heapq.heappop(heap)
        nodes.append((-neg, d))
        if d < depth:
            for r in range(k):
                heapq.heappush(heap, (neg * a * ratio ** r, d + 1))
    return nodes


@functools.cache
def level_widths(m: int, depth: int, k: int) -> tuple:
    """Nodes per level of best_first's tree under the sampling prior: the shape of sampling's trees (grow_coupled)."""
    levels = [d for _, d in best_first(m, depth, k, *RANK_ACCEPT_SAMPLING)]
    return tuple(levels.count(d) for d in range(1, max(levels, default=0) + 1))


# ---- EAGLE-2 dynamic tree ----

def expand(logp: Tensor, scores: Tensor, k: int):
    """Each of n nodes proposes its top-k children, scored by the path's summed log-prob (the paper's
    value: the product of draft confidences). Returns child tokens and scores, both [n, k]."""
    values, indices = ops.topk(logp, k)
    return indices, scores.unsqueeze(-1) + values


def grow(root_logp: Tensor, step, k: int, depth: int, m: int):
    """EAGLE-2 expansion then rerank, over a pool of k + (depth-1) k^2 scored candidates.

    root_logp [V]: draft log-probs for the root's children. step(level, tokens [k], parent [k]) runs the
    draft on the k nodes chosen at `level` (parent indexes the nodes chosen at level-1) and returns
    their children's log-probs [k, V]. Returns the selected pool indices (ascending, ancestor-closed),
    and the pool's tokens, parents (pool indices, -1 for the root) and scores (summed log-probs)."""
    score, tok = ops.topk(root_logp, k)
    idx = torch.arange(k, device=tok.device)  # pool index of each chosen node
    parent = torch.zeros_like(idx)
    pool_tok, pool_score, pool_parent = [tok], [score], [torch.full_like(tok, -1)]
    for level in range(1, depth):
        child_tok, child_score = expand(step(level, tok, parent), score, k)
        pool_tok.append(child_tok.flatten())
        pool_score.append(child_score.flatten())
        pool_parent.append(idx.repeat_interleave(k))
        best = ops.topk(child_score.flatten(), k)[1]
        parent = best // k
        idx = k + (level - 1) * k * k + best
        tok, score = child_tok.flatten()[best], child_score.flatten()[best]
    pool_scores = ops.cat(pool_score)
    return rerank(pool_scores, m), ops.cat(pool_tok), ops.cat(pool_parent), pool_scores


def rerank(pool_scores: Tensor, m: int) -> Tensor:
    """The m best pool entries, as ascending pool indices (which is topological order). A child's score never exceeds
    its parent's, and the pool lists shallower levels first, so a stable descending sort puts every parent before its
    children, ties included: any prefix is ancestor-closed."""
    order = torch.sort(pool_scores, descending=True, stable=True).indices
    return torch.sort(order[:m]).values


def gaps(noisy: Tensor) -> Tensor:
    """A node's coupled score: how far its log q + noise falls short of its row's best (0 for the draw q itself would
    make). Summed along a path, a draft equal to the target keeps the path the target will draw at 0, ahead of every
    other; a log-softmax of the noisy values instead (a row's confidence) took τ 2.04 against 2.02 (noise)."""
    return noisy - noisy.max(-1, keepdim=True).values


def grow_coupled(root_logp: Tensor, step, widths: tuple, noise: Tensor):
    """Sampling's tree, its drafts coupled to the verify's draws (the Gumbel-max trick). The target's token at depth d
    of the tree is argmax(log p + noise[d-1]) (sampling.draw), so the draft ranks by log q + the same noise: where q is
    close to p, its top candidate is the token the target will draw, not merely a likely one. On MT-bench at T=1, head
    12's 10 best guesses hold the target's draw 0.77 of the time this way, against 0.60 for its 10 most probable tokens
    (train/head_agreement.py --sampled).

    Lossless because a level's nodes are chosen from noise[:level] alone: the target's draw at a depth-d node reads
    noise[d], which nothing that decided the path to that node has seen, so it is a fresh sample of p there. That
    forbids EAGLE-2's rerank over the whole pool (a shallow node's place would hang on deeper noise); instead each
    level keeps a fixed number of nodes, widths[level-1], the best by summed gaps along their path, and only those
    are expanded.

    root_logp [V], noise [len(widths), V]: the draft's log-probs and Gumbels in draft-vocabulary ids; step(level, tok,
    parent) as grow's (parent indexes the level before's chosen nodes). -> tokens, parents (node indices of the tree
    whose root is node 0) and scores, each [sum(widths)], level by level."""
    score, tok = ops.topk(gaps(root_logp + noise[0]), widths[0])
    parent = torch.zeros_like(tok)
    toks, parents, scores = [tok], [parent], [score]
    for level in range(1, len(widths)):
        # A row's w best children hold the level's w best; a draft vocabulary smaller than w (--draft-vocab) has them all,
        # and the level still has w candidates: w <= k * (the level before's width) and k <= the draft vocabulary
        c = min(widths[level], noise.shape[-1])
        child_score, child_tok = ops.topk(gaps(step(level, tok, parent) + noise[level]), c)
        score, best = ops.topk((score[:, None] + child_score).flatten(), widths[level])
        parent, tok = best // c, child_tok.flatten()[best]
        toks.append(tok)
        parents.append(1 + sum(widths[: level - 1]) + parent)
        scores.append(score)
    return ops.cat(toks), ops.cat(parents), ops.cat(scores)


def tree_from_pool(sel: Tensor, pool_tokens: Tensor, pool_parents: Tensor, root: Tensor):
    """Selected pool entries -> (tokens, parents) of an (m+1)-node tree. pool_parents holds pool
    indices, -1 for the root; sel is ascending and ancestor-closed."""
    parent_pool = pool_parents[sel]
    parent_node = (sel < parent_pool.clamp(min=0).unsqueeze(-1)).sum(-1) + 1  # searchsorted, which vmap fixes to one batch size
    parents = ops.cat([torch.zeros(1, dtype=torch.long, device=sel.device), torch.where(parent_pool < 0, 0, parent_node)])
    return ops.cat([root.view(1), pool_tokens[sel]]), parents


def graft_chain(tokens: Tensor, parents: Tensor, chain: Tensor, found: Tensor, spare=None):
    """Adds a chain of s tokens continuing the root (prompt lookup's draft) to a tree: s more nodes, chain token i at
    depth i+1. Where the tree already holds the chain's prefix, the chain follows it instead of doubling it (two
    siblings with one token would give that token two chances at T > 0) and the slot stays dead; a chain that was
    not found is all dead. spare: the draft's tree of n + s nodes (tokens, parents), taken whole where no slot is
    live, as the slots' rows are verified either way. -> (tokens, parents, live [n+s] bool): dead nodes are never accepted."""
    n = tokens.shape[0]
    node = torch.arange(n + chain.shape[0], device=tokens.device)
    live = torch.ones(n, dtype=torch.bool, device=tokens.device)
    cur = torch.zeros((), dtype=torch.long, device=tokens.device)  # the node the chain has reached: the root first
    for i in range(chain.shape[0]):
        twin = (parents == cur) & (tokens == chain[i]) & live & (node[: n + i] != 0)
        exists = twin.any()
        tokens, parents = ops.cat([tokens, chain[i].view(1)]), ops.cat([parents, cur.view(1)])
        live = ops.cat([live, found.view(1) & ~exists.view(1) & live[cur.view(1)]])  # a tensor index: no sync
        cur = torch.where(exists, twin.int().argmax(), n + i)
    if spare is not None:
        chained = live[n:].any()
        tokens, parents, live = torch.where(chained, tokens, spare[0]), torch.where(chained, parents, spare[1]), live | ~chained
    return tokens, parents, live


def beside(context: Tensor, tree: Tensor) -> Tensor:
    """A mask over a context of S slots [S] (alike for every node) then the tree's own n rows [n, n] -> [n, S + n]. By
    index, not torch.cat: under torch.vmap a cat whose width is data-dependent (model.live_width) cannot be traced."""
    S, n = context.shape[0], tree.shape[-1]
    col = torch.arange(S + n, device=tree.device)
    return torch.where(col < S, context[col.clamp(max=S - 1)], tree[:, (col - S).clamp(min=0)])


def ancestor_mask(parents: Tensor, depth: int) -> Tensor:
    """[n, n] bool: row i marks i and its ancestors, walking up depth parents (the root is its own). A scan Inductor
    stores: as pointwise rounds it would be inlined into every layer's attention under vmap."""
    nodes = torch.arange(parents.shape[0], device=parents.device)
    walk = [nodes]
    for _ in range(depth):
        walk.append(parents[walk[-1]])
    if not torch.compiler.is_compiling():  # eager, the same mask by a scatter: far faster than the scan over many vmapped rows
        return torch.zeros(len(nodes), len(nodes), dtype=torch.bool, device=parents.device).scatter(1, torch.stack(walk, -1), True)
    return (torch.stack(walk, -1)[:, :, None] == nodes).int().cumsum(1)[:, -1] > 0


# ---- EAGLE-1 static tree ----

def static_tree(paths=EAGLE1_TREE):
    """parents, depths and top-k ranks of a tree given as rank paths, sorted (length, path)."""
    paths = sorted(paths, key=lambda p: (len(p), p))
    index = {(): 0} | {tuple(p): i + 1 for i, p in enumerate(paths)}
    parents = torch.tensor([0] + [index[tuple(p[:-1])] for p in paths])
    depths = torch.tensor([0] + [len(p) for p in paths])
    ranks = torch.tensor([0] + [p[-1] for p in paths])
    return parents, depths, ranks


# ---- verification ----

def accepted_nodes(tokens: Tensor, parents: Tensor, draws: Tensor, depth: int) -> Tensor:
    """[n] bool: the root, and each node whose parent is accepted and whose token equals its parent's draw."""
    is_root = torch.arange(tokens.shape[0], device=tokens.device) == 0
    matched = tokens == draws[parents]
    ok = is_root
    for _ in range(depth):
        ok = is_root | (matched & ok[parents])
    return ok


def accept(tokens: Tensor, parents: Tensor, depths: Tensor, draws: Tensor, depth: int):
    """Walk the tree matching drawn tokens (accepted_nodes). draws holds one target token per node: the argmax when
    greedy, one sample of the processed target distribution when sampling. For drafts that are deterministic given the
    prefix (top-k trees) this is exactly multi-round speculative sampling: the chance to move to a child is its target
    probability, and a miss leaves the target distribution restricted to the other tokens, which is the residual
    norm(max(0, p - q)) for one-hot q. -> accept_len (accepted draft nodes, a 0-d tensor), path [depth+1] (node indices
    from the root; entries past accept_len repeat the last accepted node) and the bonus token."""
    ok = accepted_nodes(tokens, parents, draws, depth)
    accept_len = torch.where(ok, depths, 0).max()
    levels = torch.arange(depth + 1, device=tokens.device)
    on_path = ok.unsqueeze(0) & (depths.unsqueeze(0) == levels.clamp(max=accept_len).unsqueeze(1))
    path = on_path.int().argmax(dim=-1)
    return accept_len, path, draws[path[-1:]][0]


def accept_chain(draft_tokens: Tensor, p: Tensor, q: Tensor):
    """Classic speculative sampling over a chain of k draft tokens (Leviathan et al., Chen et al.). draft_tokens [k]
    were sampled from q [k, V]; p [k+1, V] is the processed target distribution at the root and after each draft
    token. Token i is kept with probability min(1, p_i(x)/q_i(x)); at the first rejection the replacement is drawn
    from norm(max(0, p - q)); if all k pass, the bonus comes from p_k. -> accept_len (0-d) and the bonus token."""
    k = draft_tokens.shape[0]
    px = p[:k].gather(-1, draft_tokens[:, None]).squeeze(-1)
    qx = q.gather(-1, draft_tokens[:, None]).squeeze(-1)
    keep = uniform(px.shape, px.device) * qx < px  # float64: P(keep) = min(1, px / qx)
    accept_len = keep.int().cumprod(0).sum()
    at = accept_len.view(1)
    residual = ops.cat([(p[:k] - q).clamp(min=0), p[k:]]).index_select(0, at)[0]
    residual = torch.where(residual.sum() > 0, residual, p.index_select(0, at)[0])  # p == q: never reached, keep finite
    return accept_len, sample(residual / residual.sum())
