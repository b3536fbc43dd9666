# tokens/s benchmark: vanilla and speculative modes in one process, on the same prompts and template.
# Warm-up (and compile) time is excluded from the figures and reported apart.
import sys
from pathlib import Path

if not __package__:  # run as a script (python bench/bench.py): the project's root, not this folder, is the import root
    sys.path[0] = str(Path(__file__).resolve().parents[1])
import interrupt  # noqa: F401  first of all: Ctrl-C during the imports below exits 130 in one line too
import copy
import json
import resource
import time
from dataclasses import replace

import torch

import atomic
import cachedir
import dtypes
import ops
import quant
import sizing
import tp
from bench import cycle_split, peers
from checkpoint import default_checkpoint
from compiling import sizing_compile
from draft import EagleHead
import eaglet
from eaglet import Generator, Result, acceptance_metrics, check_options, check_sampling, load_generator, prefill
from errors import UsageError, UsageParser
from model import ModelArgs, Transformer, find_multiple
from prompts import MT_BENCH, load_conversations
from speculate import CHAINS, TreeSpec
from tokenizer import encode_prompt

# Named shapes (gpt-fast's transformer_configs): speed depends on shapes alone, so --random-shape can time a 7B
# cycle without its weights. The ModelArgs defaults are Llama-2-7B's.
SHAPES = {
    "llama-2-7b": ModelArgs(),
    "llama-3-8b": ModelArgs(n_local_heads=8, intermediate_size=14336, vocab_size=128256, rope_base=500000.0, block_size=8192),
    "smollm2-135m": ModelArgs(dim=576, n_layer=30, n_head=9, n_local_heads=3, intermediate_size=1536, vocab_size=49152,
                              rope_base=100000.0, block_size=8192, tie_embeddings=True),
    "tiny": ModelArgs(dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=128, vocab_size=320, block_size=2048),
}


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Lap:
    """Wall time per cycle phase, with a device sync at each mark (eager runs only)."""

    def __init__(self, device):
        self.sync = dtypes.synchronizer(device)
        self.totals, self.t = {}, time.perf_counter()

    def __call__(self, name, **cycle_tensors):
        self.sync()
        now = time.perf_counter()
        self.totals[name] = self.totals.get(name, 0.0) + now - self.t
        self.t = now


def add_result(totals: dict, r: Result):
    totals["outputs"].append(r.token_ids)
    totals["new_tokens"] += len(r.token_ids)
    totals["turns"] += 1
    if r.accept_hist:
        totals["cycles"] += r.cycles
        totals["cycle_tokens"] += len(r.token_ids) - 1
        totals["hist"] = [x + y for x, y in zip(totals["hist"] or [0] * len(r.accept_hist), r.accept_hist)]


def run_mode(gen, tokenizer, margs, conversations, opts, sampling, progress=True, name=None, reuse=False, batch=0) -> dict:
    """Generates an answer for every turn (first turns unless --multi-turn); returns totals and every answer's
    token ids. gen: a Generator, or a peer's generate(prompt, max_new_tokens, stop_ids) -> (ids, seconds).
    reuse: a turn prefills only what the caches do not hold from the conversation's earlier turns.
    batch: every first turn through this many rows (Generator.generate_batch: a row that is done takes the next turn)."""
    totals = dict(new_tokens=0, seconds=0.0, decode_seconds=0.0, cycles=0, cycle_tokens=0, hist=None, turns=0, outputs=[], prefill=[])
    if batch:
        prompts = [encode_prompt(tokenizer, margs, [{"role": "user", "content": turns[0]}], chat=True) for turns in conversations]
        torch.manual_seed(opts.seed)
        results = gen.generate_batch(prompts, opts.max_new_tokens, sampling, margs.stop_tokens, batch)
        totals["seconds"] += results[0].seconds
        totals["decode_seconds"] += results[0].seconds - results[0].prefill_seconds
        for r in results:
            add_result(totals, r)
        return totals
    it = conversations
    if progress:
        from tqdm import tqdm

        it = tqdm(conversations, desc=name or (gen.spec.mode if gen.spec else "none"), file=sys.stderr, leave=False)
    for turns in it:
        messages = []
        for t, turn in enumerate(turns if opts.multi_turn else turns[:1]):
            messages.append({"role": "user", "content": turn})
            prompt = encode_prompt(tokenizer, margs, messages, chat=True)
            torch.manual_seed(opts.seed)
            if isinstance(gen, Generator):
                r = gen.generate(prompt, opts.max_new_tokens, sampling, margs.stop_tokens, reuse=reuse)
                totals["prefill"].append((t, r.prefill_seconds, r.prefilled, len(prompt)))
            else:
                r = Result(*gen(prompt, opts.max_new_tokens, set(margs.stop_tokens)))
            add_result(totals, r)
            totals["seconds"] += r.seconds
            totals["decode_seconds"] += r.seconds - r.prefill_seconds
            answer = [t for t in r.token_ids if t not in margs.stop_tokens]
            messages.append({"role": "assistant", "content": tokenizer.decode(answer)})
    return totals


