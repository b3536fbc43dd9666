# One speculative cycle, fixed shapes (but attention's width on a CPU: ops.live_width), one host sync at its end:
#   draft_context  the head reads the pairs (target feature f_j, next token x_{j+1}) committed last cycle
#   draft_dynamic  depth-1 expansions of the k best nodes, then the m best of the pool (spectree.py); when
#                  sampling, draft_coupled: fixed widths a level, ranked with the noise the verify draws with
#   verify         one target forward over [root] + m nodes
#   commit         accept (spectree.py), move the accepted KV rows into place, queue the next pairs
# tree_cycle runs them in that order; the eagle mode swaps draft_dynamic for the published static tree,
# sps and lookup draft a chain (verify_chain); plain_step commits one token without drafts (vanilla decoding, and a
# speculative sequence while its batch is too full for trees to pay). Every step reads the sampling rule from the state
# (sampling.py) and takes its kind, static. Everything here is a function of tensors: compiled as it is.
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import lookup
import ops
import spectree
from draft import DraftHead
import sampling
from model import Transformer, causal_mask
from sampling import Sampling, sample

MODES = ("none", "eagle2", "eagle", "sps", "lookup")
CHAINS = ("sps", "lookup")
_depths = spectree.static_tree()[1].tolist()
STATIC_LEVELS = [sum(d < level for d in _depths) for level in range(max(_depths) + 2)]  # first node of each level


@dataclass(frozen=True)
class TreeSpec:
    """The shape of a cycle, each field read by its modes. eagle2: depth levels, topk nodes expanded per level (and
    children per node), m = num_draft_tokens nodes verified besides the root. eagle: the published EAGLE-1 tree
    (TreeSpec.static()). sps, lookup: a chain of k drafts (TreeSpec.chain(mode, k)), a tree of one child per node."""
    mode: str = "eagle2"  # eagle2 (dynamic tree) | eagle (static tree) | sps, lookup (chains)
    depth: int = 6  # draft levels: a cycle commits at most depth + 1 tokens
    topk: int = 10
    num_draft_tokens: int = 60  # m
    lookup_slots: int = 0  # eagle2: s more nodes, the prompt lookup chain continuing the root (spectree.graft_chain)
    # eagle2 when sampling: nodes per level (spectree.grow_coupled), the levels of the sampling prior's best tree of m
    # nodes; set here, not in a property, so compiled cycles read a constant instead of tracing the heap that finds it
    widths: tuple = field(init=False, compare=False, repr=False)

    @classmethod
    def chain(cls, mode: str, k: int) -> "TreeSpec":
        return cls(mode, depth=k, topk=1, num_draft_tokens=k)

    @classmethod
    def static(cls) -> "TreeSpec":
        return cls("eagle", depth=max(_depths), topk=max(p[-1] for p in spectree.EAGLE1_TREE) + 1, num_draft_tokens=len(spectree.EAGLE1_TREE))

    def __post_init__(self):
        if self.mode in CHAINS and (self.topk, self.num_draft_tokens) != (1, self.depth):
            raise ValueError(f"a {self.mode} chain of k drafts is TreeSpec.chain({self.mode!r}, k)")
        if self.mode == "eagle" and (self.depth, self.num_draft_tokens) != (max(_depths), len(spectree.EAGLE1_TREE)):
            raise ValueError("the eagle mode's tree is fixed: TreeSpec.static()")
        if self.lookup_slots and (self.mode != "eagle2" or self.lookup_slots > self.depth):
            raise ValueError("lookup slots go into an eagle2 tree, at most depth of them")
        widths = spectree.level_widths(self.num_draft_tokens, self.depth, self.topk) if self.mode == "eagle2" else ()
        object.__setattr__(self, "widths", widths)

    @property
    def scratch(self) -> int:
        """The head's K/V rows for tree nodes, kept apart from its cache (KVCache.update): eagle2 expands topk nodes a
        level, or when sampling every level's nodes but the last."""
        eagle2 = max((self.depth - 1) * self.topk, sum(self.widths[:-1])) if self.mode == "eagle2" else 0
        return {"eagle2": eagle2, "eagle": self.num_draft_tokens}.get(self.mode, 0)

    @property
    def verify_len(self) -> int:
        return self.num_draft_tokens + self.lookup_slots + 1

    @property
    def history(self) -> bool:
        """Whether the cycle keeps every committed token (SpecState.history): what prompt lookup matches in."""
        return self.mode == "lookup" or self.lookup_slots > 0


