# Self-distillation data for draft heads: the target writes requests, answers them, and its features are stored.
#
#   requests   from a jsonl file, or written by the target itself: its chat template up to the content of a user
#              turn, an opener from SEEDS, sampled at temperature 1 until the turn ends; MT-bench look-alikes dropped
#   answers    the target answers each request, B rows at once (left padding, fixed shapes, a compiled step)
#   features   post-norm states ("hidden", what the LM head reads) and EAGLE-3's fused input ("fused", the states
#              entering three layers) at every position, bf16 safetensors shards: taken from the passes that wrote
#              the answers; a right-padded feature pass only for conversations whose states were lost (a stop)
#
# Everything lives in one data directory and a rerun continues where the last one stopped; load_records reads it.
import contextlib
import fcntl
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

import ops
from cpu import linears
from errors import UsageError
from model import Transformer, causal_mask, eagle3_taps, find_multiple
from prompts import CODE_MATH, MT_BENCH, load_conversations
from sampling import sample
from tokenizer import encode_prompt, format_chat

# Openers for self-written requests, so the target writes about many topics and task types.
SEEDS = [
    "Write a short poem about", "Write a haiku about", "Write a limerick about", "Write a story about",
    "Write a dialogue between", "Give me a recipe for", "What is a healthy breakfast", "Write a Python function that",
    "Write a JavaScript function that", "Write a SQL query that", "Debug this code:", "Explain", "Explain to a child",
    "Explain the concept of", "Compare", "What is the difference between", "What are the pros and cons of", "Summarize",
    "How do I", "How does", "Why does", "What causes", "What would happen if", "Is it true that", "Who was",
    "Tell me about the history of", "What were the main causes of", "A train leaves a station at",
    "If a store sells apples for", "Solve for x:", "Calculate", "How many", "Prove that", "Convert",
    "Translate into French:", "Rewrite this sentence to be more formal:", "Write an email to my boss about",
    "Help me write a cover letter for", "I have a job interview tomorrow for", "Give me tips on", "Give me a step-by-step guide to",
    "What is the best way to", "Create a weekly workout plan for", "Plan a three-day trip to", "Recommend some books about",
    "Suggest a name for", "Brainstorm ideas for", "Design a", "Outline an essay on", "Write a product description for",
    "List five", "Describe",
    # task kinds the list above missed: role play, extraction and editing of a given text, judging
    "Pretend you are", "Imagine you are", "Act as", "You are a", "Extract the", "Given the following text,",
    "Read the passage below and", "Identify the", "Classify the following", "Edit the following paragraph",
    "Evaluate the following", "Analyze", "Write a persuasive essay", "Compose an engaging blog post about", "Draft a",
    "Craft a",
]  # fmt: skip
SENTINEL = "\x00request\x00"
SLOT_ROUND = 128  # cache lengths are rounded up to this, so the compiled step sees few shapes


@dataclass
class DataConfig:
    out: Path = Path("out/train_draft")
    data_dir: Optional[Path] = None  # requests, conversations and features; None: --out (several runs may share one)
    prompts: Optional[Path] = None  # jsonl with "prompt" or "turns" (first turn); None: the target writes them
    holdout: Optional[Path] = MT_BENCH  # benchmark questions (MT-bench) kept out of self-written requests
    num_prompts: int = 2000
    max_request_tokens: int = 96
    max_answer_tokens: int = 256
    gen_batch: int = 64  # rows generated at once (fixed: short batches are padded)
    feature_tokens: int = 16384  # tokens per feature forward (rows x longest row)
    shard_convs: int = 256  # conversations per feature shard
    temperature: float = 0.8  # answers; requests are sampled at 1.0
    greedy_fraction: float = 0.25  # answers decoded greedily, like the greedy runs the head serves
    top_p: float = 0.95
    compile: bool = True  # the batched decode step (fixed shapes, fullgraph) and the feature pass's layer (dynamic)
    seed: int = 0

    @property
    def data(self) -> Path:
        return self.data_dir or self.out


# ---------------------------------------------------------------- batched sampling

def draw_rows(logits: Tensor, temperature: Tensor, top_p: float) -> Tensor:
    """One token per row; temperature [B], 0 = greedy. sampling.py's rule (temperature, then top-p) in a form cheap
    for many rows over a large vocabulary: see nucleus()."""
    if top_p >= 1.0:
        choice = sample(torch.softmax(logits.float() / temperature.clamp(min=1e-5)[:, None], dim=-1))
    else:
        probs, ids = nucleus(logits, temperature, top_p)
        choice = ids.gather(-1, sample(probs)[:, None]).squeeze(-1)
    return torch.where(temperature == 0, ops.argmax(logits), choice)


