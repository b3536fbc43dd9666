# Vanilla and speculative generation, and the CLI.
#
# One speculative cycle (eagle2), every shape fixed, one host sync at the end:
#   draft_context  the head reads the pairs (target feature f_j, next token x_{j+1}) committed last cycle
#   draft_dynamic  depth-1 expansions of the k best nodes, then the m best of the pool (spectree.py)
#   verify         one target forward over [root] + m nodes
#   commit         accept (spectree.py), move the accepted KV rows into place, queue the next pairs
import argparse
import json
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import dtypes
import lookup
import quantize
import sizing
import spectree
import tp
from draft import DraftHead, load_head, use_draft_vocab
from model import ModelArgs, Transformer, causal_mask, load_state, one_line
from sampling import Sampling, sample

REPO = Path(__file__).resolve().parent
DEFAULT_HEAD = REPO / "heads" / "SmolLM2-135M-Instruct"
MODES = ("none", "eagle2", "eagle", "sps", "lookup")
_depths = spectree.static_tree()[1].tolist()
STATIC_LEVELS = [sum(d < level for d in _depths) for level in range(max(_depths) + 2)]  # first node of each level
STATIC_TOPK = max(p[-1] for p in spectree.EAGLE1_TREE) + 1


class UsageError(Exception):
    """Bad input: the CLI prints one line and exits with status 2."""


@dataclass(frozen=True)
class TreeSpec:
    mode: str = "eagle2"  # eagle2 (dynamic tree) | eagle (static tree) | sps, lookup (chains)
    depth: int = 6  # draft levels: a cycle commits at most depth + 1 tokens
    topk: int = 10
    num_draft_tokens: int = 60  # m, tree nodes besides the root

    @property
    def scratch(self) -> int:
        """Draft KV slots for tree nodes, after the context slots."""
        if self.mode == "eagle2":
            return (self.depth - 1) * self.topk
        return len(spectree.EAGLE1_TREE) if self.mode == "eagle" else 0

    @property
    def verify_len(self) -> int:
        return {"eagle2": self.num_draft_tokens, "eagle": len(spectree.EAGLE1_TREE)}.get(self.mode, self.depth) + 1


# ---------------------------------------------------------------- loading

def load_model(checkpoint, device="cpu", dtype=torch.float32) -> Transformer:
    path = Path(checkpoint)
    if not path.exists():
        raise UsageError(f"checkpoint {path} does not exist")
    if not (path / "config.json").exists():
        raise UsageError(f"{path} has no config.json: convert it first with convert_hf_checkpoint.py")
    weights = path / "model.safetensors"
    if not weights.exists():
        raise UsageError(f"{path} has no model.safetensors: convert it first with convert_hf_checkpoint.py")
    try:
        args = ModelArgs.load(path / "config.json")
    except (ValueError, TypeError, AttributeError) as e:
        raise UsageError(f"{path / 'config.json'} is not a model config ({one_line(e)})") from None
    with torch.device("meta"):
        model = Transformer(args)
    try:
        quantize.prepare(model, json.loads((path / "config.json").read_text()))
    except ValueError as e:
        raise UsageError(f"{path / 'config.json'}: {e}") from None
    try:
        state = load_state(weights)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.tie_embeddings:
        state.setdefault("output.weight", state["tok_embeddings.weight"])
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:
        raise UsageError(f"{weights} does not match its config.json: {one_line(e)}") from None
    model = model.to(device=device, dtype=dtype)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval()


