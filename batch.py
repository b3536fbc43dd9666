# Several sequences at once through the single-sequence steps. Every buffer a step mutates (the target's and the
# drafter's KV caches, the SpecState) gets a per-row copy stacked along a new leading dim (Rows), and torch.vmap runs
# the unchanged step over the rows (batched): the head drafts n trees in one pass per level, the target verifies every
# row's tree in one forward, and each row accepts its own path, so every row is exactly what it would be alone. The
# weights are shared, never copied.
#
# Batch keeps the live rows at the front of the stack, so n live rows are the stack's first n, a view: a lone sequence
# runs the one-sequence steps on row 0, which is the models' own buffers (the command line's steps, at its speed); n >= 2
# run the batched steps, compiled once for every n (a dynamic batch dim), each reading the live width of its rows'
# caches (ops.live_width). The tree for n live rows is the Generator's trees[n] (sized by load: eaglet.tree_spec), or
# plain steps where speculating does not pay. Rows past the live ones keep finished sequences' caches: a new sequence
# that shares a prefix with any row's (a system prompt, a conversation sent again) prefills only what follows it.
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call swaps tensors with

import dtypes
import grammar
import ops
import sampling
from errors import UsageError
from sampling import KINDS, Sampling
from speculate import CHAINS


def cut(new: list, room: int, stop_ids: set) -> list:
    """A step's new tokens cut at the token limit (room tokens left) and after the first stop token."""
    new = new[:room]
    return next((new[: i + 1] for i, t in enumerate(new) if t in stop_ids), new)


def written(target, drafter, state) -> tuple:
    """The buffers a step writes, as three dicts {name: buffer}: the target's and the drafter's KV caches (and the rows
    where a tree's K/V wait: k_tree, v_tree), the SpecState."""
    names = ("k_cache", "v_cache", "k_tree", "v_tree")
    caches = lambda model: {} if model is None else {n: b for n, b in model.named_buffers() if n.endswith(names)}  # noqa: E731
    return caches(target), caches(drafter), dict(state.named_buffers()) if state is not None else {}


def slots_dim(name: str):
    """The dim of a buffer along which its slots (a sequence's positions) run: KV caches' dim 2, the history's 0; None
    for buffers copied whole (a tree's rows, the pending pairs, the counters)."""
    return 2 if name.endswith(("k_cache", "v_cache")) else 0 if name == "history" else None


def swap(module, row: dict):
    """The module reads and writes row's tensors in place of its own buffers of those names, inside the with."""
    return _reparametrize_module(module, row) if row else nullcontext()


