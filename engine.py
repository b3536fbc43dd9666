# The serving engine: requests in, streams of text out, every live request a row of one batch (batch.Batch). One
# thread owns the Generator and runs the loop: waiting requests take free rows (each prefilled from the longest prefix
# any row holds), then one step of every live row, whose tokens go back to each request as text. serve.py is its HTTP
# face; read batch.py for what a step runs at each load.
#
# The loop runs on the thread that loaded the model (run()), not on a thread of its own: on a CPU every thread that
# runs parallel kernels keeps a pool of OpenMP workers, and once a process holds more of them than it has cores,
# libgomp's workers sleep between parallel regions instead of spinning, so every one of a step's few hundred regions
# pays a wake-up (docs/cpu.md, "Threads under load": a second compute thread halves a step's speed). serve.py's HTTP
# thread runs no kernel.
import collections
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

import batch
import ops
from generator import RULES, acceptance_metrics, rule_key
from grammar import Grammar
from sampling import Sampling
from tokenizer import StreamDecoder, encode_prompt


@dataclass(eq=False)  # a Job is itself alone: hashed by identity
class Job:
    """One request on its way through the rows. emit(event) hands an event to the request's HTTP handler (any thread):
    {"token_ids", "text"} as tokens are committed (and "logprobs" when wanted: one entry a token but stop tokens, in
    the shape of OpenAI's chat logprobs), then {"finish_reason", "usage", "eaglet"}, or {"error"}."""
    prompt: list
    max_tokens: int
    sampling: Sampling
    stop_ids: frozenset  # the model's stop tokens and the request's own
    stops: tuple  # stop strings
    seed: Optional[int]
    emit: Callable
    logprobs: Optional[int] = None  # wanted: each token's log-probability and this many top alternatives (None: none)
    grammar: Optional[str] = None  # what the answer must follow (grammar.py: an llguidance grammar)
    ids: list = field(default_factory=list)  # the answer's tokens, the stop token included
    hist: list = field(default_factory=list)  # cycles that accepted 0, 1, ... draft tokens
    cancelled: bool = False  # the client went away
    held: str = ""  # text decoded but not sent: what may begin a stop string
    decoder: Optional[StreamDecoder] = None
    seq: Optional[batch.Seq] = None
    arrived: float = field(default_factory=time.perf_counter)