def ensure_caches(model: nn.Module, length: int, **kw):
    # Rounded up and only ever grown, so compiled steps see one cache shape across prompts.
    length = -(-length // 256) * 256
    if model.max_seq_length < length:
        model.setup_caches(length, **kw)


# ---------------------------------------------------------------- vanilla decoding

def prefill(model: Transformer, prompt: Tensor) -> tuple:
    """prompt [1, T] -> (post-norm hidden states [T, dim], draft features [T, *]); fills KV slots [0, T)."""
    pos = torch.arange(prompt.shape[1], device=prompt.device)
    h, feat = model.hidden(prompt, pos, pos, causal_mask(pos, model.max_seq_length))
    return h[0], feat[0]


def decode_one(model: Transformer, token: Tensor, pos: Tensor, sampling: Sampling) -> Tensor:
    logits, _ = model(token.view(1, 1), pos, pos, causal_mask(pos, model.max_seq_length))
    return sampling.draw(logits[0, -1]).view(1)


# ---------------------------------------------------------------- the speculative cycle

class SpecState(nn.Module):
    """Everything a cycle carries to the next, as buffers updated in place (CUDA-graph friendly).

    L: committed tokens with target KV. root: the last committed token, in no cache yet.
    pend_*: the (feature, next token) pairs the draft has not read yet; n_pend of depth+1 rows are real;
    a feature is what target() returns beside the logits (dim wide, or taps * dim for EAGLE-3 heads).
    prev: the token before root (sps: the draft model rereads it).
    history (lookup): every committed token at [0, L], root included; reserve() sizes it with the caches."""

    def __init__(self, spec: TreeSpec, dim: int, device):
        super().__init__()
        rows = spec.depth + 1
        for name, shape, dtype in [("L", (), torch.long), ("root", (1,), torch.long), ("prev", (1,), torch.long),
                                   ("n_pend", (), torch.long), ("pend_tok", (rows,), torch.long),
                                   ("pend_feat", (rows, dim), torch.float32)]:
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device))
        if spec.mode == "eagle":
            parents, depths, ranks = spectree.static_tree()
            self.register_buffer("static_parents", parents.to(device))
            self.register_buffer("static_ranks", ranks.to(device))
            self.register_buffer("static_anc", spectree.ancestor_mask(parents, spec.depth)[1:, 1:].to(device))
        if spec.mode == "eagle2":
            self.register_buffer("scratch_eye", torch.eye(spec.scratch, dtype=torch.bool, device=device))


def head_step(target: Transformer, head: DraftHead, tokens: Tensor, feats: Tensor, pos: Tensor, slots: Tensor, mask: Tensor):
    """The head over n rows of target tokens -> (predicted features [n, dim], draft logits [n, V_draft])."""
    h = head(target.tok_embeddings(tokens)[None], feats[None], pos, slots, mask)[0]
    return h, head.logits(h, target.output)


def draft_context(target, head, st: SpecState, spec: TreeSpec) -> Tensor:
    """Writes the pending pairs into the draft KV (true target features only) and returns the head's
    output at the last one, the predicted feature of the root."""
    rows = torch.arange(spec.depth + 1, device=st.L.device)
    slots = st.L - st.n_pend + rows  # rows past n_pend are padding, written past L and never read
    mask = causal_mask(slots, head.max_seq_length)
    h = head(target.tok_embeddings(st.pend_tok)[None], st.pend_feat[None], slots, slots, mask)[0]
    return h.index_select(0, st.n_pend.view(1) - 1)[0]  # a tensor index keeps the graph free of syncs


def scratch_mask(st: SpecState, head: DraftHead, anc: Tensor) -> Tensor:
    """Draft mask for tree nodes: the whole committed context plus their ancestors in the scratch."""
    ctx = head.max_seq_length - anc.shape[1]
    prefix = torch.arange(ctx, device=anc.device) < st.L
    return torch.cat([prefix.expand(anc.shape[0], ctx), anc], dim=-1)


def draft_dynamic(target, head, st: SpecState, spec: TreeSpec, h_root: Tensor):
    """EAGLE-2: expand the top-k nodes by value level by level, then keep the m best of the pool.
    Returns the tree's tokens, parents and scores (each node's summed draft log-probs). spectree.grow sees
    draft-vocabulary ids; the head reads, and the tree holds, target ids."""
    k = spec.topk
    ctx = head.max_seq_length - spec.scratch
    feat, anc = h_root.expand(k, -1), torch.zeros_like(st.scratch_eye[:k])

    def step(level, tok, parent):
        nonlocal feat, anc
        slots = ctx + (level - 1) * k + torch.arange(k, device=tok.device)
        anc = anc[parent] | st.scratch_eye[(level - 1) * k:level * k]
        feat, logits = head_step(target, head, head.target_ids(tok), feat[parent], (st.L - 1 + level).expand(k), slots,
                                 scratch_mask(st, head, anc))
        return F.log_softmax(logits.float(), dim=-1)

    root_logp = F.log_softmax(head.logits(h_root, target.output).float(), dim=-1)
    sel, pool_tok, pool_parent, pool_score = spectree.grow(root_logp, step, k, spec.depth, spec.num_draft_tokens)
    tokens, parents = spectree.tree_from_pool(sel, head.target_ids(pool_tok), pool_parent, st.root)
    return tokens, parents, F.pad(pool_score[sel], (1, 0))  # the root's score is 0


