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
import tp
from checkpoint import check_prompts, check_sampling
from compiling import compiled, faster
from draft import DraftHead, use_draft_vocab
from model import Transformer, causal_mask, find_multiple, layer_region, setup_tree
from sampling import Sampling
from speculate import CHAINS, SpecState, TreeSpec, draft_context, lookup_cycle, lookup_step, sps_cycle, tree_cycle
from tokenizer import encode_prompt

GREEDY = Sampling()


log_stderr = functools.partial(print, file=sys.stderr)


# ---------------------------------------------------------------- the steps a Generator compiles

def prefill(model: Transformer, prompt: Tensor, start: Tensor, layered: bool = False) -> tuple:
    """prompt [1, T] at positions start.. -> (post-norm hidden states [T, dim], draft features [T, *]); fills KV
    slots [start, start + T), attending to the slots before start (a conversation's earlier turns)."""
    pos = start + torch.arange(prompt.shape[1], device=prompt.device)
    h, feat = model.hidden(prompt, pos, pos, causal_mask(pos, model.max_seq_length), layer_region if layered else None)
    return h[0], feat[0]


def layered_prefill(model: Transformer, prompt: Tensor, start: Tensor) -> tuple:
    """prefill compiled a layer's graph at a time (model.hidden's run_layer): a CPU's packaged prefill."""
    return prefill(model, prompt, start, layered=True)


def decode_one(model: Transformer, token: Tensor, pos: Tensor, sampling: Sampling) -> Tensor:
    h, _ = model.hidden(token.view(1, 1), pos, pos, causal_mask(pos, model.max_seq_length))
    return ops.lm_head_draw(model.output, h[0, -1], sampling).view(1)


def decode_row(target: Transformer, _drafter, _state, token: Tensor, pos: Tensor, sampling: Sampling) -> Tensor:
    """decode_one as batch.batched runs it: one row's token [1] at its position [1]."""
    return decode_one(target, token, pos, sampling)


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


# ---------------------------------------------------------------- generation

