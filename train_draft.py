# Trains an EAGLE-1/2 (--arch eagle) or EAGLE-3 (--arch eagle3) draft head for a converted target checkpoint.
#
#   requests   from --prompts FILE.jsonl, or written by the target itself: its chat template up to the
#              content of a user turn, an opener from SEEDS, sampled at temperature 1 until the turn ends
#   answers    the target answers each request, batched and KV-cached (left padding), cached in --out
#   features   one target forward per conversation: post-norm hidden states h_t (what the LM head reads) and,
#              for EAGLE-3, the fused states entering the tap layers. Records: {tokens, prompt_len, hidden, fused}
#   eagle      head slot j reads (emb(x_{j+1}), f_j + noise) at RoPE position j and predicts f_{j+1};
#              loss = SmoothL1(pred, f_{j+1}) + 0.1 CE(softmax(lm_head(f_{j+1})) || lm_head(pred)), the CE over the
#              draft vocabulary (the answers' most frequent tokens) when there is one,
#              counted where x_{j+1} is an answer token. Embedding and LM head are the target's, frozen.
#   eagle3     training-time test: step 0, slot j reads (emb(x_{j+1}), fused_j); step i reads (emb(x_{j+1+i}), the
#              head's own step i-1 output) at RoPE position j+i, attending to step 0's keys up to slot j and its
#              own slot's keys of steps 1..i. Loss = sum_i decay^i CE(target distribution over the draft vocabulary
#              || head), at positions whose target argmax is in the draft vocabulary (as the official code: there
#              greedy drafting cannot be right, and the renormalised rest would teach the head the target's runners-up).
import argparse
import json
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

import sampling
from draft import Eagle3Head, EagleHead, load_head, save_head
from generate import UsageError, encode_prompt, load_model
from model import Attention, Transformer, apply_rope, causal_mask, eagle3_taps, rope_at
from tokenizer import format_chat, load_tokenizer

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
]  # fmt: skip
SENTINEL = "\x00request\x00"


@dataclass
class TrainConfig:
    checkpoint: Optional[Path] = None  # None: the embedded default model
    out: Path = Path("out/train_draft")
    prompts: Optional[Path] = None  # jsonl with "prompt" or "turns" (first turn); None: the target writes them
    num_prompts: int = 2000
    max_request_tokens: int = 96
    max_answer_tokens: int = 256
    gen_batch: int = 64  # rows generated (and featurised) at once
    temperature: float = 0.8  # answers; requests are sampled at 1.0
    greedy_fraction: float = 0.25  # answers decoded greedily, like the greedy runs the head serves
    top_p: float = 0.95
    epochs: int = 10
    batch_size: int = 8  # conversations per step
    lr: float = 3e-4
    warmup_steps: int = 100
    draft_vocab: int = 16384  # the head drafts over the N tokens most frequent in the answers (0: all)
    noise: float = 0.1  # U(-noise, noise) added to input features
    cls_weight: float = 0.1
    clip: float = 0.5  # gradient clipping by value, as the official code
    save_every: int = 500
    max_seconds: float = 0.0  # stop cleanly (data cached, state saved) after this long; 0 = no limit
    resume: bool = False
    init: Optional[Path] = None  # start from this head's weights (fine-tuning on new data)
    seed: int = 0
    device: Optional[str] = None
    dtype: Optional[str] = None  # the target's; the head trains in float32
    arch: str = "eagle"  # eagle (EAGLE-1/2) | eagle3
    ttt_steps: int = 7  # eagle3: draft steps unrolled in training (1: no training-time test)
    ttt_decay: float = 0.8  # eagle3: step i's loss weight is decay^i
    autocast: str = "auto"  # bf16 autocast: auto (where the device has native bf16 matmul) | on | off


# ---------------------------------------------------------------- batched sampling

