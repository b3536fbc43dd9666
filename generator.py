# Running a Generator: Generator.generate decodes a prompt a token per step (vanilla) or a speculative cycle per step
# (speculate.py) until the answer is done; generate_batch answers several prompts at once (batch.py). eaglet.py builds one
# (load_generator); read speculate.py next.
import functools
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

import batch
import dtypes
import ops
import sampling
import tp
from checkpoint import check_prompts, check_sampling
from compiling import compiled, faster
from draft import DraftHead, use_draft_vocab
from model import Transformer, causal_mask, find_multiple, layer_region, setup_tree
from quant import QuantLinear
from sampling import Sampling
from speculate import CHAINS, SpecState, TreeSpec, catch_up, draft_context, lookup_cycle, lookup_step, plain_step, sps_cycle, tree_cycle
from tokenizer import encode_prompt

GREEDY = Sampling()
RULES = {"greedy": GREEDY, "sample": Sampling(1.0), "truncate": Sampling(1.0, top_p=0.9)}  # a rule of each kind (warm-ups)
# Pending (feature, token) pairs a sequence may gather while its batch takes plain steps, before the head reads them
# (speculate.catch_up): a catch-up every this many tokens, over this many rows.
PLAIN_ROOM = 32


log_stderr = functools.partial(print, file=sys.stderr)


# ---------------------------------------------------------------- the prefill

def prefill(model: Transformer, prompt: Tensor, start: Tensor, layered: bool = False) -> tuple:
    """prompt [1, T] at positions start.. -> (post-norm hidden states [T, dim], draft features [T, *]); fills KV
    slots [start, start + T), attending to the slots before start (a conversation's earlier turns)."""
    pos = start + torch.arange(prompt.shape[1], device=prompt.device)
    h, feat = model.hidden(prompt, pos, pos, causal_mask(pos, model.max_seq_length), layer_region if layered else None)
    return h[0], feat[0]


def layered_prefill(model: Transformer, prompt: Tensor, start: Tensor) -> tuple:
    """prefill compiled a layer's graph at a time (model.hidden's run_layer): a CPU's packaged prefill."""
    return prefill(model, prompt, start, layered=True)


def step_function(spec: Optional[TreeSpec], name: str):
    """The code of a step: "cycle" (the mode's), "plain" (one token without drafts: lookup's own when the text has no
    match) or "catch_up" (the head reads the pairs plain steps queued)."""
    if name == "plain":
        return lookup_step if spec is not None and spec.mode == "lookup" else plain_step
    if name == "catch_up":
        return catch_up
    return {"sps": sps_cycle, "lookup": lookup_cycle}.get(spec.mode, tree_cycle)


# ---------------------------------------------------------------- results

@dataclass
class Result:
    token_ids: list
    seconds: float
    cycles: int = 0
    accept_hist: Optional[list] = None  # cycles that accepted 0, 1, ... depth draft tokens
    prefilled: int = 0  # prompt tokens the prefill ran over (fewer than the prompt's when a conversation was reused)
    prefill_seconds: float = 0.0

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
    return dict(cycles=cycles, mean_accept_len=round(cycle_tokens / cycles, 4),  # tau: tokens per target forward, bonus included
                accept_len_hist=hist,
                accept_rate_per_depth=[round(reached[d] / reached[d - 1], 4) if reached[d - 1] else 0.0 for d in range(1, len(hist))])


def rule_key(seed: Optional[int]) -> int:
    """The key of an answer's Gumbels (sampling.py): its seed's, or a fresh one from torch's generator."""
    return sampling.key_of(seed) if seed is not None else sampling.random_key("cpu")


# ---------------------------------------------------------------- generation