def time_split(gen: Generator, tokenizer, margs, conversations, opts, sampling) -> dict:
    """Mean ms per cycle phase, measured eagerly with syncs on a few prompts."""
    lap = Lap(gen.device)
    cycles = 0
    for turns in conversations[:3]:
        prompt = encode_prompt(tokenizer, margs, [{"role": "user", "content": turns[0]}], chat=True)
        torch.manual_seed(opts.seed)
        r = gen.generate(prompt, min(opts.max_new_tokens, 64), sampling, margs.stop_tokens, lap=lap)
        cycles += r.cycles
    return {k: round(1000 * v / max(cycles, 1), 3) for k, v in lap.totals.items() if k != "prefill"}


def mode_options(opts, mode: str) -> dict:
    """load_generator's keywords for one mode, from bench.py's flags: the tree flags go to eagle2, the chain
    length to sps and lookup."""
    options = dict(device=opts.device, dtype=opts.dtype, compile=opts.compile, draft_vocab=opts.draft_vocab, draft_checkpoint=opts.draft_checkpoint,
                   sampling=check_sampling(opts.temperature, opts.top_k, opts.top_p))  # compiled steps are built for it
    if mode == "eagle2":
        options.update(depth=opts.depth, topk=opts.topk, num_draft_tokens=opts.num_draft_tokens, lookup_slots=opts.lookup_slots)
    if mode in CHAINS:
        options.update(speculate_k=opts.speculate_k)
    return options


def report(opts, gen: Generator, conversations, modes: dict) -> dict:
    return {"device": sizing.device_name(gen.device), "dtype": str(gen.target.tok_embeddings.weight.dtype), "compile": opts.compile,
            "temperature": opts.temperature, "top_p": opts.top_p, "max_new_tokens": opts.max_new_tokens,
            "prompts": str(opts.prompts), "num_conversations": len(conversations), "multi_turn": opts.multi_turn, "modes": modes}