def draw_rows(logits: Tensor, temperature: Tensor, top_p: float) -> Tensor:
    """One token per row; temperature [B], 0 = greedy."""
    scaled = logits.float() / temperature.clamp(min=1e-5)[:, None]
    sampled = sampling.sample(sampling.logits_to_probs(scaled, 1.0, 0, top_p))
    return torch.where(temperature == 0, logits.argmax(-1), sampled)


@torch.inference_mode()
def sample_batch(target: Transformer, prompts: list, max_new: int, temperature: Tensor, top_p: float, stop_ids) -> list:
    """Continues B prompts at once, left-padded. Returns each row's new tokens, up to and including its first stop."""
    device = target.tok_embeddings.weight.device
    B, P = len(prompts), max(map(len, prompts))
    pad = torch.tensor([P - len(p) for p in prompts], device=device)
    tokens = torch.tensor([[0] * (P - len(p)) + p for p in prompts], device=device)
    target.setup_caches(P + max_new, batch=B)
    slots = torch.arange(P + max_new, device=device)
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    temperature = temperature.to(device)

    def step(x: Tensor, start: int) -> Tensor:
        cache_pos = slots[start:start + x.shape[1]]
        mask = (slots >= pad[:, None, None]) & (slots <= cache_pos[:, None])
        mask = mask | (slots == cache_pos[:, None])  # pad rows see only themselves, so they stay finite
        h = target.features(x, (cache_pos - pad[:, None]).clamp(min=0), cache_pos, mask)
        return draw_rows(target.output(h[:, -1]), temperature, top_p)

    out = [step(tokens, 0)]
    done = torch.isin(out[0], stop)
    for t in range(1, max_new):
        if t % 16 == 0 and bool(done.all()):  # an occasional host sync, not one per step
            break
        out.append(step(out[-1][:, None], P + t - 1))
        done |= torch.isin(out[-1], stop)
    rows = torch.stack(out, 1).tolist()
    return [row[: next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))] for row in rows]


# ---------------------------------------------------------------- data: requests and answers

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


def request_template(family: str) -> tuple:
    """(text before a user turn's content, text that ends it) for the chat family."""
    before, after = format_chat(family, [{"role": "user", "content": SENTINEL}], add_generation_prompt=False).split(SENTINEL)
    return before, after.strip()


def clean_request(text: str, end: str, specials) -> str:
    text = text.split(end)[0] if end else text
    for s in specials:  # template markup in a request would be parsed as structure when re-encoded
        text = text.replace(s, "")
    return text.strip()


def write_requests(cfg: TrainConfig, target: Transformer, tokenizer, deadline: float) -> list:
    """Requests written by the target, appended to --out/requests.jsonl until there are num_prompts."""
    path, args = cfg.out / "requests.jsonl", target.args
    requests = [r["request"] for r in read_jsonl(path)]
    before, end = request_template(args.chat_template)
    bos = [args.bos_token] if args.bos_token is not None else []
    specials = list(getattr(tokenizer, "specials", {}))
    rng, seen = random.Random(cfg.seed + len(requests)), set(requests)
    torch.manual_seed(cfg.seed + len(requests))
    temperature = torch.ones(cfg.gen_batch)
    bar = tqdm(total=cfg.num_prompts, initial=min(len(requests), cfg.num_prompts), desc="requests", unit="req", file=sys.stderr)
    for _ in range(4 * math.ceil(cfg.num_prompts / cfg.gen_batch)):  # bounded: a weak target may repeat itself
        if len(requests) >= cfg.num_prompts or time.monotonic() > deadline:
            break
        openers = [rng.choice(SEEDS) for _ in range(cfg.gen_batch)]
        prompts = [bos + tokenizer.encode(before + o) for o in openers]
        new = []
        for opener, ids in zip(openers, sample_batch(target, prompts, cfg.max_request_tokens, temperature, 0.95, args.stop_tokens)):
            text = clean_request(opener + tokenizer.decode(ids), end, specials)
            if len(text.split()) > len(opener.split()) + 2 and text not in seen:
                seen.add(text)
                new.append(text)
        new = new[: cfg.num_prompts - len(requests)]
        append_jsonl(path, [{"request": r} for r in new])
        requests += new
        bar.update(len(new))
    bar.close()
    return requests