def draft_static(target, head, st: SpecState, spec: TreeSpec, h_root: Tensor):
    """EAGLE-1: the fixed tree; each node is its parent's draft token at the node's top-k rank."""
    parents, ranks = st.static_parents, st.static_ranks
    ctx = head.max_seq_length - spec.scratch
    tokens, feats = [st.root], h_root[None]
    top = head.target_ids(torch.topk(head.logits(h_root, target.output), STATIC_TOPK).indices[None])
    for level in range(1, spec.depth + 1):
        first, last = STATIC_LEVELS[level], STATIC_LEVELS[level + 1]
        local_parent = parents[first:last] - STATIC_LEVELS[level - 1]
        tok = top[local_parent, ranks[first:last]]
        tokens.append(tok)
        if level == spec.depth:
            break
        nodes = torch.arange(first, last, device=tok.device)
        pos = (st.L - 1 + level).expand(last - first)
        mask = scratch_mask(st, head, st.static_anc[nodes - 1])
        feats, logits = head_step(target, head, tok, feats[local_parent], pos, ctx + nodes - 1, mask)
        top = head.target_ids(torch.topk(logits, STATIC_TOPK).indices)
    return torch.cat(tokens), parents, None  # no scores: the static tree is not chosen by value


def verify(target: Transformer, st: SpecState, tokens: Tensor, anc: Tensor, depths: Tensor):
    """One target forward over the tree at slots L.., positions L + depth, each node seeing the
    committed context and its ancestors."""
    n, S = tokens.shape[0], target.max_seq_length
    rel = torch.arange(S, device=tokens.device) - st.L
    in_tree = (rel >= 0) & (rel < n)
    mask = (rel < 0) | (anc[:, rel.clamp(0, n - 1)] & in_tree)
    slots = st.L + torch.arange(n, device=tokens.device)
    logits, h = target(tokens[None], st.L + depths, slots, mask)
    return logits[0], h[0]


def commit(target, st: SpecState, spec: TreeSpec, tokens, accept_len, path, bonus, h):
    """Moves the root's and accepted nodes' KV rows to [L, L+depth] (always depth+1 rows, fixed shape;
    rows past accept_len are garbage beyond the new length) and queues their features for the draft."""
    rows = torch.arange(path.shape[0], device=tokens.device)  # depth+1, or 1 for a lookup step without drafts
    for layer in target.layers:
        layer.attention.kv_cache.move(st.L + path, st.L + rows)
    nxt = torch.cat([tokens[path[1:]], bonus.view(1)])
    nxt = torch.where(rows == accept_len, bonus, nxt)
    st.pend_feat[: rows.shape[0]].copy_(h[path])
    st.pend_tok[: rows.shape[0]].copy_(nxt)
    st.n_pend.copy_(accept_len + 1)
    st.prev.copy_(tokens[path[-1:]])
    if spec.mode == "lookup":
        st.history.index_copy_(0, st.L + 1 + rows, nxt)  # rows past accept_len lie past the new root: overwritten later
    st.L.add_(accept_len + 1)
    st.root.copy_(bonus.view(1))
    return torch.cat([accept_len.view(1), nxt])


def tree_cycle(target: Transformer, head: DraftHead, st: SpecState, spec: TreeSpec, sampling: Sampling, lap=None) -> Tensor:
    """One EAGLE / EAGLE-2 cycle. Returns [accept_len, committed tokens (depth+1, the first
    accept_len+1 real)]. lap(name), eager only, marks where each phase ends (bench.py's time split); at
    "accept" it also gets the cycle's tokens, parents, draws and draft scores (calibration.py)."""
    h_root = draft_context(target, head, st, spec)
    draft_tree = draft_dynamic if spec.mode == "eagle2" else draft_static
    tokens, parents, scores = draft_tree(target, head, st, spec, h_root)
    lap and lap("draft")
    anc = spectree.ancestor_mask(parents, spec.depth)
    depths = anc.sum(-1) - 1
    lap and lap("tree")
    logits, h = verify(target, st, tokens, anc, depths)
    lap and lap("verify")
    draws = sampling.draw(logits)
    accept_len, path, bonus = spectree.accept(tokens, parents, depths, draws, spec.depth)
    out = commit(target, st, spec, tokens, accept_len, path, bonus, h)
    lap and lap("accept", tokens=tokens, parents=parents, draws=draws, scores=scores)
    return out