class Generator:
    """Owns the models, their caches and the (optionally compiled) step functions."""
    # target -> (owner's kv_key, tokens its KV holds); off the module, whose changed __dict__ would slow every guard check
    kv_streams = weakref.WeakKeyDictionary()

    def __init__(self, target: Transformer, spec: Optional[TreeSpec] = None, head: Optional[DraftHead] = None,
                 draft_model: Optional[Transformer] = None, compile: bool = False, tokenizer=None):
        self.target, self.spec, self.head, self.draft_model, self.tokenizer = target, spec, head, draft_model, tokenizer  # tokenizer: chat()'s
        self.drafter = head if head is not None else draft_model  # what a cycle drafts with
        self.kv_key = object()  # marks the target's caches as this Generator's (a copied target's never match)
        self.device = target.tok_embeddings.weight.device
        if head is not None and len(head.draft_vocab) and head.lm_head is None:
            use_draft_vocab(head, target.output)  # a head loaded with load_head alone drafts over its vocabulary too
        # A head with taps (EAGLE-3, EAGLE-1/2 with fused input) reads the states entering them, from prefill and verify
        self.taps = target.taps = head.taps if head is not None else ()
        self.state = SpecState(spec, target.args.dim * (len(self.taps) or 1), self.device) if spec else None
        self.prefill, self.decode_one = prefill, decode_one
        self.cycle = self.eager_cycle = {"sps": sps_cycle, "lookup": lookup_cycle}.get(spec.mode, tree_cycle) if spec else None
        self.plain_cycle = lookup_step
        # generate_batch's steps: every row's cycle (lookup: always with drafts) or decode step in one vmapped call
        self.rows, self.batch_cycle = None, batch.batched(self.cycle) if spec else None
        self.batch_step = batch.batched(decode_row)
        # The one place a backend enters (ops.py): it readies the weights (on a CPU, cpu/ packs them for its kernels).
        frozen = ops.prepare(ops.choose(compile, target, log_stderr), target, head, draft_model)
        # A backend may build the steps before an answer (build(): on a CPU compiled once per machine and saved); else
        # (CUDA graphs, --compile max's frozen weights) each step compiles at its first call, as torch.compile does.
        self.precompile = ops.step_compiler(self.device, frozen) if compile and tp.world_size() == 1 else None
        self.packaged, self.built, self.compile_seconds = self.precompile is not None, None, 0.0
        if compile:
            mode = "reduce-overhead" if self.device.type == "cuda" else None  # reduce-overhead = CUDA graphs
            if not self.packaged:
                self.prefill = compiled(prefill, self.device, frozen, dynamic=True)
                self.decode_one = compiled(decode_one, self.device, frozen, mode=mode)
            if spec:
                self.batch_cycle = compiled(self.batch_cycle, self.device, frozen, mode=mode)
                if not self.packaged:
                    self.cycle = compiled(self.cycle, self.device, frozen, mode=mode)
                    self.plain_cycle = compiled(lookup_step, self.device, frozen, mode=mode) if spec.mode == "lookup" else lookup_step
            self.batch_step = compiled(self.batch_step, self.device, frozen, mode=mode)

    def build(self, sampling: Sampling = GREEDY, log=log_stderr):
        """Every step generate() runs for this sampling rule and cache size, compiled now (or loaded from the last process
        that compiled it): nothing compiles inside an answer. Compiles nothing unless the steps are packaged."""
        self.target.taps = self.taps  # another Generator may share the target: the steps run with this one's features
        if not self.packaged:
            return
        self.reserve(1)  # the caches and cycle buffers every step reads, at least at their smallest size
        if self.built == (sampling, self.target.max_seq_length):
            return
        prompt, start = torch.zeros(1, 8, dtype=torch.long, device=self.device), torch.tensor(0, device=self.device)
        steps = [("prefill", layered_prefill, (self.target, prompt, start), True, True)]
        if self.spec is None:
            steps.append(("decode_step", decode_one, (self.target, prompt[0, :1], start.view(1), sampling), False, False))
        else:
            args = (self.target, self.drafter, self.state, self.spec, sampling)
            steps.append((f"{self.spec.mode}_cycle", self.eager_cycle, args, False, False))
            if self.spec.mode == "lookup":
                steps.append(("lookup_step", lookup_step, args, False, False))
        built = {}
        for name, fn, args, dynamic, layered in steps:
            built[name], seconds = self.precompile(name, fn, args, dynamic, log, layered)
            self.compile_seconds += seconds
        self.prefill = built["prefill"]
        self.decode_one = built.get("decode_step", self.decode_one)
        self.cycle = built.get(f"{self.spec.mode}_cycle", self.cycle) if self.spec else None
        self.plain_cycle = built.get("lookup_step", self.plain_cycle)
        self.built = (sampling, self.target.max_seq_length)
        self.warm_up(sampling, log)

    @torch.inference_mode()
    def warm_up(self, sampling: Sampling, log=log_stderr):
        """A two-token answer through the steps just built or loaded, so that a step's first call (the loaded code's first
        run, its buffers' first touch) is paid here, not in the first real answer; then the compiled step timed against
        its eager code, and dropped if it ran slower here. The random state is put back; nothing of this is reused."""
        with torch.random.fork_rng(devices=[]):
            self.answer([0] * 8, 2, sampling, set())
            if self.spec:
                self.cycle = faster(self.cycle, self.eager_cycle, (self.target, self.drafter, self.state, self.spec, sampling), log)
            else:
                one = torch.ones(1, dtype=torch.long, device=self.device)
                self.decode_one = faster(self.decode_one, decode_one, (self.target, one, 8 * one, sampling), log)
        self.kv_streams[self.target] = (None, [])

    @torch.inference_mode(False)  # buffers made alike in and out of generate: an inference tensor fails compiled guards
    def reserve(self, max_len: int) -> bool:
        """Caches for a prompt plus new tokens of max_len, with room for a verify and a commit. -> True when the
        target's caches were reallocated (and hold nothing any more)."""
        before = self.target.max_seq_length
        extra = (self.spec.verify_len + self.spec.depth + 2) if self.spec else 1
        # Rounded up and only grown: compiled steps see few cache shapes (packaged ones, each a compile: fewer still).
        length = find_multiple(max_len + extra, 2048 if self.packaged else 256)
        if self.target.max_seq_length < length:
            self.target.setup_caches(length)
        if self.spec and self.spec.mode not in CHAINS:
            setup_tree(self.target.layers, self.spec.verify_len)  # (again) after new caches: where a verify's tree waits
        if self.head is not None and self.head.max_seq_length != self.target.max_seq_length:
            self.head.setup_caches(self.target.max_seq_length, dtype=self.target.tok_embeddings.weight.dtype)
        if self.head is not None:
            setup_tree(self.head.layers, self.spec.scratch)  # and where a draft tree's levels keep their K/V
        if self.draft_model is not None and self.draft_model.max_seq_length != self.target.max_seq_length:
            self.draft_model.setup_caches(self.target.max_seq_length)
        if self.spec and self.spec.history and getattr(self.state, "history", torch.empty(0)).shape[0] != self.target.max_seq_length:
            self.state.register_buffer("history", torch.zeros(self.target.max_seq_length, dtype=torch.long, device=self.device))
        return self.target.max_seq_length != before

    def reusable(self, prompt: list) -> int:
        """How many leading prompt tokens the caches already hold from this Generator's last answer (a chat's
        earlier turns): the target's KV up to the last token it read, and for a head its draft context pairs."""
        owner, stream = self.kv_streams.get(self.target, (None, []))
        if owner is not self.kv_key or self.draft_model is not None:  # another Generator used the target since; sps: no reuse
            return 0
        common = next((i for i, (a, b) in enumerate(zip(prompt, stream)) if a != b), min(len(prompt), len(stream)))
        start = min(common, len(stream) - 1, len(prompt) - 1)  # the KV holds every token but the last one generated
        if self.head is not None:
            # Write the pairs still pending into the draft's context; pair j also reads token j+1, which must agree.
            draft_context(self.target, self.head, self.state, self.spec)
            start = min(start, common - 1, int(self.state.L))
        return max(start, 0)

    @torch.inference_mode()
    def generate(self, prompt: list, max_new_tokens: int = 200, sampling: Sampling = GREEDY, stop_ids=None, on_tokens=None,
                 lap=None, reuse: bool = False) -> Result:
        """Token ids of the answer to prompt (token ids), up to and including a stop token (default: the model's).
        on_tokens(new ids) is called as tokens are committed (streaming). lap(name, **cycle_tensors): run the cycle
        eagerly and call lap at the end of each phase (bench.py's split); see tree_cycle. reuse: prefill only what the
        caches do not hold yet from this Generator's last prompt and answer (a chat's next turn); the answer is the same."""
        self.check([prompt], max_new_tokens, stop_ids, sampling)
        fresh = self.reserve(len(prompt) + max_new_tokens)
        self.build(sampling)  # before the first token; compiles only for a new sampling rule or cache size
        stop_ids = set(self.target.args.stop_tokens if stop_ids is None else stop_ids)
        return self.answer(prompt, max_new_tokens, sampling, stop_ids, on_tokens, lap, reuse and not fresh)

    def answer(self, prompt: list, max_new_tokens: int, sampling: Sampling, stop_ids: set, on_tokens=None, lap=None,
               reuse: bool = False) -> Result:
        """generate() once its input is checked and its caches and steps are ready."""
        with ops.pacing(self.device) as pace:  # the threads the machine's load leaves (cpu/threads.py)
            pace()
            sync = dtypes.synchronizer(self.device)
            sync()
            t0 = time.perf_counter()
            start = self.reusable(prompt) if reuse else 0
            self.kv_streams[self.target] = (None, [])  # until this answer is done (an interrupted one leaves nothing to reuse)
            x = torch.tensor([prompt], device=self.device)
            h, feats = self.prefill(self.target, torch.tensor([prompt[start:]], device=self.device), torch.tensor(start, device=self.device))
            root = ops.lm_head_draw(self.target.output, h[-1], sampling)
            sync()
            prefill_seconds = time.perf_counter() - t0
            lap and lap("prefill")
            out = [int(root)]
            on_tokens and on_tokens(out[:])
            hist = [0] * ((self.spec.depth + 1) if self.spec else 1)
            cycles, drafts = 0, True  # lookup: whether the text has a match to draft from
            if self.spec:
                self._start(x, feats, root, start)
                lap and lap("prefill")
            while len(out) < max_new_tokens and out[-1] not in stop_ids:
                pace()
                if self.spec:
                    cycle, eager_cycle = (self.cycle, self.eager_cycle) if drafts else (self.plain_cycle, lookup_step)
                    args = (self.target, self.drafter, self.state, self.spec, sampling)
                    chunk = (eager_cycle(*args, lap) if lap else cycle(*args)).tolist()
                    if self.spec.mode == "lookup":
                        drafts = bool(chunk.pop())
                    accept_len, new = chunk[0], chunk[1:chunk[0] + 2]
                    hist[accept_len] += 1
                    cycles += 1
                else:
                    pos = torch.tensor([len(prompt) + len(out) - 1], device=self.device)
                    new = self.decode_one(self.target, torch.tensor(out[-1:], device=self.device), pos, sampling).tolist()
                new = batch.cut(new, max_new_tokens - len(out), stop_ids)
                out += new
                on_tokens and on_tokens(new)
            sync()
            self.kv_streams[self.target] = (self.kv_key, prompt + out)
            return Result(out, time.perf_counter() - t0, cycles, hist if self.spec else None, len(prompt) - start, prefill_seconds)

    def check(self, prompts: list, max_new_tokens: int, stop_ids=None, sampling: Sampling = GREEDY):
        check_prompts(self.target.args, prompts, max_new_tokens, stop_ids)  # UsageError before torch sees them
        check_sampling(sampling.temperature, sampling.top_k, sampling.top_p)

    def generate_batch(self, prompts: list, max_new_tokens: int = 200, sampling: Sampling = GREEDY, stop_ids=None, batch_size: int = 0) -> list:
        """Answers to several prompts, batch_size rows at a time (0: all; batch.py): one forward for every row's step or
        tree, a row that is done taking the next waiting prompt. Each answer is what generate() gives its prompt alone.
        -> a Result per prompt, in order (seconds: the whole run's)."""
        self.check(prompts, max_new_tokens, stop_ids, sampling)
        stop_ids = set(self.target.args.stop_tokens if stop_ids is None else stop_ids)
        rows, seconds, prefill_seconds = batch.generate(self, prompts, max_new_tokens, sampling, stop_ids, batch_size)
        return [Result(out, seconds, sum(hist) if self.spec else 0, hist if self.spec else None, len(prompt), prefill_seconds)
                for (out, hist), prompt in zip(rows, prompts)]

    def chat(self, messages, max_new_tokens: int = 200, sampling: Sampling = GREEDY, chat: bool = True) -> tuple:
        """messages: a user turn (str) or a conversation [{"role", "content"}] -> (answer text, Result)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        args = self.target.args
        result = self.generate(encode_prompt(self.tokenizer, args, messages, chat), max_new_tokens, sampling)
        return self.tokenizer.decode([t for t in result.token_ids if t not in args.stop_tokens]), result

    def _start(self, prompt: Tensor, feats: Tensor, root: Tensor, start: int = 0):  # after a prefill of prompt[start:]
        st, T = self.state, prompt.shape[1]
        st.L.fill_(T)
        st.root.copy_(root.view(1))
        st.prev.copy_(prompt[0, -1:])
        st.n_pend.fill_(1)
        st.pend_tok[0] = root
        st.pend_feat[0] = feats[-1].float()
        if self.spec.history:
            st.history[:T] = prompt[0]
            st.history[T] = root
        if self.head is not None and T - 1 > start:
            # The draft's context: feature f_j with token x_{j+1}; the last pair waits in pend_*.
            pos = torch.arange(start, T - 1, device=self.device)
            self.head(prompt[:, start + 1:], self.target.tok_embeddings.weight, feats[None, :-1], pos, pos, causal_mask(pos, self.head.max_seq_length))
        if self.draft_model is not None and T > 1:
            prefill(self.draft_model, prompt[:, :-1], torch.tensor(0, device=self.device))