def answer_requests(cfg: TrainConfig, target: Transformer, tokenizer, requests: list, deadline: float) -> list:
    """Conversations {id, prompt_len, tokens}, cached in --out/conversations.jsonl (a rerun continues)."""
    path, args = cfg.out / "conversations.jsonl", target.args
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
        answers = sample_batch(target, [p for _, p in chunk], cfg.max_answer_tokens, torch.tensor(temps), cfg.top_p, args.stop_tokens)
        seconds += time.perf_counter() - t0
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


@torch.inference_mode()
def add_features(target: Transformer, convs: list, batch: int) -> list:
    """Each conversation once through the target (right-padded batches): tokens, post-norm features, prompt_len."""
    device = target.tok_embeddings.weight.device
    convs = sorted(convs, key=lambda c: len(c["tokens"]))
    data = []
    for b in tqdm(range(0, len(convs), batch), desc="features", unit="batch", file=sys.stderr):
        chunk = convs[b:b + batch]
        tokens = pad_sequence([torch.tensor(c["tokens"]) for c in chunk], batch_first=True).to(device)
        target.setup_caches(tokens.shape[1], batch=len(chunk))
        pos = torch.arange(tokens.shape[1], device=device)
        h, fused = target.hidden(tokens, pos, pos, causal_mask(pos, tokens.shape[1]))
        for row, c in enumerate(chunk):
            n = len(c["tokens"])
            data.append({"tokens": tokens[row, :n].clone(), "hidden": h[row, :n].clone(), "prompt_len": c["prompt_len"]}
                        | ({"fused": fused[row, :n].clone()} if target.taps else {}))
    return data


# ---------------------------------------------------------------- training

def count_draft_vocab(convs: list, size: int, vocab_size: int) -> Tensor:
    """`size` token ids: the answers' tokens, most frequent first, then unseen ids in ascending order (BPE
    ids follow merge order, a frequency ranking of the tokenizer's own corpus)."""
    counts = Counter(t for c in convs for t in c["tokens"][c["prompt_len"]:])
    seen = sorted(counts, key=lambda t: (-counts[t], t))
    unseen = (t for t in range(vocab_size) if t not in counts)
    return torch.tensor((seen + [t for _, t in zip(range(size - len(seen)), unseen)])[:size], dtype=torch.long)


def new_head(target: Transformer, max_len: int, draft_vocab: Tensor, arch: str = "eagle"):
    device, args = target.tok_embeddings.weight.device, replace(target.args, n_layer=1)
    if arch == "eagle3":
        draft_vocab = draft_vocab if len(draft_vocab) else torch.arange(target.args.vocab_size)
        head = Eagle3Head(args, len(draft_vocab), eagle3_taps(target.args.n_layer)).to(device)
        with torch.no_grad():  # start where the target ends: its final norm and its LM head rows
            head.norm.weight.copy_(target.norm.weight)
            head.lm_head.weight.copy_(target.output.weight[draft_vocab.to(device)])
    else:
        head = EagleHead(args, fc_bias=True, draft_vocab_size=len(draft_vocab)).to(device)
    head.draft_vocab.copy_(draft_vocab)
    head.setup_caches(max_len)
    head.layers[0].attention.kv_cache = None  # training attends within each batch's T slots under a [T, T] mask
    return head


def make_batch(data: list, idx: list) -> tuple:
    rows = [data[i] for i in idx]
    device = rows[0]["tokens"].device
    tokens = pad_sequence([r["tokens"] for r in rows], batch_first=True)
    hidden = pad_sequence([r["hidden"] for r in rows], batch_first=True)
    fused = pad_sequence([r["fused"] for r in rows], batch_first=True) if "fused" in rows[0] else None
    lengths = torch.tensor([len(r["tokens"]) for r in rows], device=device)
    prompt_lens = torch.tensor([r["prompt_len"] for r in rows], device=device)
    return tokens, hidden, fused, lengths, prompt_lens