NUCLEUS_CANDIDATES = 256  # where nucleus() looks for the top-p nucleus: this many most likely tokens


def nucleus(logits: Tensor, temperature: Tensor, top_p: float) -> tuple:
    """The top-p nucleus sought among the NUCLEUS_CANDIDATES most likely tokens of each row: a top-k of the logits
    instead of a sort of the vocabulary or a bisection over all of it (several times dearer). Exact unless a nucleus holds more tokens than that (a flat distribution); then its
    tail past them is cut, a negligible change for training data. -> (probabilities [B, K] over the whole vocabulary,
    zero outside the nucleus; their token ids [B, K])."""
    scaled = logits.float() / temperature.clamp(min=1e-5)[:, None]
    top, ids = scaled.topk(min(NUCLEUS_CANDIDATES, scaled.shape[-1]), dim=-1)  # sorted, most likely first
    probs = torch.exp(top - torch.logsumexp(scaled, dim=-1, keepdim=True))
    return probs * ((probs.cumsum(-1) - probs) < top_p), ids  # as sampling.py: drop a token once the mass before it reaches top_p


def prefill_rows(target: Transformer, tokens: Tensor, pad: Tensor, temperature: Tensor, top_p: float) -> tuple:
    """Left-padded prompts [B, P] into cache slots [0, P); row b's prompt starts at slot pad[b]. -> (a token per row,
    the states at every slot [B, P, *]: hidden (post-norm) and draft features, bf16 as stored)."""
    cache_pos = torch.arange(tokens.shape[1], device=tokens.device)
    mask = (cache_pos >= pad[:, None, None]) & (cache_pos <= cache_pos[:, None])
    mask = mask | (cache_pos == cache_pos[:, None])  # pad slots see only themselves, so they stay finite
    h, feats = target.hidden(tokens, (cache_pos - pad[:, None]).clamp(min=0), cache_pos, mask)
    return draw_rows(target.output(h[:, -1]), temperature, top_p), h.to(torch.bfloat16), feats.to(torch.bfloat16)


def decode_rows(target: Transformer, x: Tensor, slot: Tensor, pad: Tensor, temperature: Tensor, top_p: float,
                width: int) -> tuple:
    """x [B] the tokens entering cache slot `slot` [1], attending to the first `width` slots (> slot): every shape
    fixed by (B, width), no host sync. -> (the next token per row, x's states [B, *] as prefill_rows')."""
    slots = torch.arange(width, device=x.device)
    mask = ((slots >= pad[:, None]) & (slots <= slot))[:, None, :]  # [B, 1, width]
    h, feats = target.hidden(x[:, None], (slot - pad)[:, None], slot, mask)
    return draw_rows(target.output(h[:, -1]), temperature, top_p), h[:, -1].to(torch.bfloat16), feats[:, -1].to(torch.bfloat16)


_compiled_decode = {}


def decode_fn(compile: bool):
    if not compile:
        return decode_rows
    if "fn" not in _compiled_decode:  # one compiled function: its cache holds a graph per (B, width, taps, cache length)
        fn = torch.compile(decode_rows, fullgraph=True, dynamic=False)
        _compiled_decode["fn"] = torch._dynamo.config.patch(recompile_limit=64)(fn)  # a data job needs more than 8
    return _compiled_decode["fn"]