class Engine:
    """The Generator and its rows, fed by a queue of Jobs from any thread; run() answers them. rows: the most requests
    answered at once; cached: more rows that keep finished requests' caches for later prefixes."""

    def __init__(self, gen, tokenizer, rows: int, context: int, chat_template: bool, default_max_tokens: int, cached: int = 0,
                 max_waiting: Optional[int] = None, log=print):
        self.gen, self.tokenizer, self.rows, self.context = gen, tokenizer, rows, context
        self.chat_template, self.default_max_tokens = chat_template, default_max_tokens
        self.waiting, self.cond, self.closing, self.ready = collections.deque(), threading.Condition(), False, False
        self.aborting, self.max_waiting = False, max_waiting
        self.counts, self.log, self.thread = collections.Counter(), log, None
        self.depth = gen.spec.depth + 1 if gen.spec else 1
        self.stops = tuple(sorted(gen.target.args.stop_tokens))  # what ends an answer (a grammar's too)
        gen.reserve(context)  # every request's caches, allocated once: rows made now stay valid
        self.batch = batch.Batch(gen, rows, cached)

    def run(self, on_ready=lambda: None):
        """Every step built and warmed up (then on_ready()), then the requests answered until close() and the last of
        them is done. Call it on the thread that loaded the model (see the top of this file)."""
        self.warm_up(self.log)
        on_ready()
        self.serve()

    def start(self) -> "Engine":
        """run() on a thread of its own, for callers whose own thread must stay free (tests, a Python host): correct,
        but on a CPU slower than run() on the loading thread."""
        self.thread = threading.Thread(target=self.run, name="rows", daemon=True)
        self.thread.start()
        return self

    @torch.inference_mode()
    def warm_up(self, log):
        """Every step the rows can reach, built (or loaded) and run once before the first request: one, then every number
        of rows at once, with greedy, sampled and truncating rules, and long enough for a catch-up of the head."""
        prompt = encode_prompt(self.tokenizer, self.gen.target.args, [{"role": "user", "content": "Hi"}], self.chat_template)
        self.gen.build("greedy", log)
        tokens = self.gen.state.pend_tok.shape[0] + 2 if self.gen.head is not None else 4

        def commit(seq, new, accept_len):
            seq.tag += len(new)
            return seq.tag < tokens

        # greedy rows: the one-sequence steps, then the batched ones ("sample" kind) at each number of rows
        for kind, counts in (("greedy", range(1, self.rows + 1)), ("sample", [1]), ("truncate", [1])):
            for n in counts:
                for i in range(n):
                    seq = batch.Seq(prompt + [i], RULES[kind], rule_key(i), None, tag=0)
                    seq.commit = lambda new, accept_len, seq=seq: commit(seq, new, accept_len)
                    self.batch.add(seq)
                while self.batch.live:
                    self.batch.step()
        self.batch.counts.clear()
        self.ready = True

    def submit(self, jobs: list) -> str:
        """jobs (a request's choices) into the queue, all or none -> "taken", or "closing" (no new request is taken), or
        "full" (they would make more than max_waiting wait)."""
        with self.cond:
            if self.closing:
                return "closing"
            if self.max_waiting is not None and len(self.waiting) + len(jobs) > self.max_waiting:
                self.counts["refused"] += 1
                return "full"
            for job in jobs:
                job.hist = [0] * self.depth
                job.decoder = StreamDecoder(self.tokenizer)
                self.waiting.append(job)
            self.counts["requests"] += 1
            self.cond.notify()
            return "taken"

    def close(self):
        """Stops the loop once every request taken or waiting is answered (from any thread; start()'s is joined)."""
        with self.cond:
            self.closing = True
            self.cond.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

    def abort(self):
        """Stops the loop at its next step: every request taken or waiting then ends with an error event (counted in
        "aborted"). Only sets flags, so a signal handler may call it."""
        with self.cond:
            self.aborting = self.closing = True
            self.cond.notify()

    def serve(self):
        with ops.pacing(self.gen.device) as pace:
            while True:
                with self.cond:
                    while not self.waiting and not self.batch.live and not self.closing:
                        self.cond.wait()
                    if self.aborting:
                        return self.fail_all("the server stopped before this answer was done")
                    if not self.waiting and not self.batch.live:
                        return
                try:
                    self.admit()
                    if self.batch.live:
                        pace()  # the threads the machine's load leaves (cpu/threads.py)
                        n = self.batch.step()
                        self.counts["cycles"] += 1
                        self.counts["shared_cycles"] += n > 1
                except Exception as e:  # a fault in a step: the requests in the rows fail, the server goes on
                    traceback.print_exc()
                    for seq in list(self.batch.live):
                        self.fail(seq.tag, e)
                    self.batch.leave(list(range(len(self.batch.live))))

    def fail_all(self, message: str):
        with self.cond:
            jobs = [seq.tag for seq in self.batch.live] + list(self.waiting)
            self.waiting.clear()
        for job in jobs:
            job.cancelled = True
            job.emit({"error": message})
        self.counts["aborted"] += len(jobs)
        self.batch.leave(list(range(len(self.batch.live))))

    def admit(self):
        """Waiting requests into free rows, oldest first; one the client left is dropped."""
        while not self.batch.full:
            with self.cond:
                job = self.waiting.popleft() if self.waiting else None
            if job is None:
                return
            if job.cancelled:
                self.counts["cancelled"] += 1
                continue
            try:
                constraint = Grammar(job.grammar, self.tokenizer, self.gen.target.args.vocab_size, self.stops) if job.grammar else None
                job.seq = batch.Seq(job.prompt, job.sampling, rule_key(job.seed), lambda new, accept_len, job=job: self.commit(job, new, accept_len),
                                    tag=job, logprobs=job.logprobs, grammar=constraint)
                self.batch.add(job.seq)
            except Exception as e:  # this request fails alone (its prefill)
                traceback.print_exc()
                self.fail(job, e)

    def commit(self, job: Job, new: list, accept_len) -> bool:
        """A row's new tokens for job -> whether its answer goes on. Decoded a token at a time, so that a stop string ends
        the answer at the token that completed it; text that may begin one waits for the next tokens."""
        if job.cancelled:
            self.counts["cancelled"] += 1
            return False
        try:
            if accept_len is not None:
                job.hist[accept_len] += 1
            new = batch.cut(new, job.max_tokens - len(job.ids), job.stop_ids)
            taken, text, finish, cut = [], "", None, False
            for t in new:
                taken.append(t)
                job.ids.append(t)
                piece = job.held + (job.decoder.push([t]) if t not in job.stop_ids else "")
                cut_at = min((i for i in (piece.find(s) for s in job.stops) if i >= 0), default=-1)
                if cut_at >= 0:
                    text += piece[:cut_at]
                    job.held, finish, cut = "", "stop", True
                    break
                keep = max((n for s in job.stops for n in range(1, len(s)) if piece.endswith(s[:n])), default=0)
                text, job.held = text + piece[:len(piece) - keep], piece[len(piece) - keep:]
                if t in job.stop_ids:
                    finish = "stop"
            if finish is None and len(job.ids) >= job.max_tokens:
                finish = "length"
            if finish and not cut:  # the answer's end: what was held back, whole
                text, job.held = text + job.held + job.decoder.flush(), ""
            event = {"token_ids": taken, "text": text}
            if job.logprobs is not None:
                event["logprobs"] = [self.logprob_entry(t, *job.seq.scored[i]) for i, t in enumerate(taken) if t not in job.stop_ids]
            job.emit(event)
            if finish:
                job.emit({"finish_reason": finish, "usage": self.usage(job), "eaglet": self.figures(job)})
            return finish is None
        except Exception as e:  # this request fails alone
            self.fail(job, e)
            return False

    def logprob_entry(self, token: int, logprob: float, top: list) -> dict:
        """A token's entry in OpenAI's chat logprobs: its text, log-probability, UTF-8 bytes and top alternatives."""
        def one(t, lp):
            text = self.tokenizer.decode([t])
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "surrogatepass"))}
        return one(token, logprob) | {"top_logprobs": [one(t, lp) for t, lp in top]}

    def fail(self, job: Job, e: Exception):
        print(f"a request failed: {type(e).__name__}: {e}", file=sys.stderr)
        self.counts["failed"] += 1
        job.emit({"error": f"{type(e).__name__}: {e}"})

    def usage(self, job: Job) -> dict:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.ids), "total_tokens": len(job.prompt) + len(job.ids)}

    def figures(self, job: Job) -> dict:
        """The speculative figures of an answer: tau (tokens per target forward), the acceptance rate per draft depth,
        and the prompt tokens its prefill ran over (the rest came from a cached prefix)."""
        cycles = sum(job.hist)
        out = {"mode": self.gen.spec.mode if self.gen.spec else "none", "cycles": cycles, "prefilled": job.seq.prefilled if job.seq else 0}
        if not self.gen.spec or not cycles:
            return out
        m = acceptance_metrics(job.hist, sum((a + 1) * c for a, c in enumerate(job.hist)), cycles)
        return out | {"tau": m["mean_accept_len"], "accept_rate_per_depth": m["accept_rate_per_depth"], "accept_len_hist": m["accept_len_hist"]}

    def health(self) -> dict:
        with self.cond:
            steps = {f"{label} x{n}": c for (label, n), c in sorted(self.batch.counts.items())}
            return {"status": "draining" if self.closing else "ok" if self.ready else "loading", "rows": self.rows,
                    "busy": len(self.batch.live), "waiting": len(self.waiting), "cycles": self.counts["cycles"],
                    "shared_cycles": self.counts["shared_cycles"], "requests": self.counts["requests"],
                    "cancelled": self.counts["cancelled"], "failed": self.counts["failed"], "aborted": self.counts["aborted"],
                    "refused": self.counts["refused"], "steps": steps}