class SpecState(nn.Module):
    """Everything a step carries to the next, as buffers updated in place (CUDA-graph friendly).

    L: committed tokens with target KV. root: the last committed token, in no cache yet.
    key, temperature, top_k, top_p, bias, frequency, presence: the sampling rule, as data (sampling.py; set_rule).
    counts: each token's occurrences in the answer (penalties); allowed: the tokens a grammar allows next (grammar.py).
    Speculative states (spec given) also hold:
    pend_*: the (feature, next token) pairs the draft has not read yet; the first n_pend rows are real; a cycle
    leaves at most depth+1, plain steps add one each (room for `pending` rows in all); a feature is what target()
    returns beside the logits (dim wide, or taps * dim for a head with taps).
    out_path: the post-norm target states that drew the last step's committed tokens, one a token (logprobs: the
    LM head over them gives each token's distribution); rows for the longest path of the trees it takes turns with.
    prev: the token before root (sps: the draft model rereads it).
    history (lookup, lookup slots): every committed token at [0, L], root included; reserve() sizes it.
    pending and scratch: room for the largest of several trees a sequence may take turns with (batch.py)."""

    def __init__(self, spec, dim: int, device, pending: int = 0, scratch: int = 0, model_dim: int = 0, path: int = 0, vocab: int = 1):
        super().__init__()
        # the rule's values one-element, not 0-d: Dynamo takes a 0-d float64 buffer for a Python float
        buffers = [("L", (), torch.long), ("root", (1,), torch.long), ("key", (1,), torch.long),
                   ("temperature", (1,), torch.float32), ("top_k", (1,), torch.long), ("top_p", (1,), torch.float64),
                   ("bias", (vocab,), torch.float32), ("frequency", (1,), torch.float32), ("presence", (1,), torch.float32),
                   ("counts", (vocab,), torch.float32), ("allowed", (vocab,), torch.bool),
                   ("out_path", (max(path, spec.depth + 1 if spec is not None else 1), model_dim or dim), torch.float32)]
        if spec is not None:
            rows = max(pending, spec.depth + 1)
            buffers += [("prev", (1,), torch.long), ("n_pend", (), torch.long), ("pend_tok", (rows,), torch.long),
                        ("pend_feat", (rows, dim), torch.float32)]
        for name, shape, dtype in buffers:
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device))
        self.top_p.fill_(1.0)
        self.L.fill_(1)  # a state any step may run on (one slot, one pending pair), though nobody reads what it commits
        if spec is not None:
            self.n_pend.fill_(1)
        if spec is not None and spec.mode == "eagle":
            parents, depths, ranks = spectree.static_tree()
            self.register_buffer("static_parents", parents.to(device))
            self.register_buffer("static_ranks", ranks.to(device))
            self.register_buffer("static_anc", spectree.ancestor_mask(parents, spec.depth)[1:, 1:].to(device))
        if spec is not None and spec.mode == "eagle2":
            self.register_buffer("scratch_eye", torch.eye(max(scratch, spec.scratch), dtype=torch.bool, device=device))

    def set_rule(self, rule: Sampling, key: int, grammar=None):
        """The rule the next steps draw with, its Gumbels' key (sampling.key_of), no count, grammar's first mask (or all)."""
        for name, value in (("temperature", rule.temperature), ("top_k", rule.top_k), ("top_p", rule.top_p), ("key", key),
                            ("frequency", rule.frequency_penalty), ("presence", rule.presence_penalty)):
            getattr(self, name).fill_(value)
        self.bias.zero_(), self.counts.zero_(), self.allowed.fill_(True) if grammar is None else grammar.allowed(self.allowed)
        for token, value in rule.logit_bias:
            self.bias[token] = value


def head_step(target: Transformer, head: DraftHead, tokens: Tensor, feats: Tensor, pos: Tensor, slots, mask: Tensor):
    """The head over n rows of target tokens (K/V into slots; an int: scratch rows from there) -> (features, draft logits)."""
    h = head(tokens[None], target.tok_embeddings.weight, feats[None], pos, slots, mask)[0]
    return h, head.logits(h, target.output)