class Rows:
    """count per-row copies of what a step writes, stacked along a new leading dim: self.rows, three dicts {buffer name:
    [count, ...]} in the order (target, drafter, state). Row 0 becomes the models' own buffers (a view), so the
    one-sequence steps run on it as they are."""

    def __init__(self, target, drafter, state, count: int):
        self.models, self.count = (target, drafter, state), count
        self.own = written(target, drafter, state)
        need, free = count * sum(b.numel() * b.element_size() for own in self.own for b in own.values()), dtypes.free_bytes(next(iter(self.own[0].values())).device)
        if free is not None and need > 0.9 * free:  # said now, not by the kernel's OOM killer halfway through
            raise UsageError(f"{count} rows of caches need {need / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB is free: fewer rows "
                             "(--batch-size, --cache-rows) or a shorter --context")
        self.rows = tuple({n: torch.zeros((count, *b.shape), dtype=b.dtype, device=b.device) for n, b in own.items()} for own in self.own)
        for model, own, rows in zip(self.models, self.own, self.rows):
            for n, b in own.items():
                rows[n][:].copy_(b)  # every row a state a step may run on (a lone sequence's second row: Batch.run)
                owner, _, attr = n.rpartition(".")
                model.get_submodule(owner).register_buffer(attr, rows[n][0], persistent=False)
        self.own = written(target, drafter, state)

    def fits(self, target, drafter, state, count: int) -> bool:
        """Whether these rows were made for count rows of these very buffers (reserve() replaces the caches it grows)."""
        now = written(target, drafter, state)
        return count <= self.count and all(a.keys() == b.keys() and all(a[n] is b[n] for n in a) for a, b in zip(self.own, now))

    def view(self, n: int) -> tuple:
        """The first n rows (views), their row dim dynamic to a compiled step: one graph for every n >= 2."""
        out = tuple({name: v[:n] for name, v in rows.items()} for rows in self.rows)
        for rows in out:
            for v in rows.values():
                torch._dynamo.mark_dynamic(v, 0, min=2, max=max(2, self.count))
        return out

    def at(self, i: int):
        """A with in which the models read and write row i's buffers (row 0 is theirs already)."""
        if i == 0:
            return nullcontext()
        stack = [swap(model, {n: v[i] for n, v in rows.items()}) for model, rows in zip(self.models, self.rows) if model is not None]

        class Both:
            def __enter__(self):
                for s in stack:
                    s.__enter__()

            def __exit__(self, *exc):
                for s in reversed(stack):
                    s.__exit__(*exc)
        return Both()

    def copy(self, src: int, dst: int, width: int, state: bool = True):
        """Row src into row dst: its caches' first width slots, and (state) the rest of what a step carries."""
        for part, rows in enumerate(self.rows):
            if part == 2 and not state:
                continue
            for name, v in rows.items():
                d = slots_dim(name.rpartition(".")[2])
                if d is None:
                    v[dst].copy_(v[src])
                else:
                    v[dst].narrow(d, 0, min(width, v.shape[d + 1])).copy_(v[src].narrow(d, 0, min(width, v.shape[d + 1])))

    def exchange(self, a: int, b: int, width: int):
        """Rows a and b trade places (their caches' first width slots, and their states)."""
        if a == b:
            return
        for rows in self.rows:
            for name, v in rows.items():
                d = slots_dim(name.rpartition(".")[2])
                ra, rb = (v[a], v[b]) if d is None else (x.narrow(d, 0, min(width, v.shape[d + 1])) for x in (v[a], v[b]))
                keep = ra.clone()
                ra.copy_(rb)
                rb.copy_(keep)


def batched(step):
    """step(target, drafter, state, *static) run over every row of rows at once -> fn(target, drafter, state, rows,
    *static) (rows: Rows.view's dicts); each row's output stacked."""

    def run(target, drafter, state, rows: tuple, *static):
        def one(target_row, drafter_row, state_row):
            with swap(target, target_row), swap(drafter, drafter_row), swap(state, state_row):
                return step(target, drafter, state, *static)

        return torch.vmap(one, randomness="different")(*rows)

    return run


# ---------------------------------------------------------------- the loop over live rows

@dataclass(eq=False)  # a Seq is itself alone
class Seq:
    """A sequence in the rows. commit(new tokens, accept_len or None) -> whether it goes on: called with its first token
    (accept_len None), then with each step's tokens, uncut (it cuts them at its own limits)."""
    prompt: list
    rule: Sampling
    key: int
    commit: Callable
    stream: list = field(default_factory=list)  # every token committed to the row's caches: prompt, then each step's
    n_pend: int = 0  # pairs the head has not read (speculate.SpecState.n_pend, mirrored)
    prefilled: int = 0  # prompt tokens the prefill ran over (the rest came from a cached prefix)
    tag: object = None  # the caller's own (engine.py: the request)
    logprobs: Optional[int] = None  # the top alternatives wanted beside each token's log-probability (None: none)
    scored: list = field(default_factory=list)  # with logprobs: sampling.logprobs of the tokens commit is given
    grammar: object = None  # what its tokens must follow (grammar.Grammar): each step's tokens followed (follow)