def bench(opts) -> dict:
    base, tokenizer = load_generator(opts.checkpoint, opts.draft, "none", **mode_options(opts, "none"))
    target, margs = base.target, base.target.args
    asked, opts.compile = opts.compile, ops.choose(opts.compile, target)  # resolved once: the modes and the report share it
    conversations = load_conversations(opts.prompts, opts.num_prompts)
    sampling = check_sampling(opts.temperature, opts.top_k, opts.top_p)
    entries, logit_errors = [], {}  # (row name, Generator or peer runner, batch, reuse)
    for mode in opts.modes.split(","):
        gen = base if mode == "none" else load_generator(opts.checkpoint, opts.draft, mode, target=target, **mode_options(opts, mode))[0]
        for batch in opts.batch_sizes or [0]:
            if mode == "eagle2" and batch > 1:  # each batch size its own tree (eaglet.tree_spec)
                gen = load_generator(opts.checkpoint, opts.draft, mode, target=target, batch=batch, **mode_options(opts, mode))[0]
            entries.append((f"{mode} B={batch}" if batch else mode, gen, batch, None))
    if opts.multi_turn and "none" in opts.modes.split(","):  # the same turns, each prefilled from scratch: what reuse saves
        entries.append(("none, no reuse", base, 0, False))
    for q in opts.quantize.split(",") if opts.quantize else ():
        # Vanilla on a weight-only quantised copy of the target, in the same run as the float rows.
        qtarget = quant.quantize_model(copy.deepcopy(target), q, opts.groupsize if q == "int4" else 0)
        entries.append((f"none {q}", Generator(qtarget, compile=ops.choose(asked, qtarget)), 0, None))
        logit_errors[f"none {q}"] = logit_error(target, qtarget, tokenizer, margs, conversations)
    runners = peers.peer_runners(opts.checkpoint or default_checkpoint(), opts.peers.split(","), target.tok_embeddings.weight.dtype,
                                 longest_context(tokenizer, margs, conversations, opts) + 64) if opts.peers else {}
    entries += [(name, run, 0, None) for name, run in runners.items()]
    results, outputs = timed_rows(entries, tokenizer, margs, conversations, opts, sampling,
                                  partial=lambda results: _partial(opts, base, conversations, results))
    for name, error in logit_errors.items():
        results[name]["logit_error"] = error
    for name, row in results.items():  # against vanilla at the same batch size
        base_name = "none B=" + name.split(" B=")[1] if " B=" in name else "none"
        if base_name in results:
            row["speedup"] = round(row["tokens_per_s"] / results[base_name]["tokens_per_s"], 3)
            if "cycle_ms" in row and "cycle_ms" in results[base_name]:  # a cycle's cost in decode steps
                row["cycle_over_step"] = round(row["cycle_ms"] / results[base_name]["cycle_ms"], 3)
            if name != base_name and opts.temperature == 0:
                row["greedy_agreement"] = greedy_agreement(outputs[base_name], outputs[name])
    return report(opts, base, conversations, results)


def _partial(opts, gen, conversations, results):
    """Rows so far, to --json-out with "partial": a long run that is stopped keeps what it measured."""
    if opts.json_out:
        atomic.write_text(opts.json_out, json.dumps(report(opts, gen, conversations, results) | {"partial": True}, indent=2) + "\n")


@torch.inference_mode()
def logit_error(target, qtarget, tokenizer, margs, conversations) -> dict:
    """How far a quantised copy's next-token logits stray from the float target's, over every first-turn prompt
    token (an eager prefill of each): the largest absolute difference, and the RMS difference relative to the
    float logits' RMS."""
    worst, err, ref = 0.0, 0.0, 0.0
    device = target.tok_embeddings.weight.device
    for turns in conversations:
        ids = encode_prompt(tokenizer, margs, [{"role": "user", "content": turns[0]}], chat=True)
        x, start = torch.tensor([ids], device=device), torch.tensor(0, device=device)
        logits = []
        for model in (target, qtarget):
            if model.max_seq_length < len(ids):
                model.setup_caches(find_multiple(len(ids), 256))
            logits.append(model.output(prefill(model, x, start)[0]).float())
        diff = logits[1] - logits[0]
        worst, err, ref = max(worst, diff.abs().max().item()), err + diff.pow(2).sum().item(), ref + logits[0].pow(2).sum().item()
    return {"max_abs": round(worst, 4), "relative_rms": round((err / max(ref, 1e-30)) ** 0.5, 5)}


def greedy_agreement(reference: list, outputs: list) -> dict:
    """How far greedy answers follow vanilla's: the share of answers identical token for token, and for each
    answer the first position where they differ (None: identical). Exact in fp32; in bf16 a verify over many rows
    and a one-row decode run different kernels, so near-ties can break differently (README, Losslessness)."""
    first = []
    for ref, out in zip(reference, outputs):
        diff = next((i for i, (x, y) in enumerate(zip(ref, out)) if x != y), None)
        if diff is None and len(ref) != len(out):
            diff = min(len(ref), len(out))
        first.append(diff)
    return {"identical_share": round(sum(d is None for d in first) / max(len(first), 1), 4), "first_divergence": first}