def draft_context(target, head, st: SpecState, rows: int) -> Tensor:
    """Writes the pending pairs into the draft KV (true target features only) and returns the head's output at the
    last one, the predicted feature of the root. Reads the first rows of the pending buffer (a cycle's depth+1, or all
    of it: catch_up); rows past n_pend are padding, written past L and never read."""
    slots = st.L - st.n_pend + torch.arange(rows, device=st.L.device)
    mask = causal_mask(slots, head.max_seq_length)
    h = head(st.pend_tok[None, :rows], target.tok_embeddings.weight, st.pend_feat[None, :rows], slots, slots, mask)[0]
    return h[st.n_pend.view(1) - 1][0]  # a tensor index keeps the graph free of syncs (index_select: vmap fixes the rows)


def scratch_mask(st: SpecState, ctx: int, anc: Tensor) -> Tensor:
    """Draft mask for tree nodes: the committed context, the head cache's first ctx slots (all of them, or on a CPU no
    more than it holds: ops.live_width), then their ancestors among the tree's K/V rows, kept apart (KVCache.update)."""
    return spectree.beside(torch.arange(ctx, device=anc.device) < st.L, anc)


def draft_dynamic(target, head, st: SpecState, spec: TreeSpec, h_root: Tensor):
    """EAGLE-2: expand the top-k nodes by value level by level, then keep the m best of the pool.
    Returns the tree's tokens, parents and scores (each node's summed draft log-probs), and with s lookup slots the m + s
    best as a tree (graft_chain's spare). spectree.grow sees draft-vocabulary ids; the head reads, and the tree holds, target ids."""
    k, ctx = spec.topk, ops.live_width(st.L - 1, head.max_seq_length)
    feat, anc = h_root.expand(k, -1), torch.zeros_like(st.scratch_eye[:k])

    def step(level, tok, parent):
        nonlocal feat, anc
        anc = anc[parent] | st.scratch_eye[(level - 1) * k:level * k]
        feat, logits = head_step(target, head, head.target_ids(tok), feat[parent], (st.L - 1 + level).expand(k), (level - 1) * k,
                                 scratch_mask(st, ctx, anc))
        return F.log_softmax(logits.float(), dim=-1)

    root_logp = F.log_softmax(head.logits(h_root, target.output).float(), dim=-1)
    sel, pool_tok, pool_parent, pool_score = spectree.grow(root_logp, step, k, spec.depth, spec.num_draft_tokens)
    ids, wide = head.target_ids(pool_tok), spec.num_draft_tokens + spec.lookup_slots
    tokens, parents = spectree.tree_from_pool(sel, ids, pool_parent, st.root)
    spare = spectree.tree_from_pool(spectree.rerank(pool_score, wide), ids, pool_parent, st.root) \
        if spec.lookup_slots and wide <= pool_score.shape[0] else None
    return tokens, parents, F.pad(pool_score[sel], (1, 0)), spare  # the root's score is 0


def draft_coupled(target, head, st: SpecState, spec: TreeSpec, h_root: Tensor, noise: Tensor):
    """EAGLE-2 when sampling: spec.widths nodes a level, ranked by draft logits plus the verify's Gumbels times the
    temperature (argmax(log q / T + G), T times over), rounded to fp32 (still rows no draw below reads:
    spectree.grow_coupled); noise [depth+1, V] fp64 in target ids. -> tokens, parents, scores."""
    ctx, widths = ops.live_width(st.L - 1, head.max_seq_length), spec.widths
    noise = (noise[: len(widths), head.draft_vocab] if len(head.draft_vocab) else noise[: len(widths)]).float()
    feat, anc = h_root[None], torch.zeros_like(st.scratch_eye[:1])

    def step(level, tok, parent):
        nonlocal feat, anc
        first, n = sum(widths[: level - 1]), tok.shape[0]
        anc = anc[parent] | st.scratch_eye[first:first + n]
        feat, logits = head_step(target, head, head.target_ids(tok), feat[parent], (st.L - 1 + level).expand(n), first,
                                 scratch_mask(st, ctx, anc))
        return logits.float()

    tokens, parents, scores = spectree.grow_coupled(head.logits(h_root, target.output).float(), step, widths, noise)
    return ops.cat([st.root, head.target_ids(tokens)]), F.pad(parents, (1, 0)), F.pad(scores, (1, 0))