def verify_chain(target: Transformer, st: SpecState, spec: TreeSpec, tokens: Tensor, sampling: Sampling, qs=None):
    """Verify a chain [root, k drafts] and commit what it accepts. Drafts that are a function of the prefix
    (greedy sps, lookup) take the tree rule, one target draw per node; sampled drafts with their
    distributions qs take classic speculative sampling, min(1, p/q) and the residual."""
    k = tokens.shape[0] - 1
    chain = torch.arange(k + 1, device=tokens.device)
    parents = (chain - 1).clamp(min=0)
    logits, h = verify(target, st, tokens, chain[None, :] <= chain[:, None], chain)
    if qs is None:
        accept_len, path, bonus = spectree.accept(tokens, parents, chain, sampling.draw(logits), k)
    else:
        accept_len, bonus = spectree.accept_chain(tokens[1:], sampling.probs(logits), qs)
        path = chain.clamp(max=accept_len)
    return commit(target, st, spec, tokens, accept_len, path, bonus, h)


def sps_cycle(target: Transformer, draft_model: Transformer, st: SpecState, spec: TreeSpec, sampling: Sampling, lap=None) -> Tensor:
    """Classic speculative sampling: a small draft LLM proposes a chain of k tokens."""
    k, device = spec.depth, st.L.device
    # The draft rereads the token before root, so its KV is complete even after a fully accepted chain.
    pos = st.L - 1 + torch.arange(2, device=device)
    logits = draft_model(torch.cat([st.prev, st.root])[None], pos, pos, causal_mask(pos, draft_model.max_seq_length))[0][0, -1]
    drafts, qs = [], []
    for i in range(k):
        if i:
            pos = (st.L + i).view(1)
            logits = draft_model(drafts[-1].view(1, 1), pos, pos, causal_mask(pos, draft_model.max_seq_length))[0][0, -1]
        if sampling.temperature == 0:
            drafts.append(torch.argmax(logits))
        else:
            qs.append(sampling.probs(logits))
            drafts.append(sample(qs[-1]))
    lap and lap("draft")
    out = verify_chain(target, st, spec, torch.cat([st.root, torch.stack(drafts)]), sampling, torch.stack(qs) if qs else None)
    lap and lap("verify")
    return out


def lookup_cycle(target: Transformer, _drafter, st: SpecState, spec: TreeSpec, sampling: Sampling, lap=None, drafts: bool = True) -> Tensor:
    """Prompt lookup: the chain is what followed the last occurrence of the text's latest n-gram (lookup.py).
    Returns the commit's [accept_len, tokens] and whether the next cycle has a match: without one the
    Generator runs this with drafts=False, a one-token verify (a plain decode step), instead of paying for
    k drafts that would be rejected."""
    chain, _ = lookup.ngram_draft(st.history, st.L + 1, spec.depth)
    lap and lap("draft")
    out = verify_chain(target, st, spec, torch.cat([st.root, chain]) if drafts else st.root, sampling)
    lap and lap("verify")
    _, found = lookup.ngram_draft(st.history, st.L + 1, spec.depth)
    return torch.cat([out, found.view(1)])


def lookup_step(target: Transformer, _drafter, st: SpecState, spec: TreeSpec, sampling: Sampling, lap=None) -> Tensor:
    """lookup_cycle without drafts: what runs while the text has no n-gram to draft from."""
    return lookup_cycle(target, _drafter, st, spec, sampling, lap, drafts=False)


# ---------------------------------------------------------------- generation

