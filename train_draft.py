# Trains an EAGLE-1/2 draft head for a converted target checkpoint, on data distill.py writes and stores.
#
#   data       distill.py: self-written requests, the target's answers, its features (shards in --data-dir)
#   training   head slot j reads (emb(x_{j+1}), f_j + noise) at RoPE position j and predicts f_{j+1};
#              loss = SmoothL1(pred, f_{j+1}) + 0.1 CE(softmax(lm_head(f_{j+1})) || lm_head(pred)), the CE over the
#              draft vocabulary (the answers' most frequent tokens) when there is one,
#              counted where x_{j+1} is an answer token. Embedding and LM head are the target's, frozen.
#              f_j is the target's post-norm hidden state (the record's "hidden").
import argparse
import math
import os
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

import distill
from distill import DataConfig, append_jsonl
from draft import EagleHead, load_head, save_head
from generate import UsageError, load_model
from model import Transformer, causal_mask
from tokenizer import load_tokenizer


@dataclass
class TrainConfig(DataConfig):  # the data fields (requests, answers, features) are distill.DataConfig's
    checkpoint: Optional[Path] = None  # None: the embedded default model
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
    data_only: bool = False  # stop once the data is written (a long generation job)
    init: Optional[Path] = None  # start from this head's weights (fine-tuning on new data)
    threads: int = 0  # torch threads (0: torch's default); on a busy machine fewer threads can be faster
    device: Optional[str] = None
    dtype: Optional[str] = None  # the target's; the head trains in float32


# ---------------------------------------------------------------- training

def count_draft_vocab(convs: list, size: int, vocab_size: int) -> Tensor:
    """`size` token ids: the answers' tokens, most frequent first, then unseen ids in ascending order (BPE
    ids follow merge order, a frequency ranking of the tokenizer's own corpus)."""
    counts = Counter(t for c in convs for t in c["tokens"][c["prompt_len"]:])
    seen = sorted(counts, key=lambda t: (-counts[t], t))
    unseen = (t for t in range(vocab_size) if t not in counts)
    return torch.tensor((seen + [t for _, t in zip(range(size - len(seen)), unseen)])[:size], dtype=torch.long)


def new_head(target: Transformer, max_len: int, draft_vocab: Tensor) -> EagleHead:
    device = target.tok_embeddings.weight.device
    head = EagleHead(replace(target.args, n_layer=1), fc_bias=True, draft_vocab_size=len(draft_vocab)).to(device)
    head.draft_vocab.copy_(draft_vocab)
    head.setup_caches(max_len)
    head.layers[0].attention.kv_cache = None  # training attends within each batch's T slots under a [T, T] mask
    return head


def make_batch(data: list, idx: list) -> tuple:
    rows = [data[i] for i in idx]
    device = rows[0]["tokens"].device
    tokens = pad_sequence([r["tokens"] for r in rows], batch_first=True)
    feats = pad_sequence([r["hidden"] for r in rows], batch_first=True)
    lengths = torch.tensor([len(r["tokens"]) for r in rows], device=device)
    prompt_lens = torch.tensor([r["prompt_len"] for r in rows], device=device)
    return tokens, feats, lengths, prompt_lens


def head_loss(head: EagleHead, embed: Tensor, lm_head: Tensor, batch: tuple, cfg: TrainConfig):
    """-> (loss, regression loss, classification loss, top-1 agreement with the target's argmax, tokens counted)."""
    tokens, feats, lengths, prompt_lens = batch
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
    return reg + cfg.cls_weight * cls, reg, cls, acc, int(counted.sum())


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
    """Returns the step reached. Appends one line per step to --out/train_log.jsonl."""
    head = new_head(target, max(len(d["tokens"]) for d in data), draft_vocab)
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
            head.load_state_dict({k: v for k, v in weights.items() if k != "draft_vocab"}, strict=False)
        if (cfg.out / "train_log.jsonl").exists():
            (cfg.out / "train_log.jsonl").unlink()
    embed = target.tok_embeddings.weight.detach().float()
    lm_head = target.output.weight.detach().float()
    if len(draft_vocab):
        lm_head = lm_head[draft_vocab.to(lm_head.device)]
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
        loss, reg, cls, acc, n = head_loss(head, embed, lm_head, make_batch(data, order[i * cfg.batch_size:(i + 1) * cfg.batch_size]), cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(head.parameters(), cfg.clip)
        opt.step()
        step += 1
        seen_tokens += n
        stats = {"step": step, "loss": loss.item(), "reg": reg.item(), "cls": cls.item(), "acc": acc.item(), "lr": opt.param_groups[0]["lr"]}
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
    p = argparse.ArgumentParser(description="Train an EAGLE-1/2 draft head on conversations the target itself answers.")
    p.add_argument("--checkpoint", type=Path, default=d.checkpoint, help="converted target dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, default=d.out, help="head/, train_state.pt (and the data, without --data-dir)")
    p.add_argument("--data-dir", type=Path, default=d.data_dir, help="requests, conversations and feature shards (several runs may share one); default: --out")
    p.add_argument("--prompts", type=Path, default=d.prompts, help="jsonl of requests ('prompt' or 'turns'); default: the target writes them")
    p.add_argument("--holdout", type=Path, default=d.holdout, help="MT-bench-format jsonl whose questions self-written requests must not match")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--max-request-tokens", type=int, default=d.max_request_tokens)
    p.add_argument("--max-answer-tokens", type=int, default=d.max_answer_tokens)
    p.add_argument("--gen-batch", type=int, default=d.gen_batch, help="rows generated at once")
    p.add_argument("--feature-tokens", type=int, default=d.feature_tokens, help="tokens per feature forward (rows x longest row)")
    p.add_argument("--shard-convs", type=int, default=d.shard_convs, help="conversations per feature shard")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="run the batched decode step eagerly")
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
    p.add_argument("--data-only", action="store_true", help="stop once the data is written (rerun to continue it)")
    p.add_argument("--init", type=Path, default=d.init, help="start from this head's weights instead of a fresh head")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default=d.device, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=d.dtype, help="target dtype (default: bfloat16 on CUDA, float32 on CPU)")
    return p


def check_config(cfg: TrainConfig):
    for name in ("num_prompts", "max_request_tokens", "max_answer_tokens", "gen_batch", "feature_tokens", "shard_convs", "epochs", "batch_size", "save_every"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.holdout is not None and not cfg.holdout.exists():
        raise UsageError(f"--holdout {cfg.holdout} does not exist")
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
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target = load_model(checkpoint, device, dtype).requires_grad_(False)
    tokenizer = load_tokenizer(checkpoint)
    cfg.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (cfg.max_seconds or math.inf)
    convs, complete = distill.build(cfg, target, tokenizer, deadline)
    if not complete:
        print(f"stopped after {cfg.max_seconds} s with {len(convs)} conversations: rerun to continue", file=sys.stderr)
        return 0
    if cfg.data_only:
        print(f"data: {len(convs)} conversations in {cfg.data}", file=sys.stderr)
        return 0
    if not convs:
        raise UsageError("no usable requests: pass --prompts FILE.jsonl")
    draft_vocab = (count_draft_vocab(convs, cfg.draft_vocab, target.args.vocab_size)
                   if 0 < cfg.draft_vocab < target.args.vocab_size else torch.zeros(0, dtype=torch.long))
    train(cfg, target, distill.load_records(cfg.data, keys=("hidden",)), draft_vocab, deadline)
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