def draft_static(target, head, st: SpecState, spec: TreeSpec, h_root: Tensor, noise=None):
    """EAGLE-1: the fixed tree; each node is its parent's draft token at the node's top-k rank (when sampling, ranked
    by logits plus the verify's Gumbels times the temperature, as draft_coupled: the tree's shape is fixed, so any noise
    may rank it)."""
    parents, ranks, ctx = st.static_parents, st.static_ranks, ops.live_width(st.L - 1, head.max_seq_length)
    noise = None if noise is None else (noise[:, head.draft_vocab] if len(head.draft_vocab) else noise).float()  # as draft_coupled's

    def ranked(logits, level):
        return logits if noise is None else logits.float() + noise[level - 1]

    tokens, feats = [st.root], h_root[None]
    top = head.target_ids(ops.topk(ranked(head.logits(h_root, target.output), 1), spec.topk)[1][None])
    for level in range(1, spec.depth + 1):
        first, last = STATIC_LEVELS[level], STATIC_LEVELS[level + 1]
        local_parent = parents[first:last] - STATIC_LEVELS[level - 1]
        tok = top[local_parent, ranks[first:last]]
        tokens.append(tok)
        if level == spec.depth:
            break
        pos = (st.L - 1 + level).expand(last - first)
        mask = scratch_mask(st, ctx, st.static_anc[first - 1:last - 1])
        feats, logits = head_step(target, head, tok, feats[local_parent], pos, first - 1, mask)
        top = head.target_ids(ops.topk(ranked(logits, level + 1), spec.topk)[1])
    return ops.cat(tokens), parents, None  # no scores: the static tree is not chosen by value


def verify(target: Transformer, st: SpecState, tokens: Tensor, anc: Tensor, depths: Tensor, chain: bool = False):
    """One target forward over the tree at positions L + depth, each node seeing the committed context and its
    ancestors -> (post-norm states for the LM head, draft features). A tree's K/V wait in k_tree for commit to keep the
    accepted rows (one cache write a cycle: KVCache.keep); a chain's rows go to slots L.. at once, where commit leaves them."""
    n = tokens.shape[0]
    if not chain:
        committed = torch.arange(ops.live_width(st.L - 1, target.max_seq_length), device=tokens.device) < st.L
        out, h = target.hidden(tokens[None], st.L + depths, None, spectree.beside(committed, anc))
        return out[0], h[0]
    rel = torch.arange(ops.live_width(st.L + n - 1, target.max_seq_length), device=tokens.device) - st.L
    in_tree = (rel >= 0) & (rel < n)
    mask = (rel < 0) | (anc[:, rel.clamp(0, n - 1)] & in_tree)
    out, h = target.hidden(tokens[None], st.L + depths, st.L + torch.arange(n, device=tokens.device), mask)
    return out[0], h[0]


def commit(target, st: SpecState, spec: TreeSpec, tokens, accept_len, path, bonus, out, h, kind: str, chain: bool = False):
    """Writes the root's and accepted nodes' KV rows to slots [L, L+depth] (always depth+1 rows, fixed shape; rows
    past accept_len are garbage beyond the new length; a chain's rows are in place already), queues their features and
    keeps the states (out) that drew the committed tokens; truncate's rules count them (penalties)."""
    rows = torch.arange(path.shape[0], device=tokens.device)  # depth+1, or 1 for a lookup step without drafts
    if not chain:
        target.keep_kv(path, st.L + rows)
    nxt = ops.cat([tokens[path[1:]], bonus.view(1)])
    nxt = torch.where(rows == accept_len, bonus, nxt)
    st.pend_feat[: rows.shape[0]].copy_(h[path])
    st.out_path[: rows.shape[0]].copy_(out[path])
    st.pend_tok[: rows.shape[0]].copy_(nxt)
    st.n_pend.copy_(accept_len + 1)
    if kind == "truncate":
        sampling.count(st, nxt, rows <= accept_len)
    st.prev.copy_(tokens[path[-1:]])
    if spec.history:
        st.history.index_put_((st.L + 1 + rows,), nxt)  # rows past accept_len lie past the new root: overwritten later
    st.L.add_(accept_len + 1)
    st.root.copy_(bonus.view(1))
    return ops.cat([accept_len.view(1), nxt])


