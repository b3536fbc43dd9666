# The library entry point, where generate.py, bench.py and calibration.py all start: load_generator() returns a
# ready Generator (generator.py) and the tokenizer, e.g. gen.chat("What is the capital of France?").
from pathlib import Path
from typing import Optional

import torch

import cpu  # noqa: F401  the CPU fast path registers itself into ops.py (the seam)
import dtypes
import ops
import sizing
import tp
from checkpoint import DEFAULT_HEAD, check_device_dtype, checkpoint_tokenizer, default_checkpoint, load_draft_head, load_draft_model, load_model
from compiling import COMPILE_CHOICES, sizing_compile
from draft import DraftHead
from errors import UsageError
from generator import GREEDY, Generator, Result, acceptance_metrics, check_sampling, log_stderr, prefill  # noqa: F401  (the API)
from model import Transformer
from sampling import Sampling
from speculate import CHAINS, MODES, TreeSpec


# ---------------------------------------------------------------- loading

def load_generator(checkpoint=None, draft=None, speculate: str = "eagle2", *, device=None, dtype=None, compile=False,
                   depth=None, topk=None, num_draft_tokens=None, speculate_k=None, draft_vocab=None, draft_checkpoint=None,
                   lookup_slots=None, target: Optional[Transformer] = None, batch: int = 1, sampling=False, context: int = 0,
                   log=log_stderr) -> tuple:
    """-> (Generator, tokenizer). Raises UsageError on bad input.

    checkpoint: a converted target directory (None: the embedded SmolLM2-135M-Instruct); draft: its EAGLE head
    (None: the shipped head of the default model); speculate: none | eagle2 | eagle | sps | lookup.
    device, dtype (str or torch.dtype): None picks CUDA if present and the dtype this device decodes fastest;
    compile: False, True or "packed", "max", "auto" (a CPU's faster of the two, measured: cpu/inductor.choose).
    depth, topk, num_draft_tokens: the eagle2 tree (what is left out is sized for the device, sizing.py);
    lookup_slots: s more eagle2 tree nodes filled from a prompt lookup match (dead when the text has none; default
    min(3, depth) when greedy, none when sampling; 0 turns them off);
    speculate_k: the sps / lookup chain; draft_vocab: draft over the head's N most frequent tokens (0: all of the
    target's); draft_checkpoint: the sps draft LLM. target: an already loaded target of `checkpoint` to share
    (bench.py runs every mode on one). batch: the prompts generate_batch will answer at once; an eagle2 tree left open
    is sized for that many sequences (smaller, without lookup slots unless given); sampling: the Sampling rule generate will
    run (or True for T > 0): its tree is sampling's (shallower), and compiled steps are built for it before returning.
    context: a prompt plus answer the caches hold from the start (a server's), at most the model's: the steps are built
    once, for caches of that size."""
    check_options(speculate, depth, topk, num_draft_tokens, speculate_k, draft_vocab, lookup_slots)
    check_device_dtype(device, dtype)
    default = checkpoint is None
    try:
        checkpoint = default_checkpoint() if default else Path(checkpoint)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    tokenizer = checkpoint_tokenizer(checkpoint)  # the checkpoint's files checked before the slow work: loading, measuring
    if target is None:
        target = load_target(checkpoint, device, dtype, log)
    compile = ops.choose(compile, target, log)
    if speculate in ("eagle", "eagle2"):
        draft = draft or (DEFAULT_HEAD if default else None)
        if draft is None:
            raise UsageError("--speculate eagle/eagle2 needs --draft HEAD_DIR for this checkpoint")
    head = load_draft_head(draft, target, draft_vocab) if speculate in ("eagle", "eagle2") else None
    if speculate == "sps" and draft_checkpoint is None:
        raise UsageError("--speculate sps needs --draft-checkpoint DIR (a small LLM with the same vocabulary)")
    draft_model = load_draft_model(draft_checkpoint, target) if speculate == "sps" else None
    rule = sampling if isinstance(sampling, Sampling) else Sampling(1.0) if sampling else GREEDY
    spec = tree_spec(speculate, target, head, depth, topk, num_draft_tokens, speculate_k, compile, log, lookup_slots, 1,
                     rule.temperature > 0, draft_vocab)
    trees = {1: spec} | {n: tree_spec(speculate, target, head, depth, topk, num_draft_tokens, speculate_k, compile, log, lookup_slots, n,
                                      rule.temperature > 0, draft_vocab, plain=True) for n in range(2, batch + 1)}
    gen = Generator(target, spec, head, draft_model, compile=compile, tokenizer=tokenizer, trees=trees)
    gen.reserve(min(context, target.args.block_size))
    gen.build(rule.kind, log)
    return gen, tokenizer


