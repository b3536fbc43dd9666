# Draft tree sizes for the device. Verifying T tree tokens costs r(T) decode steps: about 1 up to T=64 on an
# H100 (the weights are read once either way), about 2 at T=16 on a 2-core CPU (the matmuls turn
# compute-bound). So we time r(T) and one draft level once per device, model and dtype (cached in
# $EAGLET_CACHE/tree_sizes.json, cachedir.py), and pick the (m, depth, k) with the most expected tokens per unit of time.
#
# Expected tokens come from EAGLE-2's own value model under a static prior: the target's next token is the
# draft's rank-r guess with probability a (1-a)^r, a node is accepted with the product of its path's
# probabilities, and a cycle commits 1 + the sum over its m nodes. The tree holds the m most valuable nodes.
import contextlib
import time
from itertools import product

import torch

import cachedir
import dtypes
import ops
import sampling
import tp
import weights
from draft import Eagle3Head, use_draft_vocab
from errors import UsageError
from progress import ticking
from spectree import RANK_ACCEPT, RANK_ACCEPT_SAMPLING, best_first, level_widths
from model import FEW_QUERIES, FUSED_QUERIES, KERNEL_QUERIES, causal_mask, find_multiple, rope_at
from quant import KERNEL_MAX_ROWS, QuantLinear

M_CHOICES = (2, 4, 6, 8, 12, 16, 24, 32, 48, 60)
DEPTH_CHOICES = (2, 3, 4, 5, 6)
TOPK_CHOICES = (4, 10)
# Sampling's trees keep fixed widths a level (spectree.grow_coupled), which the prior's best tree of m nodes with k
# children a node sets: k 10, the paper's, only bounds how many of a node's ranks that tree may use.
TOPK_SAMPLING = (10,)
LOOKUP_SLOTS = 3  # eagle2's default: on MT-bench they lift tau far more than they cost the cycle (docs/cpu.md)
# The priors: spectree.RANK_ACCEPT, and RANK_ACCEPT_SAMPLING for sampling's coupled trees.
# The share of a tree's accepted drafts a head keeps when it drafts over the more frequent half of its vocabulary,
# greedy and sampling: the shipped head with 8192 of its 16384 tokens, τ 2.63 -> 2.58 at T=0 and 2.07 -> 1.93 at T=1
# (docs/cpu.md, "The draft vocabulary"). Sampled tokens fall outside the frequent ones more often, and a coupled draft
# must hold the token the target will draw.
HALF_VOCAB_KEEP = (0.97, 0.87)
CONTEXT = 256  # position the costs are measured at
QUERY_GROUPS = (FUSED_QUERIES, KERNEL_QUERIES, FEW_QUERIES)  # row counts up to each bound share a dynamic graph (few_rows)
# The most draft levels (or chain tokens) a cycle may have: each level is a head pass, and its drafts are accepted
# ever less often (the sizer goes to max(DEPTH_CHOICES)); past this a tree only costs, so a larger number is a mistake.
MAX_DEPTH = 32
# A batch speculates where its tree is expected to commit this many times the tokens of a plain step in the same time:
# the cost model counts the passes, not a batch's own costs around them (its rows' bookkeeping, their draws).
PAYS = 1.2


def check_bounds(m=None, depth=None, k=None, chain=None, lookup=None):
    """The tree and chain flags against what any tree can hold, before a tree is sized (UsageError): what is left open
    takes the largest the sizer tries."""
    for flag, value in (("--depth", depth), ("--speculate-k", chain), ("--lookup-slots", lookup)):
        if value is not None and value > MAX_DEPTH:
            raise UsageError(f"{flag} {value} exceeds the {MAX_DEPTH} levels a cycle may have")
    d, kk = depth or max(DEPTH_CHOICES), k or max(TOPK_CHOICES)
    if m is not None and m > kk + (d - 1) * kk * kk:
        raise UsageError(f"--num-draft-tokens {m} exceeds the {kk + (d - 1) * kk * kk} candidates of a tree of depth {d} and topk {kk}"
                         + ("" if depth and k else " (the largest the sizer tries; --depth and --topk set others)"))


def rank_accept(sampling: bool):
    """The prior: a, or (a, ratio) (spectree.best_first)."""
    return RANK_ACCEPT_SAMPLING if sampling else RANK_ACCEPT


def expected_tau(m: int, depth: int, k: int, a=RANK_ACCEPT) -> float:
    """1 + the m largest node values in the k-ary tree of the given depth (spectree.best_first; a: a or (a, ratio))."""
    return 1.0 + sum(v for v, _ in best_first(m, depth, k, *(a if isinstance(a, tuple) else (a,))))