def head_loss(head: EagleHead, embed: Tensor, lm_head: Tensor, batch: tuple, cfg: TrainConfig, **_):
    """-> (loss, stats: regression and classification loss, top-1 agreement with the target's argmax; tokens counted)."""
    tokens, feats, _, lengths, prompt_lens = batch
    T = tokens.shape[1] - 1
    slot = torch.arange(T, device=tokens.device)
    counted = (slot + 1 >= prompt_lens[:, None]) & (slot + 1 < lengths[:, None])
    feat_in = feats[:, :-1].float()
    feat_in = feat_in + (torch.rand_like(feat_in) * 2 - 1) * cfg.noise
    pred = head(F.embedding(tokens[:, 1:], embed), feat_in, slot, slot, causal_mask(slot, T))[counted]
    target = feats[:, 1:][counted].float()
    with torch.no_grad():  # over a draft vocabulary: the target's distribution restricted to it, renormalised
        target_probs = torch.softmax(F.linear(target, lm_head), dim=-1)
    logits = F.linear(pred, lm_head)
    reg = F.smooth_l1_loss(pred, target)
    cls = F.cross_entropy(logits, target_probs)
    acc = (logits.argmax(-1) == target_probs.argmax(-1)).float().mean()
    return reg + cfg.cls_weight * cls, {"reg": reg, "cls": cls, "acc": acc}, int(counted.sum())


class UnrolledAttention:
    """The head's attention over the unrolled steps of EAGLE-3's training-time test, called once per step.
    Step 0 attends causally over the batch's slots (true features); step i > 0 attends to step 0's keys up
    to its slot plus its own slot's keys from steps 1..i, the diagonal: what a draft node at depth i+1 sees
    at inference, the committed context and its ancestors. The diagonal is a dot product per slot, so a
    step costs one T x T attention whatever its depth."""

    def __init__(self, attention: Attention):
        self.attention, self.context, self.diagonal = attention, None, []

    def __call__(self, x: Tensor, rope: Tensor, cache_pos=None, mask=None) -> Tensor:
        a, (B, T, _) = self.attention, x.shape
        q_size, kv_size = a.n_head * a.head_dim, a.n_kv * a.head_dim
        q, k, v = a.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        group = a.n_head // a.n_kv  # GQA: query head n reads key head n // group, as SDPA's enable_gqa
        q = apply_rope(q.view(B, T, a.n_head, a.head_dim), rope).transpose(1, 2).float()
        k = apply_rope(k.view(B, T, a.n_kv, a.head_dim), rope).transpose(1, 2).repeat_interleave(group, 1).float()
        v = v.view(B, T, a.n_kv, a.head_dim).transpose(1, 2).repeat_interleave(group, 1).float()
        if self.context is None:
            self.context = (k, v)
        else:
            self.diagonal.append((k, v))
        k0, v0 = self.context
        scale = a.head_dim ** -0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [(q * ki).sum(-1, keepdim=True) * scale for ki, _ in self.diagonal]
        w = torch.softmax(torch.cat(scores, -1), -1)
        y = w[..., :T] @ v0
        for n, (_, vi) in enumerate(self.diagonal):
            y = y + w[..., T + n:T + n + 1] * vi
        return a.wo(y.transpose(1, 2).reshape(B, T, q_size).to(x.dtype))