@dataclass
class Result:
    token_ids: list
    seconds: float
    cycles: int = 0
    accept_hist: Optional[list] = None  # cycles that accepted 0, 1, ... depth draft tokens

    def metrics(self, spec: Optional[TreeSpec]) -> dict:
        out = {"new_tokens": len(self.token_ids), "seconds": round(self.seconds, 4),
               "tokens_per_s": round(len(self.token_ids) / max(self.seconds, 1e-9), 2)}
        if spec is None or not self.cycles:
            return out
        return out | acceptance_metrics(self.accept_hist, len(self.token_ids) - 1, self.cycles)


def acceptance_metrics(hist: list, cycle_tokens: int, cycles: int) -> dict:
    """hist[a]: cycles that accepted a draft tokens; cycle_tokens: tokens the cycles committed, cut at
    the stop token or the token limit (the first token comes from the prefill, not a cycle)."""
    reached = [sum(hist[d:]) for d in range(len(hist))]
    return dict(
        cycles=cycles,
        mean_accept_len=round(cycle_tokens / cycles, 4),  # tau: tokens per target forward, bonus included
        accept_len_hist=hist,
        accept_rate_per_depth=[round(reached[d] / reached[d - 1], 4) if reached[d - 1] else 0.0 for d in range(1, len(hist))],
    )


# Inductor settings for CPU steps, the one place they are set (the vanilla step and every cycle share them).
# Measured on a 2-core AMD EPYC, bf16 SmolLM2-135M vanilla, see BENCHMARKS.md:
#   freezing     weights become graph constants, so oneDNN receives them prepacked once instead of reordering
#                them on every call (the largest single gain). Only what a graph never writes is folded:
#                Inductor keeps every mutated input (KV caches, SpecState) a live buffer, and Dynamo guards the
#                frozen tensors by identity, so another model's weights recompile instead of reusing these.
#   cpp_wrapper  the graph calls its kernels from C++, no Python between them (the CPU's answer to CUDA graphs).
# max_autotune (CPP GEMM templates) measured slower at one row and multiplies compile time, so it stays off.
CPU_INDUCTOR = {"freezing": True, "cpp_wrapper": True}
# CUDA: gpt-fast's setting; it tunes the fused int8 dequantise-and-GEMV kernels of quantize.QuantLinear.
CUDA_INDUCTOR = {"coordinate_descent_tuning": True}


def compiled(fn, device=None, **kw):
    """torch.compile(fullgraph) with this device's Inductor settings. Compiled artefacts persist in Inductor's
    on-disk caches (FX graph and kernel caches), so a second process with the same model warms up faster."""
    if device is not None:
        import torch._inductor.config as inductor_config

        # Global, not options=: Dynamo reads `freezing` while tracing (to guard the frozen weights).
        for key, value in (CPU_INDUCTOR if torch.device(device).type == "cpu" else CUDA_INDUCTOR).items():
            setattr(inductor_config, key, value)
    # Dynamo keeps its cache, and its recompile budget (8 variants), per code object. Every Generator
    # compiles a copy of the step with a code object of its own, so a process that runs many tree shapes
    # (bench --sweep, a test suite) never shares one budget across them; fullgraph would make the ninth a hard error.
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(own, fullgraph=True, **kw)


def sizing_compile(target: Transformer):
    """How sizing.py compiles the passes it times: as the Generator compiles its steps, with the number of
    rows dynamic so one graph serves every tree size."""
    device = target.tok_embeddings.weight.device
    return lambda fn: compiled(fn, device, dynamic=True, mode="reduce-overhead" if device.type == "cuda" else None)