def lookup_slots(depth: int, given=None, batch: int = 1) -> int:
    """eagle2's prompt-lookup slots: given, else min(LOOKUP_SLOTS, depth) for one sequence and none for a batch (there
    each slot is B more verified rows, and the cost model does not value their tokens)."""
    return given if given is not None else min(LOOKUP_SLOTS, depth) if batch == 1 else 0


def asked_lookup_slots(given, sampling: bool):
    """The lookup slots asked for: as given, else lookup_slots' default (None) for greedy decoding and none when sampling:
    at T=1 on 12 MT-bench turns they added no τ for 3 more verified rows a cycle."""
    return given if given is not None or not sampling else 0


def verify_cost(costs: dict, T: int) -> float:
    """r(T), linear between the measured T (past the last, at the last segment's slope)."""
    points = sorted((int(t), r) for t, r in costs["verify"].items())
    i = next((i for i, (t, _) in enumerate(points) if t >= T), len(points) - 1)
    (t0, r0), (t1, r1) = points[max(i - 1, 0)], points[max(i, 1)]
    return r0 + (r1 - r0) * (T - t0) / (t1 - t0)


def cycle_cost(costs: dict, m: int, depth: int, k: int, lookup=None, batch: int = 1, sampling: bool = False,
               half: bool = False) -> float:
    """A cycle in decode steps (of batch rows): the context pass over depth+1 rows, depth-1 expansions of k rows (when
    sampling, one of each level's nodes but the last: spectree.grow_coupled), the verify of the root, m nodes and the
    lookup slots (their tokens are not valued: on text without repeats they are dead); every row once per sequence of
    the batch. half: the head drafts over the more frequent half of its vocabulary (its levels' costs then)."""
    level = costs["level_half" if half else "level"]

    def rows(n):  # a head pass over n rows a sequence: row costs are close to linear
        return level["4"] + (level["10"] - level["4"]) * (batch * n - 4) / 6

    expand = sum(map(rows, level_widths(m, depth, k)[:-1])) if sampling else (depth - 1) * rows(k)
    cycle = rows(depth + 1) + expand + verify_cost(costs, batch * (m + 1 + lookup_slots(depth, lookup, batch)))
    return cycle / (1.0 if batch == 1 else verify_cost(costs, batch))


def ranked_trees(costs: dict, m=None, depth=None, k=None, a=None, lookup=None, batch: int = 1, sampling: bool = False,
                 vocab=None) -> list:
    """(m, depth, k) options, keeping any that are given, best first by expected tokens per decode step of
    time; m never exceeds the pool of k + (depth-1) k^2 candidates. lookup: the trees' lookup slots (None: lookup_slots');
    batch: the sequences a cycle runs at once (generate_batch), each with its own tree, against a step of that many rows;
    a: the prior (None: RANK_ACCEPT; when sampling RANK_ACCEPT_SAMPLING, and k from TOPK_SAMPLING); vocab: the draft
    vocabulary, which no k chosen here exceeds (a level cannot take more children of a node than it has tokens)."""
    a = a or rank_accept(sampling)
    ks = [k] if k else sorted({min(c, vocab or c) for c in (TOPK_SAMPLING if sampling else TOPK_CHOICES)})
    grid = product([m] if m else M_CHOICES, [depth] if depth else DEPTH_CHOICES, ks)
    options = [(m, d, k) for m, d, k in grid if m <= k + (d - 1) * k * k and lookup_slots(d, lookup, batch) <= d]
    if not options:
        if lookup is not None and lookup > (depth or max(DEPTH_CHOICES)):
            raise ValueError(f"--lookup-slots {lookup} exceeds the tree's depth {depth or max(DEPTH_CHOICES)}")
        raise ValueError(f"--num-draft-tokens {m} exceeds the candidates of every tree with depth {depth} and topk {k}"
                         + (f" and depth >= --lookup-slots {lookup}" if lookup else ""))
    return sorted(options, key=lambda o: (-speed(costs, *o, a, lookup, batch, sampling), o[0]))


def speed(costs: dict, m: int, depth: int, k: int, a, lookup=None, batch: int = 1, sampling: bool = False, half: bool = False) -> float:
    """Expected tokens a decode step's time (the cost model's figure of merit); half: as in cycle_cost, its drafts
    accepted HALF_VOCAB_KEEP as often."""
    drafts = expected_tau(m, depth, k, a=a) - 1.0
    keep = HALF_VOCAB_KEEP[sampling] if half else 1.0
    return (1.0 + keep * drafts) / cycle_cost(costs, m, depth, k, lookup, batch, sampling, half)