class Batch:
    """Live sequences in the first rows of a Generator's Rows, each step running all of them at once: the step and
    tree of their count (Generator.trees), the sampling kind the most demanding of them needs. add() puts a sequence in
    the next row; step() runs one step and commits every row's tokens; finished rows leave, the last live row moving
    into the place of each (live rows stay at the front). Rows past the live ones hold finished sequences, which a new
    sequence reuses for its longest shared prefix (add). counts: steps run, by tree and live rows."""

    def __init__(self, gen, rows: int, cached: int = 0):
        self.gen, self.size = gen, rows
        self.rows = gen.rows_for(max(rows + cached, 2))  # a lone sequence's batched steps run beside a second row
        self.live: list = []
        self.held = [([], 0, 0)] * self.rows.count  # each row's (stream, target slots valid, head pairs valid)
        self.used = list(range(self.rows.count))  # rows past the live ones, least recently used first
        self.counts = {}
        self.prefill_seconds = 0.0

    @property
    def full(self) -> bool:
        return len(self.live) >= self.size

    @torch.inference_mode()
    def add(self, seq: Seq) -> bool:
        """seq into row len(live): prefilled from the longest prefix any row holds, its first token drawn and committed.
        -> whether it goes on (a first token may end it)."""
        gen, b = self.gen, len(self.live)
        start, src = self.best_prefix(seq.prompt)
        # the row the sequence takes: a finished one holding its prefix, else the least recently used finished one
        place = src if start and src >= b else next(r for r in self.used if r >= b)
        self.rows.exchange(place, b, max(self.held[place][1], self.held[b][1]) + 1)
        self.held[place], self.held[b] = self.held[b], self.held[place]
        if start and src < b:  # a live row's prefix: its caches' first slots copied
            self.rows.copy(src, b, start, state=False)
        self.touch(b)
        with self.rows.at(b):
            first, seconds = gen.begin(seq.prompt, seq.rule, seq.key, start, seq.grammar)
            self.score(seq, gen.state.out_path, [first])
        if seq.grammar is not None:
            seq.grammar.consume([first])
            self.rows.rows[2]["allowed"][b].fill_(True)  # in_graph: set before each step; else each step's tokens followed
        self.prefill_seconds += seconds
        seq.prefilled, seq.stream, seq.n_pend = len(seq.prompt) - start, seq.prompt + [first], 1
        self.live.append(seq)
        if seq.commit([first], None):
            return True
        self.leave([b])
        return False

    def in_graph(self, seq: Seq) -> bool:
        """Whether seq's grammar masks its draws inside the steps (plain ones, the next token's mask each) rather than
        checking what a step drew (follow): where top-k or top-p truncate (a mask changes which tokens they keep) and
        in the chain modes."""
        rule, spec = seq.rule, self.gen.spec
        return seq.grammar is not None and (rule.temperature > 0 and (rule.top_k > 0 or rule.top_p < 1) or spec is not None and spec.mode in CHAINS)

    def follow(self, b: int, seq: Seq, new: list, accept_len: int) -> tuple:
        """A step's tokens for row b as seq's grammar allows them: all, or those before the first it refuses, and then
        the target's draw there restricted to the grammar (grammar.redraw). Exact: where the target's own draw is a
        token the grammar allows, it is also the draw restricted to the grammar (an argmax over fewer tokens that hold
        it). -> (tokens, drafts accepted)."""
        j = seq.grammar.valid(new)
        seq.grammar.consume(new[:j])
        if j == len(new) or self.in_graph(seq):
            return new, accept_len
        with self.rows.at(b):
            token = grammar.redraw(self.gen, new, j, seq.rule, seq.grammar)
        seq.grammar.consume([token])
        return new[:j] + [token], j

    def score(self, seq: Seq, states, new: list):
        """seq.scored for its new tokens, where it wants logprobs: the target's, from the states that drew them."""
        if seq.logprobs is not None:
            seq.scored = sampling.logprobs(self.gen.target.output, states.to(self.gen.target.tok_embeddings.weight.dtype), new, seq.logprobs)

    def best_prefix(self, prompt: list) -> tuple:
        """(prefill start, row) of the row holding the longest usable prefix of prompt (start 0: none)."""
        pairs = self.gen.head is not None
        best = (0, len(self.live))
        for r, (stream, target_held, head_held) in enumerate(self.held_now()):
            start = reuse_start(prompt, stream, target_held, head_held, pairs) if stream and self.gen.draft_model is None else 0
            best = max(best, (start, r), key=lambda s: s[0])
        return best

    def held_now(self) -> list:
        """Every row's (stream, target slots valid, head pairs valid): the live rows' as they stand."""
        held = list(self.held)
        for r, seq in enumerate(self.live):
            L = len(seq.stream) - 1
            held[r] = (seq.stream, L, L - seq.n_pend)
        return held

    def touch(self, r: int):
        self.used.remove(r)
        self.used.append(r)

    def leave(self, rows: list):
        """The sequences of these rows are done: each row keeps its caches for later prefixes, and the last live row
        takes its place."""
        for b in sorted(rows, reverse=True):
            seq, last = self.live[b], len(self.live) - 1
            L = len(seq.stream) - 1
            self.held[b] = (seq.stream[:L], L, L - seq.n_pend)
            if b != last:
                width = max(self.held[b][1], len(self.live[last].stream)) + 1
                self.rows.exchange(b, last, width)
                self.held[b], self.held[last] = self.held[last], self.held[b]
                self.live[b] = self.live[last]
            self.live.pop()
            self.touch(last)

    def plan(self) -> tuple:
        """(step name, tree spec, kind) of the next step for the live rows. A lone greedy sequence runs the Generator's
        own one-sequence cycle (or plain step): the command line's. Otherwise the batched steps, compiled once for any
        number of rows: their trees the Generator's trees for this many rows (None: plain steps), their kind "sample",
        whose draws are the argmax at T = 0, or "truncate" where a row has top-k or top-p, whose rows take plain steps.
        sps and lookup always run their chain."""
        gen, n = self.gen, len(self.live)
        kind = max((s.rule.kind for s in self.live), key=KINDS.index)
        if any(map(self.in_graph, self.live)):  # one mask a row: the next token's
            return "plain", gen.spec, "truncate"
        if n == 1 and kind == "greedy":
            return ("cycle" if gen.spec is not None else "plain"), gen.spec, kind
        if gen.spec is None:
            return "plain", None, "truncate" if kind == "truncate" else "sample"
        if gen.spec.mode in CHAINS:
            return "cycle", gen.spec, "truncate" if kind == "truncate" else "sample"
        tree = None if kind == "truncate" else gen.trees.get(n, gen.trees[max(gen.trees)]) if n > 1 else gen.trees.get(2, gen.spec)
        return ("cycle", tree, "sample") if tree is not None else ("plain", gen.spec, "truncate" if kind == "truncate" else "sample")

    @torch.inference_mode()
    def step(self) -> int:
        """One step of every live row: catch-up first where pending pairs would overflow, then the plan's step (plan);
        every row's tokens committed. -> the live rows it ran."""
        gen, n = self.gen, len(self.live)
        name, spec, kind = self.plan()
        if gen.head is not None:
            room = spec.depth + 1 if name == "cycle" else gen.state.pend_tok.shape[0] - 1
            if any(s.n_pend > room for s in self.live):
                self.run("catch_up", gen.spec, "any")
                for s in self.live:
                    s.n_pend = 1
        for b, seq in enumerate(self.live):
            self.in_graph(seq) and seq.grammar.allowed(self.rows.rows[2]["allowed"][b])
        chunks = self.run(name, spec, kind)
        label = describe(spec) if name == "cycle" else "plain"
        self.counts[(label, n)] = self.counts.get((label, n), 0) + 1
        done = []
        for b, (seq, chunk) in enumerate(zip(self.live, chunks)):
            if spec is not None and spec.mode == "lookup":
                chunk = chunk[:-1]  # whether the next cycle has a match: a batch's lookup rows always draft
            accept_len, new = chunk[0], chunk[1:chunk[0] + 2]
            if seq.grammar is not None:
                new, accept_len = self.follow(b, seq, new, accept_len)
            self.score(seq, self.rows.rows[2]["out_path"][b], new)
            seq.stream += new
            seq.n_pend = accept_len + 1 if name == "cycle" else seq.n_pend + 1
            if not seq.commit(new, accept_len if name == "cycle" else None):
                done.append(b)
        self.leave(done)
        return n

    def run(self, name: str, spec, kind: str) -> list:
        """The step over the live rows -> each row's output. One-sequence steps run on row 0 (the models' own buffers);
        a lone sequence that needs a batched step runs with the next row as a second, whose state is put back after
        (its writes land past what it holds: a finished sequence's cached prefix stays intact)."""
        gen, n = self.gen, len(self.live)
        if n == 1 and kind == "greedy":
            return [gen.step(name, kind, spec)(gen.target, gen.drafter, gen.state, spec, kind).tolist()]
        rows = self.rows.view(max(n, 2))
        kept = {k: v[1].clone() for k, v in rows[2].items()} if n == 1 else None
        out = gen.step(name, kind, spec, rows)(gen.target, gen.drafter, gen.state, rows, spec, kind).tolist()
        if kept is not None:
            for k, v in kept.items():
                rows[2][k][1].copy_(v)
        return out[:n]