def longest_context(tokenizer, margs, conversations, opts) -> int:
    """Tokens the longest conversation can reach: whole turns plus max_new_tokens per answer."""
    def length(turns):
        turns = turns if opts.multi_turn else turns[:1]
        messages = [{"role": "user", "content": t} for t in turns]
        return len(encode_prompt(tokenizer, margs, messages, chat=True)) + (opts.max_new_tokens + 16) * len(turns)

    return max(map(length, conversations))


def prefill_per_turn(prefill: list) -> dict:
    """Mean prefill time, tokens prefilled and prompt tokens at each turn index, from run_mode's records."""
    turns = sorted({t for t, *_ in prefill})
    mean = lambda i, t: sum(r[i] for r in prefill if r[0] == t) / sum(r[0] == t for r in prefill)  # noqa: E731
    return {"prefill_ms_per_turn": [round(1000 * mean(1, t), 2) for t in turns],
            "prefilled_tokens_per_turn": [round(mean(2, t), 1) for t in turns], "prompt_tokens_per_turn": [round(mean(3, t), 1) for t in turns]}


def timed_rows(entries: list, tokenizer, margs, conversations, opts, sampling, partial=None) -> tuple:
    """entries: (row name, Generator or peer runner (see run_mode), batch, reuse) -> ({name: row}, {name: every
    answer's token ids}). Each entry is warmed up (and compiled) first; then the turns go in a.rounds slices and every
    entry times each slice in turn, so a machine whose speed drifts during the run (shared cores) moves every row
    alike. batch: rows per generate_batch (0: one prompt at a time); reuse: default --multi-turn."""
    longest = max((e[2] for e in entries), default=0)
    if longest > len(conversations):
        raise UsageError(f"--batch-sizes {longest} exceeds the {len(conversations)} conversations")
    rounds = opts.rounds
    if rounds > len(conversations) // max(longest, 1):  # a slice smaller than a batch would run (and compile) a smaller one
        raise UsageError(f"--rounds {rounds} leaves slices of fewer than {max(longest, 1)} of the {len(conversations)} conversations")
    totals, warmup = {}, {}
    for name, gen, batch, reuse in entries:
        if isinstance(gen, Generator):  # caches sized for the longest conversation first: one that grew mid-run would recompile inside the timing
            gen.reserve(longest_context(tokenizer, margs, conversations, opts))
        t0 = time.perf_counter()
        run_mode(gen, tokenizer, margs, conversations[:max(1, batch)], opts, sampling, progress=False, reuse=_reuse(opts, reuse), batch=batch)
        warmup[name] = time.perf_counter() - t0
    bounds = [round(i * len(conversations) / rounds) for i in range(rounds + 1)]
    results, peak = {}, {}
    for r in range(rounds):
        for name, gen, batch, reuse in entries:
            device = gen.device if isinstance(gen, Generator) else torch.device("cpu")
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            tot = run_mode(gen, tokenizer, margs, conversations[bounds[r]:bounds[r + 1]], opts, sampling, progress=rounds == 1, name=name,
                           reuse=_reuse(opts, reuse), batch=batch)
            totals[name] = merge_totals(totals.get(name), tot)
            peak[name] = max(peak.get(name, 0.0), peak_memory_mb(device))
            results[name] = _row(name, gen, batch, _reuse(opts, reuse), totals[name], warmup[name], peak[name], tokenizer, margs, conversations, opts,
                                 sampling, split=r == rounds - 1)
            if partial:  # a long run that is stopped keeps what it measured
                partial(results)
    return results, {name: totals[name]["outputs"] for name in totals}


def _reuse(opts, reuse) -> bool:
    return opts.multi_turn if reuse is None else reuse