@torch.no_grad()
def target_argmax(hidden: Tensor, lm_head: Tensor, rows: int = 2048) -> Tensor:
    """The target's argmax over its whole vocabulary, a chunk of rows at a time (the logits are large)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return torch.cat([(chunk @ lm_head.T).argmax(-1) for chunk in flat.split(rows)]).view(hidden.shape[:-1])


def unrolled_steps(head: Eagle3Head, embed: Tensor, tokens: Tensor, fused: Tensor, steps: int):
    """Yields the head's output [B, T, dim] at each unrolled step; tokens [B, T + steps] (padded), fused [B, T, *]."""
    B, T = fused.shape[:2]
    slot = torch.arange(T, device=tokens.device)
    h, attention = head.fc(fused.to(embed.dtype)), UnrolledAttention(head.layers[0].attention)
    for i in range(steps):
        emb = F.embedding(tokens[:, 1 + i:1 + i + T], embed)
        h = head.layers[0](emb, h, rope_at(head.rope, slot + i, B), None, None, attention=attention)
        yield h


def ttt_loss(head: Eagle3Head, embed: Tensor, lm_head: Tensor, batch: tuple, cfg: TrainConfig, lm_full: Tensor, in_draft: Tensor):
    """EAGLE-3's training-time test over cfg.ttt_steps unrolled steps (see the top of the file). lm_head: the
    target's rows for the draft vocabulary; lm_full: all its rows; in_draft: bool [V], the draft vocabulary.
    -> (loss, stats: step 0's CE and per-step top-1 agreement on counted positions; tokens counted at step 0)."""
    tokens, hidden, fused, lengths, prompt_lens = batch
    steps, T = cfg.ttt_steps, tokens.shape[1] - 1
    slot = torch.arange(T, device=tokens.device)
    tokens = F.pad(tokens, (0, steps))  # step i reads x_{j+1+i}; slots past a row's end are never counted
    after = F.pad(hidden[:, 1:].float(), (0, 0, 0, steps))  # the target state that step i at slot j predicts: after[:, j+i]
    keep_all = in_draft[target_argmax(after, lm_full)]
    loss, stats, counted0 = 0.0, {"acc_steps": []}, 0
    for i, h in enumerate(unrolled_steps(head, embed, tokens, fused[:, :T], steps)):
        counted = (slot + 1 + i >= prompt_lens[:, None]) & (slot + 1 + i < lengths[:, None])
        with torch.no_grad():  # the target's distribution restricted to the draft vocabulary, renormalised
            target_probs = torch.softmax((after[:, i:i + T][counted] @ lm_head.T).float(), -1)
            keep = keep_all[:, i:i + T][counted].float()
        logits = head.logits(h[counted]).float()
        ce = -(target_probs * F.log_softmax(logits, -1)).sum(-1)
        step_loss = (ce * keep).sum() / counted.sum().clamp(min=1)
        loss = loss + cfg.ttt_decay ** i * step_loss
        with torch.no_grad():
            agree = (logits.argmax(-1) == target_probs.argmax(-1)).float() * keep
            stats["acc_steps"].append(agree.sum() / keep.sum().clamp(min=1))
        if i == 0:
            stats["cls"], counted0 = step_loss, int(counted.sum())
    stats["acc"] = stats["acc_steps"][0]
    return loss, stats, counted0


def native_bf16(device: torch.device) -> bool:
    """bf16 matmuls run natively here (measured 3.7-5.7x fp32 on an AVX512-BF16 CPU, slower where emulated)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warm-up, then linear decay to 0 at the last step."""
    warm = max(1, cfg.warmup_steps)
    return cfg.lr * min((step + 1) / warm, (total - step) / max(1, total - warm))


def save_state(out: Path, head: EagleHead, opt, step: int):
    save_head(head, out / "head")
    tmp = out / "train_state.pt.tmp"
    torch.save({"step": step, "head": head.state_dict(), "optimizer": opt.state_dict()}, tmp)
    os.replace(tmp, out / "train_state.pt")  # a crash mid-write keeps the previous state