def reuse_start(prompt: list, stream: list, target_held: int, head_held: int, pairs: bool) -> int:
    """Where a prefill of prompt starts on caches that hold stream's first target_held tokens (and a head its first
    head_held pairs): at the first token that differs, at least one token before the prompt's end; with a head (pairs)
    the token before it is read again, since the head's next pair needs its feature."""
    common = next((i for i, (a, b) in enumerate(zip(prompt, stream)) if a != b), min(len(prompt), len(stream)))
    return max(0, min(common - pairs, target_held, head_held if pairs else target_held, len(prompt) - 1))


def describe(spec) -> str:
    """A tree spec in the counts and logs: m, depth, k (and lookup slots)."""
    if spec.mode in CHAINS:
        return f"{spec.mode} k{spec.depth}"
    return f"{spec.mode} m{spec.num_draft_tokens} d{spec.depth} k{spec.topk}" + (f" +{spec.lookup_slots}" if spec.lookup_slots else "")


@torch.inference_mode()
def generate(gen, prompts: list, max_new_tokens: int, rule: Sampling, stop_ids: set, batch_size: int, keys: list) -> tuple:
    """Generator.generate_batch's loop over batch_size rows (0: one per prompt). A row whose answer is done takes the
    next waiting prompt, so the rows stay full until the prompts run out: a batch is not held to its slowest answer.
    -> ([(token ids, accept-length histogram) per prompt], seconds, prefill seconds)."""
    gen.reserve(max(map(len, prompts)) + max_new_tokens)
    B = min(batch_size or len(prompts), len(prompts))
    outs, hists = [[] for _ in prompts], [[0] * ((gen.spec.depth + 1) if gen.spec else 1) for _ in prompts]

    def committer(i):
        def commit(new: list, accept_len) -> bool:
            if accept_len is not None:
                hists[i][accept_len] += 1
            outs[i] += cut(new, max_new_tokens - len(outs[i]), stop_ids)
            return len(outs[i]) < max_new_tokens and outs[i][-1] not in stop_ids
        return commit

    batch = Batch(gen, B)
    sync = dtypes.synchronizer(gen.device)
    sync()
    t0 = time.perf_counter()
    waiting = list(enumerate(prompts))
    with ops.pacing(gen.device) as pace:
        while waiting or batch.live:
            while waiting and not batch.full:
                i, prompt = waiting.pop(0)
                batch.add(Seq(prompt, rule, keys[i], committer(i)))
            if batch.live:
                pace()  # the threads the machine's load leaves (cpu/threads.py)
                batch.step()
    sync()
    return list(zip(outs, hists)), time.perf_counter() - t0, batch.prefill_seconds