@torch.inference_mode()
def sample_batch(target: Transformer, prompts: list, max_new: int, temperature: Tensor, top_p: float, stop_ids,
                 batch: int = 0, compile: bool = False, states: bool = False) -> list:
    """Continues the prompts at once, left-padded, in rows of `batch` (default: len(prompts); short batches are
    padded with dummy rows so every call has the same shapes). Returns each row's new tokens, up to and
    including its first stop; with `states`, (new tokens, hidden, feats) per row: the target's states at every
    prompt and answer position (prefill_rows'), taken from the passes that wrote the answer."""
    device = target.tok_embeddings.weight.device
    batch = batch or len(prompts)
    out_rows = []
    for b in range(0, len(prompts), batch):
        chunk, temps = prompts[b:b + batch], temperature[b:b + batch]
        n = len(chunk)
        chunk = chunk + [chunk[0][-1:]] * (batch - n)  # dummy rows: one token, greedy
        temps = torch.cat([temps.float(), temps.new_zeros(batch - n, dtype=torch.float)]).to(device)
        P = max(map(len, chunk))
        S = find_multiple(P + max_new, SLOT_ROUND)
        cache = target.layers[0].attention.kv_cache
        if target.max_seq_length < S or cache is None or cache.k_cache.shape[0] != batch:  # steps read only `width` slots
            target.setup_caches(S, batch=batch)
        pad = torch.tensor([P - len(p) for p in chunk], device=device)
        tokens = torch.tensor([[0] * (P - len(p)) + p for p in chunk], device=device)
        stop = torch.tensor(list(stop_ids) or [-1], dtype=torch.long, device=device)
        step = decode_fn(compile)
        first, h, feats = prefill_rows(target, tokens, pad, temps, top_p)
        out, hs, fs = [first], [h], [feats]
        done = torch.isin(out[0], stop)
        slot = torch.tensor([P], device=device)
        while True:
            last = len(out) == max_new or (len(out) % 16 == 0 and bool(done[:n].all()))  # a host sync every 16 steps
            if last and not states:
                break
            # the slot written is P + len(out) - 1; with states, the last step only reads the last token's states
            token, h, feats = step(target, out[-1], slot, pad, temps, top_p, find_multiple(P + len(out), SLOT_ROUND))
            hs.append(h[:, None]), fs.append(feats[:, None])
            if last:
                break
            out.append(token)
            slot += 1
            done |= torch.isin(token, stop)
        rows = torch.stack(out, 1)[:n].tolist()
        ends = [next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row)) for row in rows]
        if not states:
            out_rows += [row[:end] for row, end in zip(rows, ends)]
            continue
        hs, fs = torch.cat(hs, 1), torch.cat(fs, 1)
        out_rows += [(row[:end], hs[r, P - len(p):P + end], fs[r, P - len(p):P + end])
                     for r, (row, end, p) in enumerate(zip(rows, ends, chunk))]
    return out_rows


# ---------------------------------------------------------------- requests and answers

def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def append_jsonl(path: Path, records: list):
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def file_requests(path: Path) -> list:
    requests = []
    for r in read_jsonl(path):
        text = r.get("prompt") or (r.get("turns") or [None])[0]
        if not isinstance(text, str) or not text.strip():
            raise UsageError(f"{path}: every line needs a non-empty 'prompt' or 'turns' field")
        requests.append(text)
    return requests


def words(text: str) -> list:
    return re.findall(r"[a-z0-9]+", text.lower())


class Holdout:
    """Benchmark questions kept out of training: a request matches one when it shares a run of n words with
    it (n = 8, or the whole request when shorter), case and punctuation ignored."""

    def __init__(self, path: Optional[Path], n: int = 8):
        """path: a benchmark file, kept out beside the project's own (prompts.CODE_MATH); None keeps nothing out."""
        self.n, self.grams, self.whole = n, set(), set()
        paths = [] if path is None else [path, CODE_MATH] if CODE_MATH.exists() else [path]  # one read twice adds nothing
        for turns in (t for p in paths for t in load_conversations(p)):
            for turn in turns:
                w = words(turn)
                self.whole.add(" ".join(w))
                self.grams.update(" ".join(w[i:i + n]) for i in range(len(w) - n + 1))

    def __contains__(self, text: str) -> bool:
        w = words(text)
        if len(w) < self.n:
            return any(" ".join(w) in q for q in self.whole) if w else False
        return any(" ".join(w[i:i + self.n]) in self.grams for i in range(len(w) - self.n + 1))


def request_template(family: str) -> tuple:
    """(text before a user turn's content, text that ends it) for the chat family."""
    before, after = format_chat(family, [{"role": "user", "content": SENTINEL}], add_generation_prompt=False).split(SENTINEL)
    return before, after.strip()


def clean_request(text: str, end: str, specials) -> str:
    text = text.split(end)[0] if end else text
    for s in specials:  # template markup in a request would be parsed as structure when re-encoded
        text = text.replace(s, "")
    return text.strip()