def train(cfg: TrainConfig, target: Transformer, data: list, draft_vocab: Tensor, deadline: float) -> int:
    """Returns the step reached. Appends one line per step to --out/train_log.jsonl. data: records
    {tokens, prompt_len, hidden, fused (eagle3)}, as add_features writes them."""
    head = new_head(target, max(len(d["tokens"]) for d in data) + cfg.ttt_steps, draft_vocab, cfg.arch)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95))
    step, state_path = 0, cfg.out / "train_state.pt"
    if cfg.resume:
        if not state_path.exists():
            raise UsageError(f"--resume: no {state_path}")
        state = torch.load(state_path, map_location=target.tok_embeddings.weight.device, weights_only=True)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    else:
        if cfg.init:
            weights = load_head(cfg.init, target.args, target.tok_embeddings.weight.device).state_dict()
            own = head.state_dict()
            head.load_state_dict({k: v for k, v in weights.items() if k != "draft_vocab" and k in own and v.shape == own[k].shape}, strict=False)
        if (cfg.out / "train_log.jsonl").exists():
            (cfg.out / "train_log.jsonl").unlink()
    embed = target.tok_embeddings.weight.detach().float()
    lm_full = lm_head = target.output.weight.detach().float()
    if len(head.draft_vocab):
        lm_head = lm_head[head.draft_vocab.to(lm_head.device)]
    in_draft = torch.zeros(len(lm_full), dtype=torch.bool, device=lm_full.device).index_fill_(0, head.draft_vocab.to(lm_full.device), True)
    loss_fn = ttt_loss if cfg.arch == "eagle3" else head_loss
    device = target.tok_embeddings.weight.device
    bf16 = cfg.autocast == "on" or (cfg.autocast == "auto" and native_bf16(device))
    per_epoch = math.ceil(len(data) / cfg.batch_size)
    total = cfg.epochs * per_epoch
    torch.manual_seed(cfg.seed + step)
    bar = tqdm(total=total, initial=step, desc="train", unit="step", file=sys.stderr)
    ema, seen_tokens, t0 = None, 0, time.perf_counter()
    while step < total and time.monotonic() < deadline:
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch)).tolist()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg, total)
        batch = make_batch(data, order[i * cfg.batch_size:(i + 1) * cfg.batch_size])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, stats, n = loss_fn(head, embed, lm_head, batch, cfg, lm_full=lm_full, in_draft=in_draft)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(head.parameters(), cfg.clip)
        opt.step()
        step += 1
        seen_tokens += n
        stats = {"step": step, "loss": loss.item(), "lr": opt.param_groups[0]["lr"]} | {
            k: [round(x.item(), 4) for x in v] if isinstance(v, list) else v.item() for k, v in stats.items()}
        append_jsonl(cfg.out / "train_log.jsonl", [stats])
        ema = stats if ema is None else {k: 0.95 * ema[k] + 0.05 * stats[k] for k in ("loss", "acc")}
        bar.update(1)
        bar.set_postfix(loss=f"{ema['loss']:.3f}", acc=f"{ema['acc']:.3f}", epoch=epoch)
        if step % cfg.save_every == 0:
            save_state(cfg.out, head, opt, step)
    bar.close()
    save_state(cfg.out, head, opt, step)
    seconds = time.perf_counter() - t0
    if seen_tokens:
        print(f"train: {seen_tokens} answer tokens in {seconds:.1f} s, {seen_tokens / seconds:.1f} tokens/s; step {step}/{total}", file=sys.stderr)
    return step