def merge_totals(acc, tot: dict) -> dict:
    """run_mode's totals over two slices of the turns."""
    if acc is None:
        return tot
    hist = [x + y for x, y in zip(acc["hist"], tot["hist"])] if acc["hist"] else tot["hist"]
    return {k: (acc[k] + tot[k]) if k != "hist" else hist for k in acc}


def _row(name, gen, batch, reuse, tot, warmup, peak, tokenizer, margs, conversations, opts, sampling, split) -> dict:
    ours = isinstance(gen, Generator)
    row = {"mode": name, "tokens_per_s": round(tot["new_tokens"] / tot["seconds"], 2), "new_tokens": tot["new_tokens"],
           "seconds": round(tot["seconds"], 3), "turns": tot["turns"], "warmup_s": round(warmup, 2), "peak_memory_mb": round(peak, 1)}
    if not ours:
        return row
    if batch:
        row.update(batch_size=batch)
    else:
        row.update(reuse=reuse, **prefill_per_turn(tot["prefill"]))
    # A decode step's or a cycle's time, the prefill left out (a batch: per row, its steps or cycles summed over rows)
    steps = tot["cycles"] if gen.spec else tot["new_tokens"] - tot["turns"]  # a turn's first token comes from the prefill
    row["cycle_ms"] = round(1000 * tot["decode_seconds"] / max(steps, 1), 3)
    if gen.spec:
        row.update(spec=gen.spec.__dict__, **acceptance_metrics(tot["hist"], tot["cycle_tokens"], tot["cycles"]))
    if gen.head is not None:  # the tokens it drafts over: the head's, or the half the sizing chose (sizing.draft_width)
        row["draft_vocab"] = len(gen.head.draft_vocab) or margs.vocab_size
    if opts.split and split and not batch and gen.packaged:  # compiled steps: each part beside its floor
        row["split"] = cycle_split.split(gen, tokenizer, [turns[0] for turns in conversations[:4]], opts.max_new_tokens, sampling)
    elif opts.split and split and not batch and gen.spec:
        row["split_ms"] = time_split(gen, tokenizer, margs, conversations, opts, sampling)
    return row