def write_requests(cfg: DataConfig, target: Transformer, tokenizer, want: int, deadline: float) -> list:
    """Requests written by the target, appended to requests.jsonl until there are `want`."""
    path, args = cfg.data / "requests.jsonl", target.args
    holdout = Holdout(cfg.holdout)
    requests = [r["request"] for r in read_jsonl(path)]
    before, end = request_template(args.chat_template)
    bos = [args.bos_token] if args.bos_token is not None else []
    specials = list(getattr(tokenizer, "specials", {}))
    rng, seen = random.Random(cfg.seed + len(requests)), set(requests)
    torch.manual_seed(cfg.seed + len(requests))
    temperature = torch.ones(cfg.gen_batch)
    bar = tqdm(total=want, initial=min(len(requests), want), desc="requests", unit="req", file=sys.stderr)
    dropped = 0
    for _ in range(4 * math.ceil(max(want - len(requests), 0) / cfg.gen_batch)):  # bounded: a weak target may repeat itself
        if len(requests) >= want or time.monotonic() > deadline:
            break
        openers = [rng.choice(SEEDS) for _ in range(cfg.gen_batch)]
        prompts = [bos + tokenizer.encode(before + o) for o in openers]
        new = []
        rows = sample_batch(target, prompts, cfg.max_request_tokens, temperature, 0.95, args.stop_tokens, cfg.gen_batch, cfg.compile)
        for opener, ids in zip(openers, rows):
            text = clean_request(opener + tokenizer.decode(ids), end, specials)
            if len(text.split()) > len(opener.split()) + 2 and text not in seen:
                seen.add(text)
                if text in holdout:
                    dropped += 1
                else:
                    new.append(text)
        new = new[: want - len(requests)]
        append_jsonl(path, [{"request": r} for r in new])
        requests += new
        bar.update(len(new))
    bar.close()
    if dropped:
        print(f"requests: dropped {dropped} that match a held-out benchmark question", file=sys.stderr)
    return requests


def answer_requests(cfg: DataConfig, target: Transformer, tokenizer, requests: list, deadline: float, states: dict) -> list:
    """Conversations {id, temperature, prompt_len, tokens} in conversations.jsonl (a rerun continues); the new ones'
    states (hidden, fused) into `states` by id, for write_features."""
    path, args = cfg.data / "conversations.jsonl", target.args
    convs = read_jsonl(path)
    answered = {c["id"] for c in convs}
    todo = [(i, encode_prompt(tokenizer, args, [{"role": "user", "content": r}], bool(args.chat_template)))
            for i, r in enumerate(requests) if i not in answered]
    todo.sort(key=lambda item: len(item[1]))  # similar lengths share a batch: less left padding
    rng = random.Random(cfg.seed + len(convs))
    torch.manual_seed(cfg.seed + len(convs))
    new_tokens, seconds = 0, 0.0
    bar = tqdm(total=len(requests), initial=len(convs), desc="answers", unit="conv", file=sys.stderr)
    for b in range(0, len(todo), cfg.gen_batch):
        if time.monotonic() > deadline:
            break
        chunk = todo[b:b + cfg.gen_batch]
        temps = [0.0 if rng.random() < cfg.greedy_fraction else cfg.temperature for _ in chunk]
        t0 = time.perf_counter()
        with tapped(target):
            rows = sample_batch(target, [p for _, p in chunk], cfg.max_answer_tokens, torch.tensor(temps), cfg.top_p,
                                args.stop_tokens, cfg.gen_batch, cfg.compile, states=True)
        seconds += time.perf_counter() - t0
        answers = [a for a, _, _ in rows]
        states.update({i: (h, f) for (i, _), (_, h, f) in zip(chunk, rows)})
        new_tokens += sum(map(len, answers))
        batch = [{"id": i, "temperature": t, "prompt_len": len(p), "tokens": p + a} for (i, p), a, t in zip(chunk, answers, temps)]
        append_jsonl(path, batch)
        convs += batch
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{new_tokens / seconds:.0f}")
    bar.close()
    if new_tokens:
        print(f"answers: {new_tokens} tokens in {seconds:.1f} s, {new_tokens / seconds:.1f} tokens/s", file=sys.stderr)
    return convs


# ---------------------------------------------------------------- features

def feature_dir(data: Path) -> Path:
    return data / "features"


def shard_paths(data: Path) -> list:
    return sorted(feature_dir(data).glob("shard-*.safetensors"))


def featurised_ids(data: Path) -> set:
    from safetensors import safe_open

    done = set()
    for path in shard_paths(data):
        with safe_open(str(path), "pt") as f:
            done.update(f.get_tensor("ids").tolist())
    return done