def draft_width(costs: dict, tree: tuple, vocab: int, lookup=None, batch: int = 1, sampling: bool = False) -> int:
    """The tokens a head with a vocabulary of vocab tokens (ordered by frequency) drafts over with this (m, depth, k):
    all of them, or the more frequent half where its cheaper levels outweigh the drafts it loses. Beside a small target
    a level is a fair share of the cycle and its LM head much of a level; a large target's verify dwarfs them."""
    if "level_half" not in costs:
        return vocab
    a = rank_accept(sampling)
    faster = speed(costs, *tree, a, lookup, batch, sampling, half=True) > speed(costs, *tree, a, lookup, batch, sampling)
    return vocab // 2 if faster else vocab


def _ms(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return 1000 * (time.perf_counter() - t0)


def _median_ms(fn, device, reps: int = 3) -> float:
    sync = dtypes.synchronizer(device)
    fn()
    return sorted(_ms(fn, sync) for _ in range(reps))[reps // 2]


def _median_ratio(fn, step, device, reps: int = 3) -> float:
    """fn's time in decode steps, each timing of fn beside one of the step: a CPU's memory bandwidth drifts between
    measurements made apart (timed apart, a 3-row pass read a third dearer than it is)."""
    sync = dtypes.synchronizer(device)
    fn()
    return sorted(_ms(fn, sync) / _ms(step, sync) for _ in range(reps))[reps // 2]


def _layer_pass(layer, rope_table, x, pos, mask):
    return layer(x, rope_at(rope_table, pos, 1), pos, mask)


def _head_level(target, head, tokens, feats, pos, mask):
    h = head(tokens[None], target.tok_embeddings.weight, feats, pos, pos, mask)[0]
    logits = head.logits(h, target.output)
    return torch.topk(torch.log_softmax(logits.float(), -1), min(tokens.shape[0], 10, logits.shape[-1]))


def _half_head_level(*args):  # a graph of its own: the head's LM head is half as tall
    return _head_level(*args)


@torch.inference_mode()
def measure_costs(target, head, compile_fn=None) -> dict:
    """Verify costs r(T) for T = m+1, and draft level costs for 4 and 10 rows, in decode steps.

    compile_fn: how the generator will compile its steps (None: it runs them eagerly). The passes are timed
    through it, so the costs are those of the steps that will run: eager timing on a GPU is launch-bound and
    flat in T (it would always pick the largest tree), and compiling on a CPU removes per-op overhead. A target pass
    is timed as its layers, each through one compiled graph of a layer, then its greedy draw (eagerly: one kernel):
    the layers are alike, and a graph of all of them took minutes to compile for a few timings."""
    device, dtype = target.tok_embeddings.weight.device, target.tok_embeddings.weight.dtype
    need = CONTEXT + max(M_CHOICES) + 1
    if target.max_seq_length < need:
        target.setup_caches(find_multiple(need, 256))
    head.setup_caches(target.max_seq_length, dtype=dtype)
    # The draft level reads the target's LM head, so one quantised layer in either model counts for both passes.
    quantised = any(isinstance(m, QuantLinear) for model in (target, head) for m in model.modules())
    low = KERNEL_MAX_ROWS + 1 if quantised else 2  # row counts from here on share dynamic graphs (few_rows)
    graphs = {}

    def graph(fn, T):
        group = 1 if T == 1 else T if T < low else next(q for q in QUERY_GROUPS if T <= q)
        if (fn, group) not in graphs:
            graphs[fn, group] = compile_fn(fn) if compile_fn else fn
        return graphs[fn, group]

    def target_pass(T):
        pos = CONTEXT + torch.arange(T, device=device)
        # states with a spread of logits, as a real pass has: from zeros every logit ties and a draw's screen keeps them all
        x = torch.randn(1, T, target.args.dim, generator=torch.Generator().manual_seed(T)).to(device, dtype)
        mask = causal_mask(pos, target.max_seq_length)
        few_rows(T, mask, (x, 1), (pos, 0))
        run = graph(_layer_pass, T)

        def run_pass():
            for layer in target.layers:
                run(layer, target.rope, x, pos, mask)
            return sampling.lm_head_draw(target.output, target.norm(x)[0], "greedy")  # the LM head as greedy draws read it
        return run_pass

    def head_level(rows, fn=_head_level):
        pos = CONTEXT + torch.arange(rows, device=device)
        tokens = torch.zeros(rows, dtype=torch.long, device=device)
        feats = torch.zeros(1, rows, target.args.dim, device=device, dtype=dtype)
        mask = causal_mask(pos, head.max_seq_length)
        few_rows(rows, mask, (tokens, 0), (pos, 0), (feats, 1))
        run = graph(fn, rows)
        return lambda: run(target, head, tokens, feats, pos, mask)

    def few_rows(n, mask, *dims):
        # Dynamic graphs time every size, and they must attend as the cycle's graphs of a fixed size do: the bounds
        # let the model prove n <= FEW_QUERIES (model.attend_few) instead of taking the prefill's path, and a graph
        # for each of QUERY_GROUPS proves which attention its sizes take (fused loops, the kernel, the matmuls).
        # A quantised layer changes kernels past KERNEL_MAX_ROWS, and its CPU rows kernel loops over a static row
        # count: up to there each size gets its own graph, as in the cycle.
        if compile_fn and n >= low:
            hi = next(q for q in QUERY_GROUPS if n <= q)
            lo = max(low, ([1] + [q + 1 for q in QUERY_GROUPS if q < hi])[-1])
            for t, d in ((mask, 0), *dims):
                torch._dynamo.mark_dynamic(t, d, min=lo, max=hi)
            # the mask's slots read: never all of the cache's, a width the model reads as a special case
            torch._dynamo.mark_dynamic(mask, 1, min=CONTEXT + lo, max=min(CONTEXT + hi, target.max_seq_length - 1))

    # Compiled, a quantised target's few-row graphs are large (the rows kernel unrolls its rows) and slow to build: the
    # smallest and largest tree below the switch stand for the others, which verify_cost interpolates.
    few = [m for m in M_CHOICES if m + 1 <= KERNEL_MAX_ROWS]
    sizes = [m for m in M_CHOICES if not (compile_fn and quantised) or m not in few[1:-1]]
    step = target_pass(1)
    verify = [_median_ratio(target_pass(m + 1), step, device) for m in sizes]
    verify = [min(verify[i:]) for i in range(len(verify))]  # a longer pass never costs less: a dip later marks noise
    # levels take reps 7: the two widths' difference is a few hundredths of a step
    level = {str(k): round(_median_ratio(head_level(k), step, device, reps=7), 3) for k in (4, 10)}
    entry = {"decode_ms": round(_median_ms(step, device, reps=5), 3),
             "verify": {str(m + 1): round(r, 3) for m, r in zip(sizes, verify)}, "level": level}
    if can_halve(head):  # the same level over the more frequent half of the head's vocabulary (its own graph)
        with halved(target, head, getattr(compile_fn, "compile", False)):  # packed as compiling.sizing_compile packs
            entry["level_half"] = {str(k): round(_median_ratio(head_level(k, _half_head_level), step, device, reps=7), 3) for k in (4, 10)}
    return entry


def can_halve(head) -> bool:
    """The head drafts over a vocabulary of its own, ordered by frequency, of at least twice the widest level's tokens
    (an EAGLE-3 head's LM head is its own: it cannot cut it)."""
    return not isinstance(head, Eagle3Head) and head.lm_head is not None and len(head.draft_vocab) >= 2 * max(TOPK_CHOICES)


@contextlib.contextmanager
def halved(target, head, compile):
    """The head drafting over the more frequent half of its vocabulary, readied as its steps read it (ops.prepare),
    then as it was."""
    vocab, lm_head = head.draft_vocab, head.lm_head
    try:
        use_draft_vocab(head, target.output, len(vocab) // 2)
        ops.prepare(compile, target, head)
        yield head
    finally:
        head.draft_vocab, head.lm_head = vocab, lm_head


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


# Part of the cache key: bump it when the steps' code changes what they cost, so older measurements are not reused.
COSTS_VERSION = 11


def cache_key(target, head, compiled=False) -> str:
    """compiled: False (eager), True or "max" (--compile max's costs are their own). A head whose vocabulary the sizing
    halved (eaglet.tree_spec) keys as it was measured."""
    name = device_name(target.tok_embeddings.weight.device)
    a = target.args
    mode = getattr(target.layers[0].feed_forward.w13, "mode", "float")
    return (f"{name} x{tp.world_size()} ranks|{target.tok_embeddings.weight.dtype}|{mode} target|{a.dim}x{a.n_layer}x{a.n_head}x{a.n_local_heads}"
            f"x{a.intermediate_size}x{a.vocab_size}|{head.kind} head, draft_vocab {getattr(head, 'sized_as', (len(head.draft_vocab),))[0] or a.vocab_size}|torch {torch.__version__}"
            f"|costs {COSTS_VERSION}"
            + ("|compiled" if compiled else "") + (" max" if compiled == "max" else "")
            + (f" {ops.kernel_name(target.layers[0].feed_forward.w13)}" if compiled is True else ""))


CACHE = "tree_sizes.json"


def valid_costs(entry: dict) -> bool:
    """A cached cost entry as measure_costs writes it (and record_sweep's trees): anything else is measured again."""
    verify, trees = entry["verify"], [v for k, v in entry.items() if k.startswith("swept")]
    return (cachedir.number(entry["decode_ms"]) and len(verify) >= 2 and all(int(t) > 0 and cachedir.number(r) for t, r in verify.items())
            and all(cachedir.number(entry[level][k]) for level in ("level", "level_half") if level in entry for k in ("4", "10"))
            and all(len(t) == 3 and all(isinstance(x, int) and x > 0 for x in t) for t in trees))


def device_costs(target, head, log=print, compile_fn=None) -> dict:
    """The cached cost entry for this device, model, draft and way of running the steps (eager or
    compiled: measure_costs), measured now (seconds; a minute when compiling) if there is none.
    Under tensor parallelism every rank measures together and rank 0's entry counts."""
    key = cache_key(target, head, getattr(compile_fn, "compile", compile_fn is not None))
    entry = tp.from_rank0(cachedir.entry(CACHE, key, valid_costs))
    if entry is None:
        if tp.rank() == 0:
            how = "compiled steps" if compile_fn else "eager steps"
            log(f"sizing the draft tree for this device from its {how} (once; cached in {cachedir.root() / CACHE})")
        disturbed = ops.watch_load()
        with ticking("sizing the draft tree", log if tp.rank() == 0 else lambda s: None):
            entry = tp.from_rank0(measure_costs(target, head, compile_fn))
        cachedir.store(CACHE, key, entry, disturbed())
    return entry


def swept_key(sampling: bool, head) -> str:
    # Greedy decoding and sampling each get their own tree, and each head: a sweep's winner rides on the head's tau, so
    # a retrained head of the same shape goes back to the cost model. Sampling's sweeps before its trees were coupled to
    # the draws (spectree.grow_coupled) were recorded as "swept sampling" and no longer count.
    return f"{'swept coupled sampling' if sampling else 'swept'} {getattr(head, 'sized_as', (0, None))[1] or head_digest(head)}"


def cut_vocab(target, head, width: int):
    """The head drafts over the first width tokens of its vocabulary (draft_width's choice), cut in place when that is
    fewer. It keeps what it was measured as, (vocabulary size, weights' digest), so that cache_key and swept_key find
    its costs and sweeps again."""
    if width < len(head.draft_vocab):
        head.sized_as = (len(head.draft_vocab), head_digest(head))
        use_draft_vocab(head, target.output, width)


def head_digest(head) -> str:
    """A digest of the head's weights as saved (its state dict: the same however its linears are packed)."""
    return weights.digest(sorted(head.state_dict().items()))


def record_sweep(target, head, best: tuple, compiled=False, sampling: bool = False, disturbed=None):
    """bench.py --sweep's measured winner, which then replaces the cost model's choice (for sampling if it sampled)
    while the head is the one it ran with; not kept if other work took the machine while it was timed (disturbed)."""
    key = cache_key(target, head, compiled)
    cachedir.store(CACHE, key, cachedir.read(CACHE).get(key, {}) | {swept_key(sampling, head): list(best)}, disturbed)


def measure_tree(target, head, m=None, depth=None, k=None, log=print, compile_fn=None, lookup=None, batch: int = 1,
                 sampling: bool = False, plain: bool = False):
    """(m, depth, k, width) for this device, batch size and kind of decoding: a --sweep result (one sequence, greedy or
    sampling) if there is one and nothing is given, else the cost model's best around whatever is given; width, the
    draft vocabulary that tree drafts over fastest (draft_width: the head's, or its more frequent half). Times the
    device the first time (device_costs), then reads the cache. plain: None where the best tree is expected to commit
    no more tokens in a step's time than plain steps do (PAYS)."""
    costs = device_costs(target, head, log, compile_fn)
    vocab = len(head.draft_vocab)
    tree = None
    if not (m or depth or k) and batch == 1 and any(key.startswith("swept") for key in costs):  # the digest only then
        tree = costs.get(swept_key(sampling, head))
    tree = tuple(tree or ranked_trees(costs, m, depth, k, lookup=lookup, batch=batch, sampling=sampling, vocab=vocab or target.args.vocab_size)[0])
    if plain and speed(costs, *tree, rank_accept(sampling), lookup, batch, sampling) < PAYS:
        return None
    return (*tree, draft_width(costs, tree, vocab, lookup, batch, sampling))