class Generator:
    """Owns the models, their caches, the state a step carries (SpecState) and the (optionally compiled) steps.
    trees: {live rows: TreeSpec, or None for plain steps}, the trees a batch (batch.py) runs at each load; the
    state and the caches have room for the largest."""
    # target -> (owner's kv_key, tokens its KV holds); off the module, whose changed __dict__ would slow every guard check
    kv_streams = weakref.WeakKeyDictionary()

    def __init__(self, target: Transformer, spec: Optional[TreeSpec] = None, head: Optional[DraftHead] = None,
                 draft_model: Optional[Transformer] = None, compile: bool = False, tokenizer=None, trees: Optional[dict] = None):
        self.target, self.spec, self.head, self.draft_model, self.tokenizer = target, spec, head, draft_model, tokenizer  # tokenizer: chat()'s
        self.drafter = head if head is not None else draft_model  # what a cycle drafts with
        self.kv_key = object()  # marks the target's caches as this Generator's (a copied target's never match)
        self.device = target.tok_embeddings.weight.device
        if head is not None and len(head.draft_vocab) and head.lm_head is None:
            use_draft_vocab(head, target.output)  # a head loaded with load_head alone drafts over its vocabulary too
        # A head with taps (EAGLE-3, EAGLE-1/2 with fused input) reads the states entering them, from prefill and verify
        self.taps = target.taps = head.taps if head is not None else ()
        self.trees = dict(trees or {1: spec})
        specs = [s for s in (spec, *self.trees.values()) if s is not None]
        pending = max([s.depth + 1 for s in specs] + [PLAIN_ROOM if head is not None and None in self.trees.values() else 0])
        self.state = SpecState(spec, target.args.dim * (len(self.taps) or 1), self.device, pending, max((s.scratch for s in specs), default=0),
                               target.args.dim, max([s.depth + 1 for s in specs] + [1]), target.args.vocab_size)
        self.verify_rows = max((s.verify_len for s in specs if s.mode not in CHAINS), default=0)
        # The one place a backend enters (ops.py): it readies the weights (on a CPU, cpu/ packs them for its kernels).
        self.compile, self.frozen = compile, ops.prepare(compile, target, head, draft_model)
        # A backend may build the steps before an answer (on a CPU compiled once per machine and saved); else (CUDA
        # graphs, --compile max's frozen weights) each step compiles at its first call, as torch.compile does.
        self.precompile = ops.step_compiler(self.device, self.frozen) if compile and tp.world_size() == 1 else None
        self.packaged, self.built, self.compile_seconds = self.precompile is not None, set(), 0.0
        self.bound = {}  # (name, kind, spec, batched, cache length) -> the step, as step() built it
        self.rows = None  # batch.Rows: per-row copies of the buffers, for batch.Batch (rows_for)
        self.quantised = any(isinstance(m, QuantLinear) for m in target.modules())

    # ------------------------------------------------ the steps

    def step(self, name: str, kind: str, spec=..., rows: Optional[tuple] = None, log=log_stderr, check: bool = False):
        """The step `name` ("prefill", "cycle", "plain", "catch_up") for rules of `kind` (sampling.KINDS) and tree spec
        (default: this Generator's): one sequence's, run on the models' own buffers, or with rows (batch.Rows.view: the
        per-row buffers of n >= 2 sequences, n marked dynamic) every row's at once under torch.vmap (batch.batched).
        Compiled when this Generator compiles (packaged steps now, or loaded; others at their first call), eager
        otherwise. The one place a Generator binds its steps; check: time the compiled one-sequence step against its
        eager code on the current state and keep the faster (compiling.faster)."""
        spec = self.spec if spec is ... else spec
        if name in ("prefill", "catch_up"):
            kind, spec = "any", (None if name == "prefill" else spec)  # one for every rule
        key = (name, kind, spec, rows is not None, self.target.max_seq_length)  # a compiled step's sizes are its caches'
        if key in self.bound and not check:
            return self.bound[key]
        if name == "prefill":
            fn, args = (layered_prefill if self.packaged else prefill), self.prefill_args()
        else:
            fn = step_function(spec, name)
            args = (self.target, self.drafter, self.state, spec, kind)
            if rows is not None:
                fn, args = batch.batched(fn), (self.target, self.drafter, self.state, rows, spec, kind)
        if check:
            eager = batch.batched(step_function(spec, name)) if rows is not None else step_function(spec, name)
            self.bound[key] = faster(self.bound[key], eager, args, log)
            return self.bound[key]
        if not self.compile or (self.quantised and (rows is not None or name == "prefill")):
            step = fn  # a quantised target's prefill and batched steps miscompile under Inductor (torch 2.13): eager
        elif self.packaged:
            label = "prefill" if name == "prefill" else f"{kind}_{name}" + ("_batched" if rows is not None else "")
            step, seconds = self.precompile(label, fn, args, True if name == "prefill" else None if rows is not None else False,
                                            log, fn is layered_prefill)
            self.compile_seconds += seconds
        else:
            mode = "reduce-overhead" if self.device.type == "cuda" else None  # reduce-overhead = CUDA graphs
            step = compiled(fn, self.device, self.frozen, dynamic=True if name == "prefill" else None if rows is not None else False,
                            mode=None if name == "prefill" else mode)
        self.bound[key] = step
        return step

    def prefill_args(self) -> tuple:
        prompt, start = torch.zeros(1, 8, dtype=torch.long, device=self.device), torch.tensor(0, device=self.device)
        return self.target, prompt, start

    def build(self, kind: str = "greedy", log=log_stderr):
        """Every step generate() runs for rules of this kind and this cache size, compiled now (or loaded from the last
        process that compiled it), then warmed up: nothing compiles inside an answer. Compiles nothing unless the steps
        are packaged (a GPU's compile at their first call)."""
        self.target.taps = self.taps  # another Generator may share the target: the steps run with this one's features
        self.reserve(1)  # the caches and cycle buffers every step reads, at least at their smallest size
        if not self.packaged or (kind, self.target.max_seq_length) in self.built:
            return
        names = ["prefill"] + (["cycle"] if self.spec else []) + (["plain"] if not self.spec or self.spec.mode == "lookup" else [])
        for name in names:
            self.step(name, kind, log=log)
        self.built.add((kind, self.target.max_seq_length))
        self.warm_up(kind, names, log)

    @torch.inference_mode()
    def warm_up(self, kind: str, names: list, log=log_stderr):
        """A two-token answer through the steps just built or loaded, so that a step's first call (the loaded code's first
        run, its buffers' first touch) is paid here, not in the first real answer; then each compiled step timed against
        its eager code, and dropped if it ran slower here. The random state is put back; nothing of this is reused."""
        with torch.random.fork_rng(devices=[]):
            self.answer([0] * 8, 2, RULES[kind], set())
            for name in names[1:]:
                self.step(name, kind, log=log, check=True)
        self.kv_streams[self.target] = (None, [])

    # ------------------------------------------------ caches and state

    @torch.inference_mode(False)  # buffers made alike in and out of generate: an inference tensor fails compiled guards
    def reserve(self, max_len: int) -> bool:
        """Caches for a prompt plus new tokens of max_len, with room for a verify, a commit and the pending pairs the head
        reads at once. -> True when the target's caches were reallocated (and hold nothing any more)."""
        before = self.target.max_seq_length
        extra = (max(self.verify_rows, self.state.pend_tok.shape[0]) + self.spec.depth + 2) if self.spec else 1
        # Rounded up and only grown: compiled steps see few cache shapes (packaged ones, each a compile: fewer still).
        length = find_multiple(max_len + extra, 2048 if self.packaged else 256)
        if self.target.max_seq_length < length:
            self.target.setup_caches(length)
        if self.verify_rows:
            setup_tree(self.target.layers, self.verify_rows)  # (again) after new caches: where a verify's tree waits
        if self.head is not None and self.head.max_seq_length != self.target.max_seq_length:
            self.head.setup_caches(self.target.max_seq_length, dtype=self.target.tok_embeddings.weight.dtype)
        if self.head is not None:
            setup_tree(self.head.layers, max(1, self.state.scratch_eye.shape[0] if hasattr(self.state, "scratch_eye") else self.spec.scratch))
        if self.draft_model is not None and self.draft_model.max_seq_length != self.target.max_seq_length:
            self.draft_model.setup_caches(self.target.max_seq_length)
        history = any(s is not None and s.history for s in (self.spec, *self.trees.values()))
        if history and getattr(self.state, "history", torch.empty(0)).shape[0] != self.target.max_seq_length:
            self.state.register_buffer("history", torch.zeros(self.target.max_seq_length, dtype=torch.long, device=self.device))
        return self.target.max_seq_length != before

    def rows_for(self, count: int) -> "batch.Rows":
        """Per-row copies of every buffer a step writes, for count sequences at once (batch.Batch); kept while they fit."""
        if self.rows is None or not self.rows.fits(self.target, self.drafter, self.state, count):
            self.rows = batch.Rows(self.target, self.drafter, self.state, count)
        self.kv_streams[self.target] = (None, [])  # the rows' sequences will overwrite what the caches hold
        return self.rows

    def reusable(self, prompt: list) -> int:
        """How many leading prompt tokens the caches already hold from this Generator's last answer (a chat's
        earlier turns): the target's KV up to the last token it read, and for a head its draft context pairs."""
        owner, stream = self.kv_streams.get(self.target, (None, []))
        if owner is not self.kv_key or self.draft_model is not None:  # another Generator used the target since; sps: no reuse
            return 0
        if self.head is not None:  # write the pairs still pending into the draft's context: it then holds all L pairs
            draft_context(self.target, self.head, self.state, self.state.pend_tok.shape[0])
        L = int(self.state.L)
        return batch.reuse_start(prompt, stream, L, L, self.head is not None)

    def start(self, prompt: Tensor, feats: Tensor, root: Tensor, start: int = 0):
        """The state after a prefill of prompt[start:] (KV slots [start, T)) drew its first token, root: L = T, the pair
        (last feature, root) pending; the head reads the pairs of prompt[start:] (the draft's context: feature f_j with
        token x_{j+1}); an sps draft model prefills the prompt but its last token."""
        st, T = self.state, prompt.shape[1]
        st.L.fill_(T)
        st.root.copy_(root.view(1))
        if self.spec is None:
            return
        st.prev.copy_(prompt[0, -1:])
        st.n_pend.fill_(1)
        st.pend_tok[0] = root
        st.pend_feat[0] = feats[-1].float()
        if hasattr(st, "history"):
            st.history[:T] = prompt[0]
            st.history[T] = root
        if self.head is not None and T - 1 > start:
            pos = torch.arange(start, T - 1, device=self.device)
            self.head(prompt[:, start + 1:], self.target.tok_embeddings.weight, feats[None, :-1], pos, pos, causal_mask(pos, self.head.max_seq_length))
        if self.draft_model is not None and T > 1:
            prefill(self.draft_model, prompt[:, :-1], torch.tensor(0, device=self.device))

    def begin(self, prompt: list, rule: Sampling, key: int, start: int = 0, grammar=None) -> tuple:
        """A sequence into the models' own buffers: prefill prompt[start:] (the slots before hold it already), draw its
        first token with rule and key (and grammar's mask: grammar.py), set the state (start). -> (first token, seconds)."""
        sync = dtypes.synchronizer(self.device)
        t0 = time.perf_counter()
        self.state.set_rule(rule, key, grammar)
        kind = rule.kind if grammar is None else "truncate"  # truncate's draws read the grammar's mask (sampling.shaped)
        x = torch.tensor([prompt], device=self.device)
        h, feats = self.step("prefill", rule.kind)(self.target, x[:, start:].contiguous(), torch.tensor(start, device=self.device))
        at = torch.tensor(len(prompt), device=self.device)
        noise = sampling.noise(self.state, at, 1, self.target.args.vocab_size) if kind != "greedy" else None
        first = sampling.lm_head_draw(self.target.output, h[-1:], kind, self.state, noise)
        self.state.out_path[:1].copy_(h[-1:])
        sampling.count(self.state, first, torch.ones_like(first))
        self.start(x, feats, first, start)
        first = int(first)
        sync()
        return first, time.perf_counter() - t0

    # ------------------------------------------------ answers

    @torch.inference_mode()
    def generate(self, prompt: list, max_new_tokens: int = 200, sampling: Sampling = GREEDY, stop_ids=None, on_tokens=None,
                 lap=None, reuse: bool = False, seed: Optional[int] = None) -> Result:
        """Token ids of the answer to prompt (token ids), up to and including a stop token (default: the model's).
        on_tokens(new ids) is called as tokens are committed (streaming). lap(name, **cycle_tensors): run the cycle
        eagerly and call lap at the end of each phase (bench.py's split); see tree_cycle. reuse: prefill only what the
        caches do not hold yet from this Generator's last prompt and answer (a chat's next turn); the answer is the same.
        seed: the draws at T > 0 are a function of it (the same seed, the same answer, whichever mode or batch); without
        one, of torch's generator."""
        self.check([prompt], max_new_tokens, stop_ids, sampling)
        fresh = self.reserve(len(prompt) + max_new_tokens)
        self.build(sampling.kind)  # before the first token; compiles only for a new kind of rule or cache size
        stop_ids = set(self.target.args.stop_tokens if stop_ids is None else stop_ids)
        return self.answer(prompt, max_new_tokens, sampling, stop_ids, on_tokens, lap, reuse and not fresh, rule_key(seed))

    def answer(self, prompt: list, max_new_tokens: int, rule: Sampling, stop_ids: set, on_tokens=None, lap=None,
               reuse: bool = False, key: int = 0) -> Result:
        """generate() once its input is checked and its caches and steps are ready."""
        kind = rule.kind
        with ops.pacing(self.device) as pace:  # the threads the machine's load leaves (cpu/threads.py)
            pace()
            sync = dtypes.synchronizer(self.device)
            sync()
            t0 = time.perf_counter()
            start = self.reusable(prompt) if reuse else 0
            self.kv_streams[self.target] = (None, [])  # until this answer is done (an interrupted one leaves nothing to reuse)
            first, prefill_seconds = self.begin(prompt, rule, key, start)
            lap and lap("prefill")
            out = [first]
            on_tokens and on_tokens(out[:])
            hist = [0] * ((self.spec.depth + 1) if self.spec else 1)
            cycles, drafts = 0, True  # lookup: whether the text has a match to draft from
            name = "cycle" if self.spec else "plain"
            args = (self.target, self.drafter, self.state, self.spec, kind)
            committed = prompt + out
            while len(out) < max_new_tokens and out[-1] not in stop_ids:
                pace()
                step_name = name if drafts else "plain"
                chunk = (step_function(self.spec, step_name)(*args, lap) if lap else self.step(step_name, kind)(*args)).tolist()
                if self.spec is not None and self.spec.mode == "lookup":
                    drafts = bool(chunk.pop())
                accept_len, new = chunk[0], chunk[1:chunk[0] + 2]
                if self.spec:
                    hist[accept_len] += 1
                    cycles += 1
                committed += new
                new = batch.cut(new, max_new_tokens - len(out), stop_ids)
                out += new
                on_tokens and on_tokens(new)
            sync()
            self.kv_streams[self.target] = (self.kv_key, committed)
            return Result(out, time.perf_counter() - t0, cycles, hist if self.spec else None, len(prompt) - start, prefill_seconds)

    def check(self, prompts: list, max_new_tokens: int, stop_ids=None, rule: Sampling = GREEDY):
        check_prompts(self.target.args, prompts, max_new_tokens, stop_ids)  # UsageError before torch sees them
        check_sampling(**vars(rule) | {"logit_bias": dict(rule.logit_bias)}, vocab_size=self.target.args.vocab_size)

    def generate_batch(self, prompts: list, max_new_tokens: int = 200, sampling: Sampling = GREEDY, stop_ids=None, batch_size: int = 0,
                       seeds: Optional[list] = None) -> list:
        """Answers to several prompts, batch_size rows at a time (0: all; batch.py): one forward for every row's step or
        tree, a row that is done taking the next waiting prompt. Each answer is what generate() gives its prompt alone
        (with its seed, the same tokens at T > 0). -> a Result per prompt, in order (seconds: the whole run's)."""
        self.check(prompts, max_new_tokens, stop_ids, sampling)
        stop_ids = set(self.target.args.stop_tokens if stop_ids is None else stop_ids)
        seeds = seeds or [None] * len(prompts)
        rows, seconds, prefill_seconds = batch.generate(self, prompts, max_new_tokens, sampling, stop_ids, batch_size,
                                                        [rule_key(s) for s in seeds])
        return [Result(out, seconds, sum(hist) if self.spec else 0, hist if self.spec else None, len(prompt), prefill_seconds)
                for (out, hist), prompt in zip(rows, prompts)]

    def chat(self, messages, max_new_tokens: int = 200, sampling: Sampling = GREEDY, chat: bool = True) -> tuple:
        """messages: a user turn (str) or a conversation [{"role", "content"}] -> (answer text, Result)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        args = self.target.args
        result = self.generate(encode_prompt(self.tokenizer, args, messages, chat), max_new_tokens, sampling)
        return self.tokenizer.decode([t for t in result.token_ids if t not in args.stop_tokens]), result
