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
    B = min(batch_size or len(prompts), len(prompts))
    gen.reserve(max(map(len, prompts)) + max_new_tokens)
    gen.target.taps = gen.taps
    drafter, device = gen.head if gen.head is not None else gen.draft_model, gen.device
    if gen.rows is None or not gen.rows.fits(gen.target, drafter, gen.state, B):
        gen.rows = Rows(gen.target, drafter, gen.state, B, tree=bool(gen.spec) and gen.spec.mode not in CHAINS)
    sync = dtypes.synchronizer(device)
    outs, hists = [None] * len(prompts), [[0] * ((gen.spec.depth + 1) if gen.spec else 1) for _ in prompts]
    done = lambda out: len(out) >= max_new_tokens or out[-1] in stop_ids  # noqa: E731
    waiting, answering, prefill_seconds = iter(range(len(prompts))), [None] * B, 0.0

    def admit(b: int) -> bool:
        """Row b takes waiting prompts, each prefilled alone the single-sequence way, until one has an answer to go on
        with; -> whether it found one."""
        nonlocal prefill_seconds
        for i in waiting:
            t = time.perf_counter()
            x = torch.tensor([prompts[i]], device=device)
            h, feats = gen.prefill(gen.target, x, torch.tensor(0, device=device))
            outs[i] = [int(sampling.draw(gen.target.output(h[-1])))]
            if gen.spec:
                gen._start(x, feats, torch.tensor(outs[i][0], device=device))
            gen.rows.save(b)
            sync()
            prefill_seconds += time.perf_counter() - t
            if not done(outs[i]):
                answering[b] = i
                return True
        answering[b] = None
        return False

    sync()
    t0 = time.perf_counter()
    live = [admit(b) for b in range(B)]
    gen.kv_streams[gen.target] = (None, [])  # the caches hold a prefill only: nothing to reuse
    while any(live):
        live_rows = torch.tensor(live, device=device)
        if gen.spec:
            chunks = gen.batch_cycle(gen.target, drafter, gen.state, gen.rows.rows, live_rows, (), gen.spec, sampling).tolist()
        else:  # a finished row (no prompt left to take) steps at prompt 0's position in its own cache, read by nobody
            last = [answering[b] if live[b] else 0 for b in range(B)]
            pos = torch.tensor([[len(prompts[i]) + len(outs[i]) - 1] for i in last], device=device)
            token = torch.tensor([outs[i][-1:] for i in last], device=device)
            chunks = gen.batch_step(gen.target, None, None, gen.rows.rows, live_rows, (token, pos), sampling).tolist()
        for b, chunk in enumerate(chunks):
            if not live[b]:
                continue
            i = answering[b]
            if gen.spec:  # [accept_len, committed tokens...] (lookup: and whether it found a match, unused here)
                hists[i][chunk[0]] += 1
                chunk = chunk[1:chunk[0] + 2]
            outs[i] += cut(chunk, max_new_tokens - len(outs[i]), stop_ids)
            live[b] = not done(outs[i]) or admit(b)
    sync()
    return list(zip(outs, hists)), time.perf_counter() - t0, prefill_seconds
