# Several sequences at once through the single-sequence steps. Every buffer a step mutates (the target's and the
# drafter's KV caches, the SpecState) gets a per-row copy stacked along a new leading dim, and torch.vmap runs the
# unchanged step over the rows: the head drafts B trees in one pass per level (B*k rows), the target verifies
# B*(m+1) rows in one forward, and each row accepts its own path, so every row is exactly what it would be alone.
# The weights are shared, never copied. Shapes are fixed for a given B, so a compiled step compiles once per B.
import time
from contextlib import nullcontext

import torch
from torch import Tensor
from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call swaps tensors with

import dtypes
import ops
from speculate import CHAINS


def cut(new: list, room: int, stop_ids: set) -> list:
    """A step's new tokens cut at the token limit (room tokens left) and after the first stop token."""
    new = new[:room]
    return next((new[: i + 1] for i, t in enumerate(new) if t in stop_ids), new)


def written(target, drafter, state, tree: bool) -> tuple:
    """The buffers a step writes, as three dicts {name: buffer}: the target's and the drafter's KV caches (with the
    tree verify's K/V rows when tree: another Generator of the same target may size those differently), the SpecState."""
    names = ("k_cache", "v_cache", "k_tree", "v_tree") if tree else ("k_cache", "v_cache")
    caches = lambda model: {} if model is None else {n: b for n, b in model.named_buffers() if n.endswith(names)}  # noqa: E731
    return caches(target), caches(drafter), dict(state.named_buffers()) if state is not None else {}


class Rows:
    """Per-row copies of what a step writes, stacked along a new leading dim: the target's and the drafter's KV caches,
    and every SpecState buffer. self.rows: three dicts {buffer name: [B, ...]}, in the order (target, drafter, state)."""

    def __init__(self, target, drafter, state, batch: int, tree: bool):
        self.own, self.batch, self.tree = written(target, drafter, state, tree), batch, tree
        self.rows = tuple({n: torch.zeros((batch, *b.shape), dtype=b.dtype, device=b.device) for n, b in own.items()} for own in self.own)

    def fits(self, target, drafter, state, batch: int) -> bool:
        """Whether these rows were made for B rows of these very buffers (reserve() replaces the caches it grows)."""
        now = written(target, drafter, state, self.tree)
        return batch == self.batch and all(a.keys() == b.keys() and all(a[n] is b[n] for n in a) for a, b in zip(self.own, now))

    def save(self, i: int):
        """Row i becomes what the models' own buffers hold (a prompt just prefilled the single-sequence way)."""
        for own, row in zip(self.own, self.rows):
            for n, b in own.items():
                row[n][i].copy_(b)


def swap(module, row: dict):
    """The module reads and writes row's tensors in place of its own buffers of those names, inside the with."""
    return _reparametrize_module(module, row) if row else nullcontext()


def batched(step):
    """step(target, drafter, state, *row_args, *static) run over B rows -> fn(target, drafter, state, rows, live,
    row_args, *static); row_args are batched along dim 0, static ones shared. Where live is False a row's SpecState
    is kept as it was (a finished row stops committing; its caches past its end take writes nobody reads)."""

    def run(target, drafter, state, rows: tuple, live: Tensor, row_args: tuple, *static):
        def one(target_row, drafter_row, state_row, *args):
            with swap(target, target_row), swap(drafter, drafter_row), swap(state, state_row):
                return step(target, drafter, state, *args, *static)

        kept = {n: v.clone() for n, v in rows[2].items()}
        out = torch.vmap(one, randomness="different")(*rows, *row_args)
        for n, v in rows[2].items():
            v.copy_(torch.where(live.view(-1, *[1] * (v.dim() - 1)), v, kept[n]))
        return out

    return run