def read_safetensors_mmap(path: Path) -> dict:
    """name -> tensor viewing a memory map of the file: pages are read when touched, never copied whole."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    data = torch.from_file(str(path), shared=False, size=os.path.getsize(path), dtype=torch.uint8)[8 + n:]
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64, "I32": torch.int32}
    return {name: data[a:b].view(dtypes[h["dtype"]]).view(h["shape"]) for name, h in header.items() for a, b in [h["data_offsets"]]}


@contextlib.contextmanager
def tapped(target: Transformer):
    """The target's draft features are EAGLE-3's fused ones while inside: what the shards store."""
    taps, target.taps = target.taps, eagle3_taps(target.args.n_layer)
    try:
        yield
    finally:
        target.taps = taps


def call_layer(layer, x: Tensor, rope: Tensor, cache_pos: Tensor, mask: Tensor) -> Tensor:
    return layer(x, rope, cache_pos, mask)


_compiled_layer = {}


def feature_layer(compile: bool):
    """How the feature pass runs a layer: compiled once for every layer and batch shape (dynamic), the elementwise
    work between the matmuls fused; eager otherwise. Without duck sizing, which would give a batch of 2 rows the
    symbol of RoPE's pairs and then specialise the graph on it."""
    if not compile:
        return None
    if "fn" not in _compiled_layer:
        fn = torch.compile(call_layer, dynamic=True)
        _compiled_layer["fn"] = torch.fx.experimental._config.patch(use_duck_shape=False)(fn)
    return _compiled_layer["fn"]


@contextlib.contextmanager
def cacheless(target: Transformer):
    """Attention over the rows themselves while inside, no KV cache read or written: a feature pass keeps none,
    and its compiled layer then sees no cache whose batch size it would specialise on."""
    caches = [layer.attention.kv_cache for layer in target.layers]
    for layer in target.layers:
        layer.attention.kv_cache = None
    try:
        yield
    finally:
        for layer, cache in zip(target.layers, caches):
            layer.attention.kv_cache = cache


@torch.inference_mode()
def featurize(target: Transformer, convs: list, max_tokens: int, compile: bool = False) -> dict:
    """Conversations through the target in right-padded batches of at most max_tokens (rows x longest) -> their
    states by id: (hidden [T, dim], fused [T, 3 dim]), bf16. For conversations whose answers were written
    elsewhere; answer_requests keeps the states of its own."""
    if not convs:
        return {}
    device = target.tok_embeddings.weight.device
    run_layer = feature_layer(compile)
    convs = sorted(convs, key=lambda c: len(c["tokens"]))
    states = {}
    b = 0
    target.setup_caches(len(convs[-1]["tokens"]))  # for its RoPE table
    with tapped(target), cacheless(target):
        while b < len(convs):
            e = b + 1  # rows sorted by length: grow the batch while rows x longest fits
            while e < len(convs) and (e + 1 - b) * len(convs[e]["tokens"]) <= max_tokens:
                e += 1
            chunk, b = convs[b:e], e
            tokens = pad_sequence([torch.tensor(c["tokens"]) for c in chunk], batch_first=True).to(device)
            T = tokens.shape[1]
            pos = torch.arange(T, device=device)
            h, f = target.hidden(tokens, pos, pos, causal_mask(pos, T), run_layer=run_layer)
            for row, c in enumerate(chunk):
                n = len(c["tokens"])
                states[c["id"]] = (h[row, :n].to(torch.bfloat16).cpu(), f[row, :n].to(torch.bfloat16).cpu())
    return states


def shard_tensors(convs: list, states: dict) -> dict:
    """One shard's tensors: flat tokens, hidden [N, dim] and fused [N, 3 dim] bf16, offsets, prompt_len, ids."""
    lengths = torch.tensor([len(c["tokens"]) for c in convs])
    return {
        "tokens": torch.tensor([t for c in convs for t in c["tokens"]], dtype=torch.int32),
        "hidden": torch.cat([states[c["id"]][0] for c in convs]),
        "fused": torch.cat([states[c["id"]][1] for c in convs]),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_len": torch.tensor([c["prompt_len"] for c in convs]),
        "ids": torch.tensor([c["id"] for c in convs]),
    }