def tree_cycle(target: Transformer, head: DraftHead, st: SpecState, spec: TreeSpec, kind: str, lap=None) -> Tensor:
    """One EAGLE / EAGLE-2 cycle, drawing by the rule of kind (sampling.KINDS) that st holds. Returns [accept_len,
    committed tokens (depth+1, the first accept_len+1 real)]. lap(name), eager only, marks where each phase ends
    (bench.py's time split); at "accept" it also gets the cycle's tokens, parents, draws and draft scores (calibration.py)."""
    h_root = draft_context(target, head, st, spec.depth + 1)
    # Sampling draws the token after a depth-d node (position L + d + 1) with noise[d], and the drafts foresee those draws.
    noise = sampling.noise(st, st.L + 1, spec.depth + 1, target.args.vocab_size) if kind != "greedy" else None
    spare = live = None  # spare: the m + s best, where the lookup slots have nothing to add (graft_chain)
    if spec.mode == "eagle":
        tokens, parents, scores = draft_static(target, head, st, spec, h_root, noise)
    elif noise is None:
        tokens, parents, scores, spare = draft_dynamic(target, head, st, spec, h_root)
    else:
        tokens, parents, scores = draft_coupled(target, head, st, spec, h_root, noise)
    if spec.lookup_slots:
        chain, found = lookup.ngram_draft(st.history, st.L + 1, spec.lookup_slots)
        tokens, parents, live = spectree.graft_chain(tokens, parents, chain, found, spare)
        scores = None  # the chain has no draft confidence
    lap and lap("draft")
    anc = spectree.ancestor_mask(parents, spec.depth)
    depths = anc.sum(-1) - 1
    lap and lap("tree")
    out, h = verify(target, st, tokens, anc, depths)
    lap and lap("verify")
    seen = sampling.path_counts(tokens, anc, target.args.vocab_size) if kind == "truncate" else None
    draws = sampling.lm_head_draw(target.output, out, kind, st, noise, depths, seen)
    accept_tokens = tokens if live is None else torch.where(live, tokens, -1)  # a dead slot matches no draw
    accept_len, path, bonus = spectree.accept(accept_tokens, parents, depths, draws, spec.depth)
    out = commit(target, st, spec, tokens, accept_len, path, bonus, out, h, kind)
    lap and lap("accept", tokens=tokens, parents=parents, draws=draws, scores=scores)
    return out


def verify_chain(target: Transformer, st: SpecState, spec: TreeSpec, tokens: Tensor, kind: str, qs=None):
    """Verify a chain [root, k drafts] and commit what it accepts. Drafts that are a function of the prefix
    (greedy sps, lookup) take the tree rule, one target draw per node; sampled drafts with their
    distributions qs take classic speculative sampling, min(1, p/q) and the residual."""
    k = tokens.shape[0] - 1
    chain = torch.arange(k + 1, device=tokens.device)
    parents = (chain - 1).clamp(min=0)
    out, h = verify(target, st, tokens, anc := chain[None, :] <= chain[:, None], chain, chain=True)
    seen = sampling.path_counts(tokens, anc, target.args.vocab_size) if kind == "truncate" else None
    if qs is None:
        noise = sampling.noise(st, st.L + 1, k + 1, target.args.vocab_size) if kind != "greedy" else None
        accept_len, path, bonus = spectree.accept(tokens, parents, chain, sampling.lm_head_draw(target.output, out, kind, st, noise, seen=seen), k)
    else:
        logits = target.output(out) if seen is None else sampling.shaped(target.output(out), st, seen)
        accept_len, bonus = spectree.accept_chain(tokens[1:], sampling.rule_probs(logits, st), qs)
        path = chain.clamp(max=accept_len)
    return commit(target, st, spec, tokens, accept_len, path, bonus, out, h, kind, chain=True)