def sweep(opts) -> dict:
    """eagle2 over the --sweep best trees by the cost model (sizing.py), measured on the same prompts; the
    fastest is recorded as this device's default."""
    base, tokenizer = load_generator(opts.checkpoint, opts.draft, "eagle2", **mode_options(opts, "eagle2"))
    target, head, margs = base.target, base.head, base.target.args
    opts.compile = ops.choose(opts.compile, target)
    costs = sizing.device_costs(target, head, log=lambda s: print(s, file=sys.stderr),
                                compile_fn=sizing_compile(target, head, opts.compile) if opts.compile else None)
    sampled = opts.temperature > 0  # its own tree: sampling accepts less deep in a tree
    options = sizing.ranked_trees(costs, opts.num_draft_tokens, opts.depth, opts.topk, lookup=opts.lookup_slots, sampling=sampled)[: opts.sweep]
    conversations = load_conversations(opts.prompts, opts.num_prompts)
    sampling = check_sampling(opts.temperature, opts.top_k, opts.top_p)
    entries = [("none", Generator(target, compile=opts.compile), 0, None)]
    for m, depth, k in options:
        spec = TreeSpec("eagle2", depth=depth, topk=k, num_draft_tokens=m, lookup_slots=sizing.lookup_slots(depth, opts.lookup_slots))
        entries.append((f"eagle2 {m} {depth} {k}", Generator(target, spec, head, compile=opts.compile), 0, None))
    disturbed = ops.watch_load()  # a winner timed beside other work is reported, not recorded
    rows = list(timed_rows(entries, tokenizer, margs, conversations, opts, sampling)[0].values())
    for row, (m, depth, k) in zip(rows[1:], options):
        row["predicted_speedup"] = round(sizing.expected_tau(m, depth, k, sizing.rank_accept(sampled)) / sizing.cycle_cost(costs, m, depth, k, opts.lookup_slots, sampling=sampled), 3)
    best = max(rows[1:], key=lambda r: r["tokens_per_s"])
    sizing.record_sweep(target, head, tuple(best["spec"][x] for x in ("num_draft_tokens", "depth", "topk")), opts.compile, sampled, disturbed())
    for row in rows:
        row["speedup"] = round(row["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
    modes = {"none": rows[0]} | {_shape(r["spec"]): r for r in rows[1:]}
    return report(opts, base, conversations, modes) | {"costs": costs, "best": best["spec"]}


@torch.inference_mode()
def shape_bench(opts) -> dict:
    """Random weights of a named shape, a 512-token random prompt (gpt-fast's anchor position): the decode
    step, one eagle2 cycle (its acceptance is meaningless, its time is not), their ratio, and the tokens/s
    a head with τ = --assume-tau would give at that cycle time; plus the verify costs r(T) sizing.py uses."""
    device = torch.device(opts.device or dtypes.default_device())
    dtype = getattr(torch, opts.dtype) if opts.dtype else dtypes.default_dtype(device, log=lambda s: print(s, file=sys.stderr))
    args = SHAPES[opts.random_shape]
    torch.manual_seed(opts.seed)
    with torch.device(device):
        target = Transformer(args).to(dtype).eval()
        head = EagleHead(replace(args, n_layer=1)).to(dtype).eval()
    if opts.quantize:
        quant.quantize_model(target, opts.quantize, opts.groupsize if opts.quantize == "int4" else 0)
    opts.compile = ops.choose(opts.compile, target)
    prompt = torch.randint(0, args.vocab_size, (512,), generator=torch.Generator().manual_seed(opts.seed)).tolist()
    spec = TreeSpec("eagle2", depth=opts.depth or 6, topk=opts.topk or 10, num_draft_tokens=opts.num_draft_tokens or 60)
    rows = {}
    for mode, gen in (("none", Generator(target, compile=opts.compile)), ("eagle2", Generator(target, spec, head, compile=opts.compile))):
        t0 = time.perf_counter()
        gen.generate(prompt, opts.max_new_tokens)  # warm-up and compile
        warmup = time.perf_counter() - t0
        r = gen.generate(prompt, opts.max_new_tokens)
        per_step = r.seconds / (r.cycles if mode == "eagle2" else len(r.token_ids))
        rows[mode] = {"mode": mode, "tokens_per_s": round(len(r.token_ids) / r.seconds, 2), "step_ms": round(1000 * per_step, 3),
                      "warmup_s": round(warmup, 2)}
    cycle_ratio = rows["eagle2"]["step_ms"] / rows["none"]["step_ms"]
    rows["eagle2"] |= {"spec": spec.__dict__, "cycle_over_decode_step": round(cycle_ratio, 3),
                       "implied_tokens_per_s": round(opts.assume_tau * 1000 / rows["eagle2"]["step_ms"], 1)}
    return {"device": sizing.device_name(device), "dtype": str(dtype), "compile": opts.compile, "shape": opts.random_shape,
            "quantize": opts.quantize, "assume_tau": opts.assume_tau, "max_new_tokens": opts.max_new_tokens,
            "costs": sizing.measure_costs(target, head), "modes": rows}


def print_shape_table(result: dict):
    print(f"device {result['device']}, {result['dtype']}, compile {result['compile']}, random {result['shape']} weights"
          f"{', ' + result['quantize'] if result['quantize'] else ''}, position 512")
    none, eagle2 = result["modes"]["none"], result["modes"]["eagle2"]
    print(f"decode step {none['step_ms']:.3f} ms ({none['tokens_per_s']:.1f} tokens/s); eagle2 {_shape(eagle2['spec'])} cycle "
          f"{eagle2['step_ms']:.3f} ms = {eagle2['cycle_over_decode_step']:.2f} decode steps; at tau {result['assume_tau']}: "
          f"{eagle2['implied_tokens_per_s']:.1f} tokens/s")
    print("verify of T tokens / decode step: " + " ".join(f"T={t} {r}" for t, r in result["costs"]["verify"].items()))


def _shape(spec: dict) -> str:
    return f"m{spec['num_draft_tokens']} d{spec['depth']} k{spec['topk']}" + (f" +{spec['lookup_slots']}" if spec.get("lookup_slots") else "")


def print_table(report: dict):
    print(f"device {report['device']}, {report['dtype']}, compile {report['compile']}, T={report['temperature']}, "
          f"{report['num_conversations']} conversations, {report['max_new_tokens']} new tokens")
    print(f"{'mode':20} {'tree':12} {'tok/s':>9} {'speedup':>8} {'tau':>6} {'cycle ms':>9} {'warmup s':>9} {'peak MB':>8} {'same':>5}"
          "  per-depth acceptance / split ms")
    for r in report["modes"].values():
        shape = _shape(r["spec"]) if r.get("spec", {}).get("mode") == "eagle2" else ""
        extra = " ".join(f"{x:.2f}" for x in r.get("accept_rate_per_depth", []))
        if "split_ms" in r:
            extra += "  | " + " ".join(f"{k} {v}" for k, v in r["split_ms"].items())
        same = r.get("greedy_agreement", {}).get("identical_share")  # share of answers identical to vanilla's
        print(f"{r['mode']:20} {shape:12} {r['tokens_per_s']:9.2f} {r.get('speedup', 1.0):8.3f} {r.get('mean_accept_len', 1.0):6.2f} "
              f"{r.get('cycle_ms', 1000 * r['seconds'] / max(r['new_tokens'], 1)):9.2f} {r['warmup_s']:9.2f} {r['peak_memory_mb']:8.0f} "
              f"{'' if same is None else f'{same:.2f}':>5}  {extra}")
    for r in report["modes"].values():
        if "split" in r:
            print(f"\n{r['mode']}: where a {r['split']['per']} goes ({r['split']['ms']} ms as the Generator runs it)")
            print(cycle_split.table(r["split"]))
    if report["multi_turn"]:
        print("prefill per turn (ms, tokens prefilled of the prompt's):")
        for r in report["modes"].values():
            if "prefill_ms_per_turn" in r:
                print(f"{r['mode']:20} " + "   ".join(f"turn {t + 1}: {ms:8.2f} ms {n:7.1f} / {p:7.1f}" for t, (ms, n, p) in enumerate(
                    zip(r["prefill_ms_per_turn"], r["prefilled_tokens_per_turn"], r["prompt_tokens_per_turn"]))))


def parse_batch_sizes(opts) -> list:
    text = opts.batch_sizes if opts.batch_size is None else str(opts.batch_size)
    try:
        sizes = [int(x) for x in text.split(",")] if text else []
    except ValueError:
        raise UsageError(f"--batch-sizes takes a comma list of integers, got {text!r}") from None
    if any(b < 1 for b in sizes):
        raise UsageError(f"batch sizes must be >= 1, got {text}")
    return sizes


def build_parser() -> UsageParser:
    p = UsageParser(description="Benchmark vanilla and speculative decoding on the same prompts.")
    eaglet.add_model_flags(p, mode=False)
    p.add_argument("--modes", default="none,eagle2", help="comma list of none, eagle2, eagle, sps")
    p.add_argument("--prompts", type=Path, default=MT_BENCH, help="MT-bench-format jsonl (default: data/mt_bench.jsonl, the 80 MT-bench questions)")
    p.add_argument("--num-prompts", type=int, default=None, help="a subset spread evenly over the file")
    p.add_argument("--multi-turn", action="store_true", help="continue each conversation through all its turns")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", action="store_true", help="also measure where a cycle's (or decode step's) time goes: compiled, "
                   "each part beside its floor on this CPU (bench/cycle_split.py); eager, by phase with syncs")
    p.add_argument("--sweep", type=int, default=0, metavar="N",
                   help="eagle2 over the N best tree sizes by the cost model; records the fastest as this device's default tree for this head, for greedy decoding or (with --temperature > 0) for sampling")
    p.add_argument("--random-shape", choices=sorted(SHAPES), default=None,
                   help="time the decode step and an eagle2 cycle on random weights of this shape (no checkpoint)")
    p.add_argument("--quantize", default=None, metavar="int8,int4",
                   help="also time vanilla on a weight-only quantised copy of the target (with --random-shape: quantise the target)")
    p.add_argument("--peers", default=None, metavar="transformers,llama.cpp",
                   help="also time HF transformers generate (plain, prompt lookup 10) and llama.cpp (bf16, Q8_0, Q4_1 GGUF; F32 too when we decode in fp32) on the same prompts")
    p.add_argument("--groupsize", type=int, default=32, help="with --quantize int4")
    p.add_argument("--assume-tau", type=float, default=4.7, help="with --random-shape: tau for the implied tokens/s (EAGLE-2 paper: 4.7)")
    p.add_argument("--batch-sizes", default=None, metavar="1,2,4,8",
                   help="each mode also at these batch sizes (every first turn through B rows, a row that is done taking the next turn)")
    p.add_argument("--batch-size", type=int, default=None, metavar="B", help="--batch-sizes B")
    p.add_argument("--rounds", type=int, default=1, metavar="R", help="interleave the rows: the turns in R slices, every row timing each "
                   "slice in turn, so drift in the machine's speed moves every row alike (R = the turns: turn by turn)")
    p.add_argument("--json-out", type=Path, default=None)
    return p