def add_model_flags(p, mode: bool = True):
    """The flags that say what load_generator builds (generate.py's, serve.py's and, without --speculate, bench.py's,
    whose --modes name several): the checkpoint, device and dtype, compiling, the mode, its head or draft LLM and its tree."""
    p.add_argument("--checkpoint", type=Path, default=None, help="converted checkpoint dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="default: bfloat16 on CUDA; on a CPU the faster of float32 and bfloat16, measured once per machine (dtypes.py)")
    p.add_argument("--compile", nargs="?", const="packed", default=False, choices=COMPILE_CHOICES, help="compile the steps before the first answer (CUDA graphs on a GPU); on a CPU packed: compiled once per machine and saved, max: Inductor's GEMM templates, auto: the faster of the two, measured (README)")
    if mode:
        p.add_argument("--speculate", default="none", help=f"one of {', '.join(MODES)}")
    p.add_argument("--draft", type=Path, default=None, help="EAGLE head dir (default: the shipped head of the default model)")
    p.add_argument("--draft-checkpoint", type=Path, default=None, help="draft LLM for --speculate sps")
    p.add_argument("--depth", type=int, default=None, help="eagle2: draft levels (default: sized for the device)")
    p.add_argument("--topk", type=int, default=None, help="eagle2: nodes expanded per level, children per node (default: sized for the device)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="eagle2: m, tree nodes verified besides the root (default: sized for the device)")
    p.add_argument("--lookup-slots", type=int, default=None, help="eagle2: this many more tree nodes, the prompt lookup chain continuing the root (default: min(3, depth) at T=0; none when sampling or in a batch; 0: none)")
    p.add_argument("--speculate-k", type=int, default=None, help="sps / lookup: draft chain length (default 4 / 6)")
    p.add_argument("--draft-vocab", type=int, default=None, help="draft over the head's N most frequent tokens (default: with a sized tree, all it has or its more frequent half, whichever the device's costs say is faster; else all it has; 0: the whole vocabulary)")


def load_target(checkpoint, device=None, dtype=None, log=log_stderr) -> Transformer:
    """The target on its device in its dtype (defaults: dtypes.py), sharded when run under torchrun."""
    device = device or dtypes.default_device()
    tp_rank = tp.maybe_init_dist()
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype or dtypes.default_dtype(device, log=log)
    # Under tensor parallelism the target is sharded on the CPU, so each GPU receives only its slice.
    target = load_model(checkpoint, "cpu" if tp_rank is not None else device, dtype)
    if tp_rank is not None:
        try:
            tp.apply_tp(target)
        except ValueError as e:
            raise UsageError(str(e)) from None
        target.to(device)
    return target


def check_options(speculate, depth=None, topk=None, num_draft_tokens=None, speculate_k=None, draft_vocab=None, lookup_slots=None, option="--speculate"):
    if speculate not in MODES:
        raise UsageError(f"unknown {option} {speculate!r}; choose from {', '.join(MODES)}")
    for flag, value in (("depth", depth), ("topk", topk), ("num-draft-tokens", num_draft_tokens), ("speculate-k", speculate_k)):
        if value is not None and value < 1:
            raise UsageError(f"--{flag} must be >= 1")
    if draft_vocab is not None and draft_vocab < 0:
        raise UsageError(f"--draft-vocab must be >= 0, got {draft_vocab}")
    if speculate != "eagle2" and (depth or topk or num_draft_tokens):
        raise UsageError(f"--depth, --topk and --num-draft-tokens shape the eagle2 tree, not {speculate}"
                         + (" (its chain length is --speculate-k)" if speculate in CHAINS else ""))
    if speculate not in CHAINS and speculate_k:
        raise UsageError(f"--speculate-k is the sps / lookup chain length, not {speculate}'s")
    if lookup_slots is not None and (speculate != "eagle2" or lookup_slots < 0):
        raise UsageError("--lookup-slots adds a non-negative number of nodes to the eagle2 tree")
    sizing.check_bounds(num_draft_tokens, depth, topk, speculate_k, lookup_slots)  # before the tree is sized


def tree_spec(speculate, target: Transformer, head: Optional[DraftHead], depth=None, topk=None, num_draft_tokens=None,
              speculate_k=None, compile=False, log=log_stderr, lookup_slots=None, batch: int = 1, sampling: bool = False,
              draft_vocab=None, plain: bool = False) -> Optional[TreeSpec]:
    """The cycle's shape. For eagle2, what is left open is sized for this device and batch size: sizing.measure_tree
    times the target and head once (compiled when the cycle will be) and caches the result. A sized tree's head, unless
    draft_vocab (--draft-vocab) was given, drafts over the more frequent half of its vocabulary where the costs say
    that is faster (sizing.draft_width, sizing.cut_vocab); the vocabulary is the one-sequence tree's, which a batch
    shares. plain: None where no tree is expected to beat plain steps at this batch size (eagle and eagle2 only)."""
    if speculate == "none":
        return None
    if speculate in CHAINS:
        return TreeSpec.chain(speculate, speculate_k or (4 if speculate == "sps" else 6))
    vocab = len(head.draft_vocab) or target.args.vocab_size
    k_max = topk or TreeSpec.static().topk
    if k_max > vocab:
        raise UsageError(f"--topk {k_max} exceeds the draft vocabulary of {vocab}")
    if speculate == "eagle":
        return TreeSpec.static()
    m, depth, k = num_draft_tokens, depth, topk
    lookup_slots = sizing.asked_lookup_slots(lookup_slots, sampling)
    if m and depth and k:
        if m > k + (depth - 1) * k * k:
            raise UsageError(f"--num-draft-tokens {m} exceeds the {k + (depth - 1) * k * k} candidates of depth {depth} and topk {k}")
    else:
        try:
            sized = sizing.measure_tree(target, head, m, depth, k, log=log, compile_fn=sizing_compile(target, head, compile) if compile else None,
                                        lookup=lookup_slots, batch=batch, sampling=sampling, plain=plain)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if sized is None:
            return None
        m, depth, k, width = sized
        if draft_vocab is None and batch == 1:
            sizing.cut_vocab(target, head, width)
    lookup_slots = sizing.lookup_slots(depth, lookup_slots, batch)
    if lookup_slots > depth:
        raise UsageError(f"--lookup-slots {lookup_slots} exceeds the tree's depth {depth}")
    return TreeSpec("eagle2", depth=depth, topk=k, num_draft_tokens=m, lookup_slots=lookup_slots)