def sps_cycle(target: Transformer, draft_model: Transformer, st: SpecState, spec: TreeSpec, kind: str, lap=None) -> Tensor:
    """Classic speculative sampling: a small draft LLM proposes a chain of k tokens."""
    k, device = spec.depth, st.L.device
    # The draft rereads the token before root, so its KV is complete even after a fully accepted chain.
    pos = st.L - 1 + torch.arange(2, device=device)
    logits = draft_model(ops.cat([st.prev, st.root])[None], pos, pos, causal_mask(pos, draft_model.max_seq_length))[0][0, -1]
    drafts, qs = [], []
    for i in range(k):
        if i:
            pos = (st.L + i).view(1)
            logits = draft_model(drafts[-1].view(1, 1), pos, pos, causal_mask(pos, draft_model.max_seq_length))[0][0, -1]
        if kind == "greedy":
            drafts.append(torch.argmax(logits))
        else:
            qs.append(sampling.rule_probs(logits, st))
            drafts.append(sample(qs[-1]))
    lap and lap("draft")
    out = verify_chain(target, st, spec, ops.cat([st.root, torch.stack(drafts)]), kind, torch.stack(qs) if qs else None)
    lap and lap("verify")
    return out


def lookup_cycle(target: Transformer, _drafter, st: SpecState, spec: TreeSpec, kind: str, lap=None, drafts: bool = True) -> Tensor:
    """Prompt lookup: the chain is what followed the last occurrence of the text's latest n-gram (lookup.py). Returns
    the commit's [accept_len, tokens] and whether the next cycle has a match: without one the Generator runs this with
    drafts=False, a one-token verify (a plain decode step), instead of paying for k drafts that would be rejected."""
    chain, _ = lookup.ngram_draft(st.history, st.L + 1, spec.depth)
    lap and lap("draft")
    out = verify_chain(target, st, spec, ops.cat([st.root, chain]) if drafts else st.root, kind)
    lap and lap("verify")
    _, found = lookup.ngram_draft(st.history, st.L + 1, spec.depth)
    return ops.cat([out, found.view(1)])


def lookup_step(target: Transformer, _drafter, st: SpecState, spec: TreeSpec, kind: str, lap=None) -> Tensor:
    """lookup_cycle without drafts: what runs while the text has no n-gram to draft from."""
    return lookup_cycle(target, _drafter, st, spec, kind, lap, drafts=False)


def plain_step(target: Transformer, drafter, st: SpecState, spec, kind: str, lap=None) -> Tensor:
    """One token without drafts: vanilla decoding (spec None), or an eagle / eagle2 sequence between cycles (batch.py:
    where its batch is too full for trees to pay), which queues the (feature, token) pair for the head like a commit
    (catch_up reads them before the pending rows run out). -> [0, the token], as a cycle that accepted nothing."""
    pos = st.L.view(1)
    h, feat = target.hidden(st.root.view(1, 1), pos, pos, causal_mask(pos, target.max_seq_length))
    noise = sampling.noise(st, st.L + 1, 1, target.args.vocab_size) if kind != "greedy" else None
    token = sampling.lm_head_draw(target.output, h[0], kind, st, noise)
    st.out_path[:1].copy_(h[0])
    if kind == "truncate":
        sampling.count(st, token, torch.ones_like(token))
    if spec is not None:
        at = st.n_pend.clamp(max=st.pend_tok.shape[0] - 1).view(1)  # in bounds for a row padding a batch (Batch.run)
        st.pend_feat.index_put_((at,), feat[0].float())
        st.pend_tok.index_put_((at,), token)
        st.n_pend.add_(1)
        st.prev.copy_(st.root)
        if spec.history:
            st.history.index_put_(((st.L + 1).view(1),), token)
    st.L.add_(1)
    st.root.copy_(token)
    lap and lap("verify")
    return F.pad(token, (1, 0))


def catch_up(target: Transformer, head: DraftHead, st: SpecState, spec: TreeSpec, kind: str, lap=None) -> Tensor:
    """The head reads every pending pair (plain steps queue one each), leaving the last one pending, as after a cycle:
    the next cycle's context pass rereads it into the same slot. -> the pairs that were pending."""
    n = st.n_pend.clone()
    draft_context(target, head, st, st.pend_tok.shape[0])
    last = (n - 1).view(1)
    st.pend_tok[:1].copy_(st.pend_tok[last])
    st.pend_feat[:1].copy_(st.pend_feat[last])
    st.n_pend.fill_(1)
    return n.view(1)