def write_features(cfg: DataConfig, target: Transformer, convs: list, deadline: float, final: bool = True,
                   states: Optional[dict] = None) -> int:
    """Features for conversations no shard holds yet, shard_convs per shard, from `states` (answer_requests') or
    else a feature pass; a partial shard is written only when `final` (more conversations may be coming). Written
    states leave `states`. Returns the number of conversations stored now."""
    from safetensors.torch import save_file

    states = {} if states is None else states
    out = feature_dir(cfg.data)
    out.mkdir(parents=True, exist_ok=True)
    done = featurised_ids(cfg.data)
    todo = [c for c in convs if c["id"] not in done]
    count, tokens, seconds = 0, 0, 0.0
    index = len(shard_paths(cfg.data))
    for b in range(0, len(todo), cfg.shard_convs):
        chunk = todo[b:b + cfg.shard_convs]
        missing = [c for c in chunk if c["id"] not in states]
        if (missing and time.monotonic() > deadline) or (len(chunk) < cfg.shard_convs and not final):
            break  # states in hand are written past the deadline: a shard costs seconds, a feature pass minutes
        t0 = time.perf_counter()
        states.update(featurize(target, missing, cfg.feature_tokens, cfg.compile))
        seconds += time.perf_counter() - t0
        shard = shard_tensors(chunk, states)
        path = out / f"shard-{index:05d}.safetensors"
        save_file(shard, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)  # a crash mid-write leaves no half shard
        for c in chunk:
            del states[c["id"]]
        index, count = index + 1, count + len(chunk)
        if missing:
            tokens += sum(len(c["tokens"]) for c in missing)
            print(f"features: {path.name}, {len(chunk)} conversations ({len(missing)} through a feature pass, "
                  f"{tokens / seconds:.0f} tokens/s so far)", file=sys.stderr)
        else:
            print(f"features: {path.name}, {len(chunk)} conversations, {len(shard['tokens'])} tokens", file=sys.stderr)
    return count


def load_records(data: Path, keys=("hidden", "fused")) -> list:
    """Every stored conversation: {"tokens": LongTensor[T], "prompt_len": int, "hidden": [T, dim] bf16,
    "fused": [T, 3 dim] bf16}. Features are views of memory-mapped shards: nothing is read until used."""
    records = []
    for path in shard_paths(Path(data)):
        shard = read_safetensors_mmap(path)
        offsets, prompt_lens = shard["offsets"].tolist(), shard["prompt_len"].tolist()
        for i, prompt_len in enumerate(prompt_lens):
            a, b = offsets[i], offsets[i + 1]
            record = {"tokens": shard["tokens"][a:b].long(), "prompt_len": prompt_len}
            record.update({k: shard[k][a:b] for k in keys})
            records.append(record)
    return records


# ---------------------------------------------------------------- the whole pipeline

def build(cfg: DataConfig, target: Transformer, tokenizer, deadline: float, round_convs: int = 0) -> tuple:
    """Requests, answers and features into cfg.data, in rounds of round_convs conversations (default: 8 batches)
    so that a stop at any time leaves usable data. -> (conversations, True when all num_prompts are done)."""
    cfg.data.mkdir(parents=True, exist_ok=True)
    lock = open(cfg.data / ".lock", "w")  # two writers would interleave requests.jsonl and answer each other's ids
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise UsageError(f"{cfg.data} is being written by another process") from None
    # Packed weights (the rows kernel in bf16) sample faster (docs/training.md); the target stays usable for training,
    # which reads its weights only.
    linears.pack_linears(target)
    with lock:
        return _build(cfg, target, tokenizer, deadline, round_convs)


def _build(cfg: DataConfig, target: Transformer, tokenizer, deadline: float, round_convs: int) -> tuple:
    round_convs = round_convs or max(cfg.shard_convs, 8 * cfg.gen_batch)
    fixed = file_requests(cfg.prompts)[: cfg.num_prompts] if cfg.prompts else None
    convs = read_jsonl(cfg.data / "conversations.jsonl")
    states = {}  # the answers' states, by conversation id, until a shard holds them
    while True:
        want = min(cfg.num_prompts, len(convs) + round_convs)
        requests = fixed[:want] if fixed is not None else write_requests(cfg, target, tokenizer, want, deadline)
        convs = answer_requests(cfg, target, tokenizer, requests, deadline, states)
        complete = len(convs) >= len(requests) and len(requests) >= (len(fixed) if fixed is not None else cfg.num_prompts)
        stalled = fixed is None and len(requests) < want and time.monotonic() <= deadline  # the target stopped writing new ones
        write_features(cfg, target, convs, deadline, complete or stalled or time.monotonic() > deadline, states)
        if complete or stalled or time.monotonic() > deadline:
            return convs, (complete or stalled) and {c["id"] for c in convs} <= featurised_ids(cfg.data)