def main(argv=None) -> int:
    try:
        opts = build_parser().parse_args(argv)
        opts.lookup_slots = sizing.asked_lookup_slots(opts.lookup_slots, opts.temperature > 0)  # every tree of the run, --sweep's too
        if not opts.random_shape and not opts.prompts.exists():
            raise UsageError(f"prompts file {opts.prompts} does not exist")
        if not opts.random_shape:
            load_conversations(opts.prompts)  # a file it cannot use refused before anything loads
        if opts.sweep < 0:
            raise UsageError(f"--sweep must be >= 0, got {opts.sweep}")
        if opts.rounds < 1:
            raise UsageError(f"--rounds must be >= 1, got {opts.rounds}")
        if opts.num_prompts is not None and opts.num_prompts < 1:
            raise UsageError(f"--num-prompts must be >= 1, got {opts.num_prompts}")
        for mode in opts.modes.split(","):  # the same checks as generate.py, before anything loads
            check_options(mode, **{k: v for k, v in mode_options(opts, mode).items() if k in ("depth", "topk", "num_draft_tokens", "speculate_k", "draft_vocab", "lookup_slots")},
                          option="--modes")
        check_sampling(opts.temperature, opts.top_k, opts.top_p)
        if opts.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1, got {opts.max_new_tokens}")
        for flag, value, known in (("--quantize", opts.quantize, quant.MODES), ("--peers", opts.peers, peers.PEERS)):
            unknown = set((value or "").split(",")) - set(known) if value is not None else set()
            if unknown:
                raise UsageError(f"unknown {flag} {', '.join(sorted(unknown))}; choose from {', '.join(known)}")
        opts.batch_sizes = parse_batch_sizes(opts)
        if opts.batch_sizes and (opts.multi_turn or opts.sweep or opts.random_shape or opts.peers or opts.quantize):
            raise UsageError("--batch-sizes times first turns of our modes; not with --multi-turn, --sweep, --random-shape, --peers or --quantize")
        if opts.random_shape and opts.quantize and "," in opts.quantize:
            raise UsageError("--random-shape takes one --quantize mode")
        result = shape_bench(opts) if opts.random_shape else sweep(opts) if opts.sweep else bench(opts)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    (print_shape_table if opts.random_shape else print_table)(result)
    if opts.sweep:
        print(f"best for {result['device']}: {_shape(result['best'])} (recorded in {cachedir.root() / sizing.CACHE})")
    if opts.json_out:
        atomic.write_text(opts.json_out, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    tp.exit_with(main)