class Generator:
    """Owns the models, their caches and the (optionally compiled) step functions."""

    def __init__(self, target: Transformer, spec: Optional[TreeSpec] = None, head: Optional[DraftHead] = None,
                 draft_model: Optional[Transformer] = None, compile: bool = False):
        self.target, self.spec, self.head, self.draft_model = target, spec, head, draft_model
        self.device = target.tok_embeddings.weight.device
        if head is not None and len(head.draft_vocab) and head.lm_head is None:
            use_draft_vocab(head, target.output)  # a head loaded with load_head alone drafts over its vocabulary too
        # An EAGLE-3 head reads the states entering its tap layers: the target hands them over from the
        # prefill and verify passes it runs anyway (target.taps); every other drafter reads post-norm states.
        self.taps = head.taps if head is not None else ()
        target.taps = self.taps
        feat_dim = target.args.dim * (len(self.taps) or 1)
        self.state = SpecState(spec, feat_dim, self.device) if spec else None
        self.prefill, self.decode_one = prefill, decode_one
        self.cycle = self.eager_cycle = {"sps": sps_cycle, "lookup": lookup_cycle}.get(spec.mode, tree_cycle) if spec else None
        self.plain_cycle = lookup_step
        if compile:
            cuda = self.device.type == "cuda"
            mode = "reduce-overhead" if cuda else None  # reduce-overhead = CUDA graphs
            self.prefill = compiled(prefill, self.device, dynamic=True)
            self.decode_one = compiled(decode_one, self.device, mode=mode)
            if spec:
                self.cycle = compiled(self.cycle, self.device, mode=mode)
            if spec and spec.mode == "lookup":
                self.plain_cycle = compiled(lookup_step, self.device, mode=mode)

    def reserve(self, max_len: int):
        """Caches for a prompt plus new tokens of max_len, with room for a verify and a commit."""
        extra = (self.spec.verify_len + self.spec.depth + 2) if self.spec else 1
        ensure_caches(self.target, max_len + extra)
        if self.head is not None:
            ctx = self.target.max_seq_length
            if self.head.max_seq_length != ctx + self.spec.scratch:
                self.head.setup_caches(ctx + self.spec.scratch, dtype=self.target.tok_embeddings.weight.dtype)
        if self.draft_model is not None and self.draft_model.max_seq_length != self.target.max_seq_length:
            self.draft_model.setup_caches(self.target.max_seq_length)
        if self.spec and self.spec.mode == "lookup" and getattr(self.state, "history", torch.empty(0)).shape[0] != self.target.max_seq_length:
            self.state.register_buffer("history", torch.zeros(self.target.max_seq_length, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def generate(self, prompt: list, max_new_tokens: int, sampling: Sampling, stop_ids=(), on_tokens=None, lap=None) -> Result:
        """lap(name, **cycle_tensors): run the cycle eagerly and call lap at the end of each phase
        (bench.py's split); see tree_cycle for the tensors."""
        if not prompt:
            raise UsageError("the prompt is empty (no tokens to condition on)")
        if len(prompt) + max_new_tokens > self.target.args.block_size:
            raise UsageError(f"prompt ({len(prompt)} tokens) plus --max-new-tokens ({max_new_tokens}) exceeds the context of {self.target.args.block_size}")
        self.reserve(len(prompt) + max_new_tokens)
        self.target.taps = self.taps  # another Generator may share the target
        stop_ids = set(stop_ids)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        x = torch.tensor([prompt], device=self.device)
        h, feats = self.prefill(self.target, x)
        root = sampling.draw(self.target.output(h[-1]))
        lap and lap("prefill")
        out = [int(root)]
        if on_tokens:
            on_tokens(out[:])
        hist = [0] * ((self.spec.depth + 1) if self.spec else 1)
        cycles, drafts = 0, True  # lookup: whether the text has a match to draft from
        if self.spec:
            self._start(x, feats, root)
            lap and lap("prefill")
        while len(out) < max_new_tokens and out[-1] not in stop_ids:
            if self.spec:
                drafter = self.head if self.head is not None else self.draft_model
                cycle, eager_cycle = (self.cycle, self.eager_cycle) if drafts else (self.plain_cycle, lookup_step)
                if lap:
                    chunk = eager_cycle(self.target, drafter, self.state, self.spec, sampling, lap).tolist()
                else:
                    chunk = cycle(self.target, drafter, self.state, self.spec, sampling).tolist()
                if self.spec.mode == "lookup":
                    drafts = bool(chunk.pop())
                accept_len, new = chunk[0], chunk[1:chunk[0] + 2]
                hist[accept_len] += 1
                cycles += 1
            else:
                pos = torch.tensor([len(prompt) + len(out) - 1], device=self.device)
                new = self.decode_one(self.target, torch.tensor(out[-1:], device=self.device), pos, sampling).tolist()
            new = new[: max_new_tokens - len(out)]
            for i, t in enumerate(new):
                if t in stop_ids:
                    new = new[: i + 1]
                    break
            out += new
            if on_tokens:
                on_tokens(new)
        sync()
        return Result(out, time.perf_counter() - t0, cycles, hist if self.spec else None)

    def _start(self, prompt: Tensor, feats: Tensor, root: Tensor):
        st, T = self.state, prompt.shape[1]
        st.L.fill_(T)
        st.root.copy_(root.view(1))
        st.prev.copy_(prompt[0, -1:])
        st.n_pend.fill_(1)
        st.pend_tok[0] = root
        st.pend_feat[0] = feats[-1].float()
        if self.spec.mode == "lookup":
            st.history[:T] = prompt[0]
            st.history[T] = root
        if self.head is not None and T > 1:
            # The draft's context: feature f_j with token x_{j+1}; the last pair waits in pend_*.
            pos = torch.arange(T - 1, device=self.device)
            self.head(self.target.tok_embeddings(prompt[:, 1:]), feats[None, :-1], pos, pos, causal_mask(pos, self.head.max_seq_length))
        if self.draft_model is not None and T > 1:
            prefill(self.draft_model, prompt[:, :-1])


# ---------------------------------------------------------------- CLI

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description="Generate text with a LLaMA-family model, optionally with speculative decoding.")
    p.add_argument("--checkpoint", type=Path, default=None, help="converted checkpoint dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="apply the chat template (default: on for chat models)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (argmax)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="default: bfloat16 on CUDA; on a CPU the faster of float32 and bfloat16, measured once per machine (dtypes.py)")
    p.add_argument("--compile", action="store_true", help="torch.compile the steps (CUDA graphs on a GPU; Inductor freezing and C++ wrapper on a CPU)")
    p.add_argument("--speculate", default="none", help=f"one of {', '.join(MODES)}")
    p.add_argument("--draft", type=Path, default=None, help="EAGLE head dir (default: the shipped head of the default model)")
    p.add_argument("--draft-checkpoint", type=Path, default=None, help="draft LLM for --speculate sps")
    p.add_argument("--depth", type=int, default=None, help="draft levels (eagle2 default: sized for the device; sps chain length)")
    p.add_argument("--speculate-k", type=int, default=None, help="sps / lookup: draft chain length (default 4 / 6)")
    p.add_argument("--topk", type=int, default=None, help="k: nodes expanded per level, children per node (default: sized for the device)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="m: tree nodes verified besides the root (default: sized for the device)")
    p.add_argument("--draft-vocab", type=int, default=None, help="draft over the head's N most frequent tokens (default: all it has; 0: the whole vocabulary)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p


def check_args(a):
    if a.speculate not in MODES:
        raise UsageError(f"unknown --speculate mode {a.speculate!r}; choose from {', '.join(MODES)}")
    if a.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {a.temperature}")
    if not 0 < a.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {a.top_p}")
    if a.top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {a.top_k}")
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    for name in ("depth", "speculate_k", "topk", "num_draft_tokens"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if a.draft_vocab is not None and a.draft_vocab < 0:
        raise UsageError(f"--draft-vocab must be >= 0, got {a.draft_vocab}")


def make_spec(a, target: Transformer, head: Optional[DraftHead]) -> Optional[TreeSpec]:
    """The cycle's shape. For eagle2, what --num-draft-tokens, --depth and --topk leave open is sized for
    this device (sizing.py)."""
    if a.speculate == "none":
        return None
    if a.speculate in ("sps", "lookup"):
        return TreeSpec(a.speculate, depth=a.speculate_k or a.depth or (4 if a.speculate == "sps" else 6), topk=1, num_draft_tokens=0)
    vocab = len(head.draft_vocab) or target.args.vocab_size
    if (a.topk or 10) > vocab:
        raise UsageError(f"--topk {a.topk} exceeds the draft vocabulary of {vocab}")
    if a.speculate == "eagle":
        return TreeSpec("eagle", depth=max(len(p) for p in spectree.EAGLE1_TREE), topk=10, num_draft_tokens=len(spectree.EAGLE1_TREE))
    m, depth, k = a.num_draft_tokens, a.depth, a.topk
    if m and depth and k:
        if m > k + (depth - 1) * k * k:
            raise UsageError(f"--num-draft-tokens {m} exceeds the {k + (depth - 1) * k * k} candidates of depth {depth} and topk {k}")
    else:
        try:
            m, depth, k = sizing.device_tree(target, head, m, depth, k, log=lambda s: print(s, file=sys.stderr),
                                             compile_fn=sizing_compile(target) if a.compile else None)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return TreeSpec("eagle2", depth=depth, topk=k, num_draft_tokens=m)


def load_drafter(a, target: Transformer):
    """The EAGLE head or the sps draft LLM that --speculate needs, on the target's device and dtype."""
    device, dtype = target.tok_embeddings.weight.device, target.tok_embeddings.weight.dtype
    if a.speculate in ("none", "lookup"):
        return None, None
    if a.speculate == "sps":
        if a.draft_checkpoint is None:
            raise UsageError("--speculate sps needs --draft-checkpoint DIR (a small LLM with the same vocabulary)")
        draft_model = load_model(a.draft_checkpoint, device, dtype)
        if draft_model.args.vocab_size != target.args.vocab_size:
            raise UsageError(f"draft vocabulary {draft_model.args.vocab_size} does not fit the target's {target.args.vocab_size}")
        return None, draft_model
    draft = a.draft or (DEFAULT_HEAD if a.checkpoint is None else None)
    if draft is None:
        raise UsageError("--speculate eagle/eagle2 needs --draft HEAD_DIR for this checkpoint")
    try:
        head = load_head(draft, target.args, device, dtype).eval()
        return use_draft_vocab(head, target.output, a.draft_vocab), None
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e).splitlines()[0]) from None


def setup(a):
    """CLI args -> (Generator, tokenizer, model args). Raises UsageError on bad input."""
    check_args(a)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    checkpoint = a.checkpoint
    if checkpoint is None:
        from convert_hf_checkpoint import default_checkpoint

        try:
            checkpoint = default_checkpoint()
        except FileNotFoundError as e:
            raise UsageError(str(e)) from None
    tp_rank = tp.maybe_init_dist()
    dtype = getattr(torch, a.dtype) if a.dtype else dtypes.default_dtype(device, log=lambda s: print(s, file=sys.stderr))
    # Under tensor parallelism the target is sharded on the CPU, so each GPU receives only its slice.
    target = load_model(checkpoint, "cpu" if tp_rank is not None else device, dtype)
    if tp_rank is not None:
        try:
            tp.apply_tp(target)
        except ValueError as e:
            raise UsageError(str(e)) from None
        target.to(device)
    head, draft_model = load_drafter(a, target)
    spec = make_spec(a, target, head)
    from tokenizer import load_tokenizer

    return Generator(target, spec, head, draft_model, compile=a.compile), load_tokenizer(checkpoint), target.args


def encode_prompt(tokenizer, args: ModelArgs, messages: list, chat: bool) -> list:
    from tokenizer import format_chat

    text = format_chat(args.chat_template if chat else "", messages)
    return ([args.bos_token] if args.bos_token is not None else []) + tokenizer.encode(text)


def main(argv=None) -> int:
    quiet = tp.rank() != 0  # every rank generates the same tokens; rank 0 alone prints them
    try:
        a = build_parser().parse_args(argv)
        gen, tokenizer, margs = setup(a)
        chat = a.chat if a.chat is not None else bool(margs.chat_template)
        prompt = encode_prompt(tokenizer, margs, [{"role": "user", "content": a.prompt}], chat)
        torch.manual_seed(a.seed)
        sampling = Sampling(a.temperature, a.top_k, a.top_p)
        stream = None
        if not a.json and not quiet:
            from tokenizer import StreamDecoder

            decoder, ids = StreamDecoder(tokenizer), []

            def stream(new):
                ids.extend(t for t in new if t not in margs.stop_tokens)
                print(decoder.push(ids), end="", flush=True)

        result = gen.generate(prompt, a.max_new_tokens, sampling, margs.stop_tokens, stream)
    except UsageError as e:
        if not quiet:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if quiet:
        return 0
    text = tokenizer.decode([t for t in result.token_ids if t not in margs.stop_tokens])
    metrics = result.metrics(gen.spec) | {"dtype": str(gen.target.tok_embeddings.weight.dtype).removeprefix("torch.")}
    if a.json:
        print(json.dumps({"text": text, "token_ids": result.token_ids, **metrics}))
    else:
        print()
        summary = ", ".join(f"{k} {v}" for k, v in metrics.items() if k not in ("accept_len_hist",))
        print(f"[{summary}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    tp.exit_with(main)