# ---------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(description="Train an EAGLE-1/2 or EAGLE-3 draft head on conversations the target itself answers.")
    p.add_argument("--checkpoint", type=Path, default=d.checkpoint, help="converted target dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, default=d.out, help="data cache, head/ and train_state.pt")
    p.add_argument("--prompts", type=Path, default=d.prompts, help="jsonl of requests ('prompt' or 'turns'); default: the target writes them")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--max-request-tokens", type=int, default=d.max_request_tokens)
    p.add_argument("--max-answer-tokens", type=int, default=d.max_answer_tokens)
    p.add_argument("--gen-batch", type=int, default=d.gen_batch, help="rows generated at once")
    p.add_argument("--temperature", type=float, default=d.temperature, help="answer sampling temperature")
    p.add_argument("--greedy-fraction", type=float, default=d.greedy_fraction, help="share of answers decoded greedily")
    p.add_argument("--top-p", type=float, default=d.top_p, help="answer top-p")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="conversations per training step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help="draft over the N most frequent answer tokens (0: the whole vocabulary)")
    p.add_argument("--noise", type=float, default=d.noise, help="uniform noise half-width on input features")
    p.add_argument("--cls-weight", type=float, default=d.cls_weight)
    p.add_argument("--clip", type=float, default=d.clip, help="gradient clipping by value")
    p.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints")
    p.add_argument("--max-seconds", type=float, default=d.max_seconds, help="stop cleanly after this long (rerun, with --resume once training started)")
    p.add_argument("--resume", action="store_true", help="continue training from --out/train_state.pt")
    p.add_argument("--init", type=Path, default=d.init, help="start from this head's weights instead of a fresh head")
    p.add_argument("--arch", choices=["eagle", "eagle3"], default=d.arch, help="eagle: EAGLE-1/2 head; eagle3: EAGLE-3 head with training-time test")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="eagle3: draft steps unrolled in training (official 7)")
    p.add_argument("--ttt-decay", type=float, default=d.ttt_decay, help="eagle3: loss weight decay per unrolled step (official 0.8)")
    p.add_argument("--autocast", choices=["auto", "on", "off"], default=d.autocast, help="bf16 autocast (auto: where bf16 matmul is native)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=d.dtype, help="target dtype (default: bfloat16 on CUDA, float32 on CPU)")
    return p


def check_config(cfg: TrainConfig):
    for name in ("num_prompts", "max_request_tokens", "max_answer_tokens", "gen_batch", "epochs", "batch_size", "save_every", "ttt_steps"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.draft_vocab < 0:
        raise UsageError("--draft-vocab must be >= 0")
    if not 0 <= cfg.greedy_fraction <= 1 or not 0 < cfg.top_p <= 1 or cfg.temperature <= 0:
        raise UsageError("need 0 <= --greedy-fraction <= 1, 0 < --top-p <= 1 and --temperature > 0")


def run(cfg: TrainConfig) -> int:
    check_config(cfg)
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    torch.set_float32_matmul_precision("high")  # TF32 for the head's fp32 matmuls on GPUs that have it
    checkpoint = cfg.checkpoint
    if checkpoint is None:
        from convert_hf_checkpoint import default_checkpoint

        checkpoint = default_checkpoint()
    target = load_model(checkpoint, device, dtype).requires_grad_(False)
    tokenizer = load_tokenizer(checkpoint)
    cfg.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (cfg.max_seconds or math.inf)
    requests = file_requests(cfg.prompts)[: cfg.num_prompts] if cfg.prompts else write_requests(cfg, target, tokenizer, deadline)
    convs = answer_requests(cfg, target, tokenizer, requests, deadline)
    if len(convs) < len(requests) or (not cfg.prompts and len(requests) < cfg.num_prompts and time.monotonic() > deadline):
        print(f"stopped after {cfg.max_seconds} s with {len(convs)} conversations: rerun to continue", file=sys.stderr)
        return 0
    if not convs:
        raise UsageError("no usable requests: pass --prompts FILE.jsonl")
    target.taps = eagle3_taps(target.args.n_layer) if cfg.arch == "eagle3" else ()  # add_features then records the fused states
    draft_vocab = (count_draft_vocab(convs, cfg.draft_vocab, target.args.vocab_size)
                   if 0 < cfg.draft_vocab < target.args.vocab_size else torch.zeros(0, dtype=torch.long))
    train(cfg, target, add_features(target, convs, cfg.gen_batch), draft_vocab, deadline)
    print(f"wrote {cfg.out / 'head'}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    try:
        return run(TrainConfig(**vars(build_parser().parse_args(argv))))
    except (UsageError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