@torch.inference_mode()
def generate(gen, prompts: list, max_new_tokens: int, sampling, stop_ids: set, batch_size: int = 0) -> tuple:
    """Generator.generate_batch's loop over batch_size rows (0: one per prompt). A row whose answer is done takes the
    next waiting prompt, so the rows stay full until the prompts run out: a batch is not held to its slowest answer.
    -> ([(token ids, accept-length histogram) per prompt], seconds, prefill seconds)."""
    gen.reserve(max(map(len, prompts)) + max_new_tokens)
    outs, hists = [[] for _ in prompts], [[0] * ((gen.spec.depth + 1) if gen.spec else 1) for _ in prompts]
    waiting = iter(enumerate(prompts))

    def commit(i: int, new: list, accept_len) -> bool:
        if accept_len is not None:
            hists[i][accept_len] += 1
        outs[i] += cut(new, max_new_tokens - len(outs[i]), stop_ids)
        return len(outs[i]) < max_new_tokens and outs[i][-1] not in stop_ids

    sync = dtypes.synchronizer(gen.device)
    sync()
    t0 = time.perf_counter()
    prefill_seconds = run_rows(gen, min(batch_size or len(prompts), len(prompts)), sampling, lambda: next(waiting, None), commit)
    sync()
    return list(zip(outs, hists)), time.perf_counter() - t0, prefill_seconds


@torch.inference_mode()
def run_rows(gen, B: int, sampling, take, commit, step=None, counts=None) -> float:
    """B rows answering requests, each row one at a time, in one batched step per cycle; the caches must already hold
    every request's prompt and answer (gen.reserve). take() -> (key, prompt token ids) of the next request, or None
    when none waits; before every cycle each free row takes one. commit(key, new token ids, accept_len) -> whether that
    answer goes on; it is called with the prefill's first token (accept_len None), then with each cycle's tokens
    (uncut: commit cuts them at its own limits). Returns when every row is free and take() has nothing.
    step: the batched step to run (default: the Generator's, compiled when it is); counts: a Counter whose "cycles"
    and "shared_cycles" (cycles that ran more than one answer) grow as the rows run. -> seconds spent prefilling."""
    gen.target.taps = gen.taps
    drafter, device = gen.head if gen.head is not None else gen.draft_model, gen.device
    if gen.rows is None or not gen.rows.fits(gen.target, drafter, gen.state, B):
        gen.rows = Rows(gen.target, drafter, gen.state, B, tree=bool(gen.spec) and gen.spec.mode not in CHAINS)
    step = step or (gen.batch_cycle if gen.spec else gen.batch_step)
    sync = dtypes.synchronizer(device)
    keys, live, prefill_seconds = [None] * B, [False] * B, 0.0
    where = [(0, 0)] * B  # vanilla: each row's last token and its position (a free row steps there, read by nobody)

    def admit(b: int) -> bool:
        """Row b takes waiting requests, each prefilled alone the single-sequence way, until one has an answer to go
        on with; -> whether it found one."""
        nonlocal prefill_seconds
        while (item := take()) is not None:
            t = time.perf_counter()
            key, prompt = item
            x = torch.tensor([prompt], device=device)
            h, feats = gen.prefill(gen.target, x, torch.tensor(0, device=device))
            first = int(ops.lm_head_draw(gen.target.output, h[-1], sampling))
            if gen.spec:
                gen._start(x, feats, torch.tensor(first, device=device))
            gen.rows.save(b)
            sync()
            prefill_seconds += time.perf_counter() - t
            keys[b], where[b] = key, (first, len(prompt))
            if commit(key, [first], None):
                return True
        return False

    gen.kv_streams[gen.target] = (None, [])  # the caches will hold prefills only: nothing to reuse
    with ops.pacing(device) as pace:
        while True:
            pace()  # the threads the machine's load leaves (cpu/threads.py)
            live = [live[b] or admit(b) for b in range(B)]
            if not any(live):
                return prefill_seconds
            if counts is not None:
                counts["cycles"] += 1
                counts["shared_cycles"] += sum(live) > 1
            live_rows = torch.tensor(live, device=device)
            if gen.spec:
                chunks = step(gen.target, drafter, gen.state, gen.rows.rows, live_rows, (), gen.spec, sampling).tolist()
            else:
                token = torch.tensor([[t] for t, _ in where], device=device)
                pos = torch.tensor([[p] for _, p in where], device=device)
                chunks = step(gen.target, None, None, gen.rows.rows, live_rows, (token, pos), sampling).tolist()
            for b, chunk in enumerate(chunks):
                if not live[b]:
                    continue
                accept_len = None
                if gen.spec:  # [accept_len, committed tokens...] (lookup: and whether it found a match, unused here)
                    accept_len, chunk = chunk[0], chunk[1:chunk[0] + 2]
                else:
                    where[b] = (chunk[-1], where[b][1] + 1)
                live[b] = commit(keys[b], chunk, accept_len)
