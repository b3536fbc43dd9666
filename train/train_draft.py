# Trains an EAGLE-1/2 (--arch eagle) or EAGLE-3 (--arch eagle3) draft head for a converted target checkpoint,
# on data distill.py writes and stores.
#
#   data       distill.py: self-written requests, the target's answers, its features (shards in --data-dir):
#              records {tokens, prompt_len, hidden (post-norm states), fused (the states entering the tap layers)}
#   eagle      head slot j reads (emb(x_{j+1}), f_j + noise) at RoPE position j and predicts f_{j+1};
#              loss = SmoothL1(pred, f_{j+1}) + 0.1 CE(softmax(lm_head(f_{j+1})) || lm_head(pred)), the CE over the
#              draft vocabulary (the answers' most frequent tokens) when there is one,
#              counted where x_{j+1} is an answer token. Embedding and LM head are the target's, frozen.
#              With --ttt-steps above 1, the same training-time test as eagle3 (below): step i reads the head's own
#              step i-1 prediction as f and predicts f_{j+1+i}, its loss weighted decay^i (HASS's harmonised
#              context: what a draft node at depth i+1 reads at inference). With --fused-input, step 0 also reads
#              fused_j (below) through the head's own projection, added to fc's output (draft.EagleHead's taps).
#   eagle3     training-time test: step 0, slot j reads (emb(x_{j+1}), fused_j); step i reads (emb(x_{j+1+i}), the
#              head's own step i-1 output) at RoPE position j+i, attending to step 0's keys up to slot j and its
#              own slot's keys of steps 1..i. Loss = sum_i decay^i CE(target distribution over the draft vocabulary
#              || head), at positions whose target argmax is in the draft vocabulary (as the official code: there
#              greedy drafting cannot be right, and the renormalised rest would teach the head the target's runners-up).
import sys
from pathlib import Path

if not __package__:  # run as a script (python bench/bench.py): the project's root, not this folder, is the import root
    sys.path[0] = str(Path(__file__).resolve().parents[1])
import interrupt  # noqa: F401  first of all: Ctrl-C during the imports below exits 130 in one line too
import argparse
import copy
import math
import os
import time
import typing
from collections import Counter
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

import dtypes
import ops
import tp
from checkpoint import default_checkpoint, load_model
from train import distill
from train.distill import DataConfig, append_jsonl
from draft import Eagle3Head, EagleHead
from errors import UsageError, UsageParser, one_line
from model import Attention, Transformer, apply_rope, eagle3_taps
from tokenizer import load_tokenizer
from weights import load_head, save_head


@dataclass
class TrainConfig(DataConfig):  # the data fields (requests, answers, features) are distill.DataConfig's
    checkpoint: Optional[Path] = None  # None: the embedded default model
    epochs: float = 10  # a fraction trains on that share of one epoch's batches, the rate decaying over them
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
    train_only: bool = False  # train on the conversations already featurised in the data dir, writing no more
    init: Optional[Path] = None  # start from this head's weights (fine-tuning on new data)
    freeze_init: bool = False  # train only the weights the --init head lacks (e.g. --head-layers beyond its own)
    init_vocab: bool = False  # draft over the --init head's vocabulary (default: count this data's)
    threads: int = 0  # torch threads (0: torch's default); on a busy machine fewer threads can be faster
    device: Optional[str] = None
    dtype: Optional[str] = None  # the target's; the head trains in float32
    arch: str = "eagle"  # eagle (EAGLE-1/2) | eagle3
    head_layers: int = 1  # decoder layers of an EAGLE-1/2 head (the official heads have one)
    token_table: bool = False  # an EAGLE-1/2 head learns an input vector per draft-vocabulary token (draft.EagleHead)
    fused_input: bool = False  # an EAGLE-1/2 head also reads EAGLE-3's fused states where the target's enter (draft.EagleHead)
    table_lr_scale: float = 10.0  # the token table's learning rate over --lr
    ttt_steps: int = 0  # draft steps unrolled in training (0: the arch's default, eagle 1, eagle3 7; 1: no training-time test)
    ttt_decay: float = 0.8  # step i's loss weight is decay^i
    autocast: str = "auto"  # bf16 autocast: auto (where the device has native bf16 matmul) | on | off


# ---------------------------------------------------------------- training

FUSE_LR_SCALE = 4.0  # the fused input's learning rate over --lr (16x pulled a trained head's first level down)


def count_draft_vocab(convs: list, size: int, vocab_size: int) -> Tensor:
    """`size` token ids: the answers' tokens, most frequent first, then unseen ids in ascending order (BPE
    ids follow merge order, a frequency ranking of the tokenizer's own corpus)."""
    counts = Counter(t for c in convs for t in c["tokens"][c["prompt_len"]:])
    seen = sorted(counts, key=lambda t: (-counts[t], t))
    unseen = (t for t in range(vocab_size) if t not in counts)
    return torch.tensor((seen + [t for _, t in zip(range(size - len(seen)), unseen)])[:size], dtype=torch.long)


def new_head(target: Transformer, max_len: int, draft_vocab: Tensor, arch: str = "eagle", layers: int = 1, token_table: bool = False,
             fused: bool = False):
    device, args = target.tok_embeddings.weight.device, replace(target.args, n_layer=layers if arch == "eagle" else 1)
    if arch == "eagle3":
        draft_vocab = draft_vocab if len(draft_vocab) else torch.arange(target.args.vocab_size)
        head = Eagle3Head(args, len(draft_vocab), eagle3_taps(target.args.n_layer)).to(device)
        with torch.no_grad():  # start where the target ends: its final norm and its LM head rows
            head.norm.weight.copy_(target.norm.weight)
            head.lm_head.weight.copy_(target.output.weight[draft_vocab.to(device)])
    else:
        taps = (target.args.n_layer, *eagle3_taps(target.args.n_layer)) if fused else ()
        head = EagleHead(args, fc_bias=True, draft_vocab_size=len(draft_vocab), token_table=token_table, taps=taps).to(device)
        if token_table and len(draft_vocab):
            head.token_row[draft_vocab.to(device)] = torch.arange(len(draft_vocab), dtype=torch.int32, device=device)
        with torch.no_grad():  # layers past the first start as the identity, so an --init head keeps its drafts
            if fused:  # and so does an --init head without the fused input
                head.fuse.weight.zero_()
            for layer in head.layers[1:]:
                layer.attention.wo.weight.zero_()
                layer.feed_forward.w2.weight.zero_()
    head.draft_vocab.copy_(draft_vocab)
    head.setup_caches(max_len)
    for layer in head.layers:
        layer.attention.kv_cache = None  # training attends within each batch's T slots under a [T, T] mask
    return head


def make_batch(data: list, idx: list) -> tuple:
    rows = [data[i] for i in idx]
    device = rows[0]["tokens"].device
    tokens = pad_sequence([r["tokens"] for r in rows], batch_first=True)
    hidden = pad_sequence([r["hidden"] for r in rows], batch_first=True)
    fused = pad_sequence([r["fused"] for r in rows], batch_first=True) if "fused" in rows[0] else None
    lengths = torch.tensor([len(r["tokens"]) for r in rows], device=device)
    prompt_lens = torch.tensor([r["prompt_len"] for r in rows], device=device)
    keep = pad_sequence([r["keep"] for r in rows], batch_first=True) if "keep" in rows[0] else None
    return tokens, hidden, fused, lengths, prompt_lens, keep


def head_loss(head: EagleHead, embed: Tensor, lm_head: Tensor, batch: tuple, cfg: TrainConfig, fc_scale=None):
    """-> (loss, stats: step 0's regression and classification loss, per-step top-1 agreement with the target's
    argmax; tokens counted at step 0). One step unless cfg.ttt_steps asks for more (see the top of the file).
    fc_scale: fused_scale's, for a head with taps (the fused states its fuse reads at step 0)."""
    tokens, feats, fused, lengths, prompt_lens, _ = batch
    steps, T = ttt_steps(cfg), tokens.shape[1] - 1
    tokens = F.pad(tokens, (0, steps - 1))
    after = F.pad(feats[:, 1:].float(), (0, 0, 0, steps - 1))  # the target state step i at slot j predicts: after[:, j+i]
    feat_in = feats[:, :-1].float()
    feat_in = feat_in + (torch.rand_like(feat_in) * 2 - 1) * cfg.noise
    if head.taps:
        feat_in = torch.cat([feat_in, fused[:, :-1].float() * fc_scale], dim=-1)
    answer, row, target_all, best = answer_targets(after, prompt_lens, lengths, lm_head)
    loss, stats, counted0 = 0.0, {"acc_steps": []}, 0
    for i, h in enumerate(unrolled_steps(head, embed, tokens, feat_in, steps)):
        counted = answer[:, i:i + T]
        pred, target = h[counted].float(), after[:, i:i + T][counted]
        ce, agree = soft_ce_fused(F.linear(pred, lm_head), target_all, row[:, i:i + T][counted], best)
        reg = F.smooth_l1_loss(pred, target)
        cls = ce.mean()
        loss = loss + cfg.ttt_decay ** i * (reg + cfg.cls_weight * cls)
        stats["acc_steps"].append(agree.float().mean())
        if i == 0:
            stats |= {"reg": reg, "cls": cls}
            counted0 = int(counted.sum())
    stats["acc"] = stats["acc_steps"][0]
    return loss, stats, counted0


def soft_ce(logits: Tensor, target_all: Tensor, rows: Tensor, best: Tensor) -> tuple:
    """Cross-entropy of logits [N, V] against the distributions target_all[rows] (each sums to 1, so CE =
    logsumexp(logits) - sum(p * logits)), and whether each row's argmax is best[rows], the target's. -> ([N], [N] bool)."""
    logits = logits.float()
    ce = torch.logsumexp(logits, -1) - (target_all[rows] * logits).sum(-1)
    return ce, logits.argmax(-1) == best[rows]


# Compiled, the rows' passes fuse (gather, upcast, logsumexp, product, argmax and their backward): eager, each op of
# an unrolled step swept 100 MB of [N, 16384] logits and allocated the next (fresh pages), most of an EAGLE-3 step.
soft_ce_fused = torch.compile(soft_ce, dynamic=True)


def answer_targets(after: Tensor, prompt_lens: Tensor, lengths: Tensor, lm_head: Tensor) -> tuple:
    """Step i at slot j predicts position j+i of after [B, P, dim], counted when that position is an answer's, so
    one mask over positions serves every step. -> (answer [B, P], row [B, P]: a position's row in target_all,
    target_all [answer positions, draft vocabulary]: the target's distribution restricted to it, renormalised; its
    argmax per position)."""
    pos = torch.arange(after.shape[1], device=after.device)
    answer = (pos + 1 >= prompt_lens[:, None]) & (pos + 1 < lengths[:, None])
    row = answer.flatten().cumsum(0).view_as(answer) - 1
    with torch.no_grad():
        target_all = torch.softmax(F.linear(after[answer], lm_head).float(), dim=-1)
    return answer, row, target_all, target_all.argmax(-1)


def ttt_steps(cfg: TrainConfig) -> int:
    return cfg.ttt_steps or (7 if cfg.arch == "eagle3" else 1)


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
        y = unrolled_attend_fused(q, *self.context, [k for k, _ in self.diagonal], [v for _, v in self.diagonal])
        return a.wo(y.transpose(1, 2).reshape(B, T, q_size).to(x.dtype))


def unrolled_attend(q: Tensor, k0: Tensor, v0: Tensor, kd: list, vd: list) -> Tensor:
    """q [B, H, T, D] attends causally to k0/v0 and, at each slot, to that slot's keys of the earlier unrolled steps."""
    T, scale = q.shape[2], q.shape[-1] ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
    scores += [(q * ki).sum(-1, keepdim=True) * scale for ki in kd]
    w = torch.softmax(torch.cat(scores, -1), -1)
    y = w[..., :T] @ v0
    for n, vi in enumerate(vd):
        y = y + w[..., T + n:T + n + 1] * vi
    return y


# Compiled (a graph per unrolled step, any T; past Dynamo's default of 8 graphs for --ttt-steps above 7): the mask, the
# concatenation and the softmax fuse into a pass or two over the [B, H, T, T] scores, eagerly a pass each in fp32.
unrolled_attend_fused = torch._dynamo.config.patch(recompile_limit=64)(torch.compile(unrolled_attend, dynamic=True))


@torch.no_grad()
def target_argmax(hidden: Tensor, lm_head: Tensor, rows: int = 2048) -> Tensor:
    """The target's argmax over its whole vocabulary, a chunk of rows at a time (the logits are large)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return torch.cat([ops.argmax(chunk @ lm_head.T) for chunk in flat.split(rows)]).view(hidden.shape[:-1])


def cache_keep(records: list, idx: list, lm_full: Tensor, in_draft: Tensor):
    """Stores in each record whether the target's argmax after each position lies in the draft vocabulary: a
    49k-row LM head pass per token, a third of a step's work, paid once instead of every epoch."""
    for r in (records[i] for i in idx if "keep" not in records[i]):
        r["keep"] = in_draft[target_argmax(r["hidden"][1:].to(lm_full.dtype), lm_full)]


def fused_scale(data: list, rows: int = 65536) -> Tensor:
    """1 / the rms of each fused input dimension, over the first rows of the data. The target's residual stream has
    a few massive dimensions (SmolLM2: rms 130 at the middle and upper taps, single dimensions near 600 on average,
    against 3.6 at layer 2): fc fed as they come sees inputs 100x apart while Adam steps every weight alike, and the
    head learns slowly. Training reads fused * scale; the saved fc has the scale folded in, so the head's format
    and its inference are the official ones."""
    sample = torch.cat([r["fused"][:rows].float() for r in data[: max(1, rows // 64)]])[:rows]
    return sample.pow(2).mean(0).sqrt().clamp(min=1e-3).reciprocal()


def unrolled_steps(head: EagleHead, embed: Tensor, tokens: Tensor, feature: Tensor, steps: int, scale=None):
    """Yields the head's output [B, T, dim] at each unrolled step; tokens [B, T + steps] (padded), feature [B, T, *]:
    what step 0 reads, the target's states (an EAGLE-3 head's fused ones; scale: fused_scale's, or None). Step i
    reads the head's own step i-1 output instead."""
    T = feature.shape[1]
    slot = torch.arange(T, device=tokens.device)
    h, attention = feature.to(embed.dtype), [UnrolledAttention(layer.attention) for layer in head.layers]
    if scale is not None:
        h = h * scale.to(embed.dtype)
    for i in range(steps):
        h = head(tokens[:, 1 + i:1 + i + T], embed, h, slot + i, None, None, attention)
        yield h


def ttt_loss(head: Eagle3Head, embed: Tensor, lm_head: Tensor, batch: tuple, cfg: TrainConfig, fc_scale=None):
    """EAGLE-3's training-time test over cfg.ttt_steps unrolled steps (see the top of the file). lm_head: the
    target's rows for the draft vocabulary; batch[-1]: cache_keep's masks; fc_scale: fused_scale's.
    -> (loss, stats: step 0's CE and per-step top-1 agreement on counted positions; tokens counted at step 0)."""
    tokens, hidden, fused, lengths, prompt_lens, keep = batch
    steps, T = ttt_steps(cfg), tokens.shape[1] - 1
    tokens = F.pad(tokens, (0, steps))  # step i reads x_{j+1+i}; slots past a row's end are never counted
    after = F.pad(hidden[:, 1:].float(), (0, 0, 0, steps))  # the target state that step i at slot j predicts: after[:, j+i]
    keep_all = F.pad(keep, (0, steps))  # cache_keep's mask: the target's argmax lies in the draft vocabulary
    answer, row, target_all, best = answer_targets(after, prompt_lens, lengths, lm_head)
    loss, stats, counted0 = 0.0, {"acc_steps": []}, 0
    for i, h in enumerate(unrolled_steps(head, embed, tokens, fused[:, :T], steps, fc_scale)):
        counted = answer[:, i:i + T]
        keep = keep_all[:, i:i + T][counted].float()
        ce, agree = soft_ce_fused(head.logits(h[counted]), target_all, row[:, i:i + T][counted], best)
        step_loss = (ce * keep).sum() / counted.sum().clamp(min=1)
        loss = loss + cfg.ttt_decay ** i * step_loss
        stats["acc_steps"].append((agree.float() * keep).sum() / keep.sum().clamp(min=1))
        if i == 0:
            stats["cls"], counted0 = step_loss, int(counted.sum())
    stats["acc"] = stats["acc_steps"][0]
    return loss, stats, counted0


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warm-up, then linear decay to 0 at the last step."""
    warm = max(1, cfg.warmup_steps)
    return cfg.lr * min((step + 1) / warm, (total - step) / max(1, total - warm))


def fused_input(head) -> str:
    """The name of the projection that reads the fused states: an EAGLE-3 head's fc, an EAGLE-1/2 head's fuse."""
    return "fc" if head.kind == "eagle3" else "fuse"


def save_state(out: Path, head: EagleHead, opt, step: int, fc_scale=None):
    """The head as it serves (fc_scale folded into the projection that reads the fused states) in out/head, and the
    training state to resume from."""
    served = head
    if fc_scale is not None:
        served = copy.deepcopy(head)
        weight = getattr(served, fused_input(served)).weight
        weight.data.mul_(fc_scale.to(weight.dtype)[None])
    save_head(served, out / "head")
    tmp = out / "train_state.pt.tmp"
    torch.save({"step": step, "head": head.state_dict(), "optimizer": opt.state_dict(), "fc_scale": fc_scale}, tmp)
    os.replace(tmp, out / "train_state.pt")  # a crash mid-write keeps the previous state


def train(cfg: TrainConfig, target: Transformer, data: list, draft_vocab: Tensor, deadline: float) -> int:
    """Returns the step reached. Appends one line per step to --out/train_log.jsonl. data: records
    {tokens, prompt_len, hidden, fused (eagle3, --fused-input)}, as distill.load_records returns them."""
    head = new_head(target, max(len(d["tokens"]) for d in data) + ttt_steps(cfg), draft_vocab, cfg.arch, cfg.head_layers, cfg.token_table,
                    cfg.fused_input)
    device = target.tok_embeddings.weight.device
    own = head.state_dict()
    weights = load_head(cfg.init, target.args, device).state_dict() if cfg.init else {}
    weights = {k: v for k, v in weights.items() if k in own and v.shape == own[k].shape}
    if "token_table" not in weights:  # an init's rows map ids into its own table only
        weights.pop("token_row", None)
    if cfg.freeze_init:  # only what the --init head lacks learns: a grown head's new layers
        for name, p in head.named_parameters():
            p.requires_grad_(name not in weights)
    table = [p for p in [head.token_table] if p is not None and p.requires_grad]
    fuse = [p for p in head.fuse.parameters() if p.requires_grad] if getattr(head, "fuse", None) is not None else []
    rest = [p for p in head.parameters() if p.requires_grad and p is not head.token_table and not any(p is f for f in fuse)]
    # A table row learns only when its token comes up: a rare token's row sees few steps, so the table runs faster.
    # fuse starts at zero beside a trained head: at FUSE_LR_SCALE it catches up without pulling the rest away.
    groups = [(rest, 1.0)] + [(table, cfg.table_lr_scale)] * bool(table) + [(fuse, FUSE_LR_SCALE)] * bool(fuse)
    opt = torch.optim.AdamW([{"params": g} for g, _ in groups], lr=cfg.lr, betas=(0.9, 0.95))
    lr_scales = [scale for _, scale in groups]  # by group, from the flags: a resumed run may change the table's
    step, state_path = 0, cfg.out / "train_state.pt"
    state = {}
    if cfg.resume:
        if not state_path.exists():
            raise UsageError(f"--resume: no {state_path}")
        state = torch.load(state_path, map_location=target.tok_embeddings.weight.device, weights_only=True)
        try:
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:  # e.g. saved before the head's projections were fused (wqkv, w13)
            raise UsageError(f"--resume: {state_path} does not fit this head ({one_line(e, 120)}); start over with --init {cfg.out / 'head'}") from None
        step = state["step"]
    else:
        if cfg.init:
            keep_vocab = cfg.arch == "eagle3"  # its LM head's rows belong to its own draft vocabulary, not this data's count
            head.load_state_dict({k: v for k, v in weights.items() if keep_vocab or k != "draft_vocab"}, strict=False)
        if (cfg.out / "train_log.jsonl").exists():
            (cfg.out / "train_log.jsonl").unlink()
    fc_scale = state.get("fc_scale") if cfg.resume else None
    if (cfg.arch == "eagle3" or cfg.fused_input) and fc_scale is None:
        fc_scale = fused_scale(data).to(target.tok_embeddings.weight.device)
        if f"{fused_input(head)}.weight" in weights:  # the init's has a scale folded in; training multiplies the input by this one
            getattr(head, fused_input(head)).weight.data.div_(fc_scale[None])
    bf16 = cfg.autocast == "on" or (cfg.autocast == "auto" and dtypes.native_bf16(device))
    # Under autocast the frozen LM heads are cast to bf16 once here: autocast casts a tensor that is not a parameter
    # at every matmul (cache_keep's 49152-row LM head for every chunk of rows, the draft rows at every unrolled step).
    embed = target.tok_embeddings.weight.detach().float()
    lm_full = lm_head = target.output.weight.detach().to(torch.bfloat16 if bf16 else torch.float)
    if len(head.draft_vocab):
        lm_head = lm_head[head.draft_vocab.to(lm_head.device)]
    in_draft = torch.zeros(len(lm_full), dtype=torch.bool, device=lm_full.device).index_fill_(0, head.draft_vocab.to(lm_full.device), True)
    loss_fn = ttt_loss if cfg.arch == "eagle3" else head_loss
    per_epoch = math.ceil(len(data) / cfg.batch_size)
    total = math.ceil(cfg.epochs * per_epoch)
    torch.manual_seed(cfg.seed + step)
    bar = tqdm(total=total, initial=step, desc="train", unit="step", file=sys.stderr)
    ema, seen_tokens, t0 = None, 0, time.perf_counter()
    while step < total and time.monotonic() < deadline:
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch)).tolist()
        for group, scale in zip(opt.param_groups, lr_scales):
            group["lr"] = lr_at(step, cfg, total) * scale
        idx = order[i * cfg.batch_size:(i + 1) * cfg.batch_size]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            if cfg.arch == "eagle3":
                cache_keep(data, idx, lm_full, in_draft)
            batch = make_batch(data, idx)
            loss, stats, n = loss_fn(head, embed, lm_head, batch, cfg, fc_scale=fc_scale)
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
            save_state(cfg.out, head, opt, step, fc_scale)
    bar.close()
    save_state(cfg.out, head, opt, step, fc_scale)
    seconds = time.perf_counter() - t0
    if seen_tokens:
        print(f"train: {seen_tokens} answer tokens in {seconds:.1f} s, {seen_tokens / seconds:.1f} tokens/s; step {step}/{total}", file=sys.stderr)
    return step


# ---------------------------------------------------------------- CLI

HELP = {
    "checkpoint": "converted target dir (default: the embedded SmolLM2-135M-Instruct)",
    "out": "head/, train_state.pt (and the data, without --data-dir)",
    "data_dir": "requests, conversations and feature shards (several runs may share one); default: --out. With "
                "--train-only, several directories joined by os.pathsep (':'), e.g. two data jobs run side by side",
    "prompts": "jsonl of requests ('prompt' or 'turns'); default: the target writes them",
    "holdout": "MT-bench-format jsonl whose questions self-written requests must not match, beside data/code_math.jsonl's "
               "(default: data/mt_bench.jsonl)",
    "gen_batch": "rows generated at once",
    "feature_tokens": "tokens per feature forward (rows x longest row)",
    "shard_convs": "conversations per feature shard",
    "compile": "run the batched decode step eagerly",
    "temperature": "answer sampling temperature",
    "greedy_fraction": "share of answers decoded greedily",
    "top_p": "answer top-p",
    "batch_size": "conversations per training step",
    "draft_vocab": "draft over the N most frequent answer tokens (0: the whole vocabulary)",
    "noise": "uniform noise half-width on input features",
    "clip": "gradient clipping by value",
    "save_every": "steps between checkpoints",
    "epochs": "passes over the data; a fraction (0.5) trains on that share of one pass, the rate decaying over it",
    "max_seconds": "stop cleanly after this long (rerun, with --resume once training started)",
    "resume": "continue training from --out/train_state.pt",
    "data_only": "stop once the data is written (rerun to continue it)",
    "train_only": "train on the conversations whose features are already in --data-dir; generate nothing",
    "init": "start from this head's weights instead of a fresh head",
    "freeze_init": "train only the weights the --init head lacks (the layers --head-layers adds)",
    "init_vocab": "draft over the --init head's vocabulary instead of this data's most frequent tokens",
    "arch": "eagle: EAGLE-1/2 head; eagle3: EAGLE-3 head with training-time test",
    "head_layers": "decoder layers of an EAGLE-1/2 head (official: 1; each costs a decoder layer per draft level)",
    "token_table": "give an EAGLE-1/2 head a learned input vector per draft-vocabulary token (a lookup: no draft time)",
    "table_lr_scale": "the token table's learning rate as a multiple of --lr",
    "fused_input": "an EAGLE-1/2 head also reads EAGLE-3's fused states (the target's layers 2, L//2, L-3) at the first draft level",
    "ttt_steps": "draft steps unrolled in training (training-time test; default eagle 1, eagle3 7 as the official code)",
    "ttt_decay": "loss weight decay per unrolled step (official 0.8)",
    "autocast": "bf16 autocast (auto: where bf16 matmul is native)",
    "threads": "torch threads (default: torch's choice)",
    "device": "default: cuda if available, else cpu",
    "dtype": "target dtype (default: bfloat16 on CUDA; on a CPU the faster of float32 and bfloat16, dtypes.py)",
}
CHOICES = {"arch": ["eagle", "eagle3"], "autocast": ["auto", "on", "off"], "dtype": ["float32", "bfloat16", "float16"]}


def build_parser() -> argparse.ArgumentParser:
    """One flag per TrainConfig field, typed and defaulted by the dataclass."""
    p = UsageParser(description="Train an EAGLE-1/2 or EAGLE-3 draft head on conversations the target itself answers.")
    for f in fields(TrainConfig):
        flag, kind = "--" + f.name.replace("_", "-"), next(t for t in typing.get_args(f.type) or (f.type,) if t is not type(None))
        if kind is bool:  # a flag that turns the default around
            p.add_argument(flag if not f.default else f"--no-{flag[2:]}", dest=f.name, action="store_false" if f.default else "store_true",
                           help=HELP.get(f.name))
        else:
            p.add_argument(flag, type=kind, default=f.default, choices=CHOICES.get(f.name), help=HELP.get(f.name))
    return p


def check_config(cfg: TrainConfig):
    for name in ("num_prompts", "max_request_tokens", "max_answer_tokens", "gen_batch", "feature_tokens", "shard_convs",
                 "batch_size", "save_every", "head_layers"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < cfg.epochs < math.inf:
        raise UsageError("--epochs must be a finite number > 0")
    if (cfg.freeze_init or cfg.init_vocab) and not cfg.init:
        raise UsageError("--freeze-init and --init-vocab need --init")
    if (cfg.head_layers != 1 or cfg.token_table or cfg.fused_input) and cfg.arch != "eagle":
        raise UsageError("--head-layers, --token-table and --fused-input are for EAGLE-1/2 heads (--arch eagle)")
    if cfg.ttt_steps < 0:
        raise UsageError("--ttt-steps must be >= 1 (0: the arch's default)")
    if cfg.holdout is not None and not cfg.holdout.exists():
        raise UsageError(f"--holdout {cfg.holdout} does not exist")
    if cfg.draft_vocab < 0:
        raise UsageError("--draft-vocab must be >= 0")
    if not 0 <= cfg.greedy_fraction <= 1 or not 0 < cfg.top_p <= 1 or cfg.temperature <= 0:
        raise UsageError("need 0 <= --greedy-fraction <= 1, 0 < --top-p <= 1 and --temperature > 0")


def data_dirs(cfg: TrainConfig) -> list:
    """--data-dir, or with --train-only several joined as PATH is: one data job per core writes its own directory
    (a directory takes one writer), and training reads them all."""
    dirs = [Path(d).expanduser() for d in str(cfg.data).split(os.pathsep) if d]  # the shell expands only the first ~
    if len(dirs) > 1 and not cfg.train_only:
        raise UsageError(f"--data-dir lists {len(dirs)} directories: only --train-only reads more than one")
    for d in dirs if cfg.train_only else []:
        if not d.is_dir():
            raise UsageError(f"--data-dir: {d} is not a directory")
    return dirs


def featurised_convs(data: Path) -> list:
    """The conversations in `data` whose features a shard holds."""
    done = distill.featurised_ids(data)
    return [c for c in distill.read_jsonl(data / "conversations.jsonl") if c["id"] in done]


def run(cfg: TrainConfig) -> int:
    check_config(cfg)
    dirs = data_dirs(cfg)
    device = cfg.device or dtypes.default_device()
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else dtypes.default_dtype(device, log=lambda s: print(s, file=sys.stderr))
    torch.set_float32_matmul_precision("high")  # TF32 for the head's fp32 matmuls on GPUs that have it
    checkpoint = cfg.checkpoint or default_checkpoint()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target = load_model(checkpoint, device, dtype).requires_grad_(False)
    tokenizer = load_tokenizer(checkpoint)
    cfg.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (cfg.max_seconds or math.inf)
    if cfg.train_only and cfg.data_only:
        raise UsageError("--train-only and --data-only exclude each other")
    if cfg.train_only:
        convs, complete = [c for d in dirs for c in featurised_convs(d)], True
    else:
        convs, complete = distill.build(cfg, target, tokenizer, deadline)
    if not complete:
        print(f"stopped after {cfg.max_seconds} s with {len(convs)} conversations: rerun to continue", file=sys.stderr)
        return 0
    if cfg.data_only:
        print(f"data: {len(convs)} conversations in {cfg.data}", file=sys.stderr)
        return 0
    if not convs:
        raise UsageError("no usable requests: pass --prompts FILE.jsonl")
    target.taps = eagle3_taps(target.args.n_layer) if cfg.arch == "eagle3" else ()  # the stored records carry the fused states
    if cfg.init and cfg.init_vocab:
        draft_vocab = load_head(cfg.init, target.args).draft_vocab
    elif 0 < cfg.draft_vocab < target.args.vocab_size:
        draft_vocab = count_draft_vocab(convs, cfg.draft_vocab, target.args.vocab_size)
    else:
        draft_vocab = torch.zeros(0, dtype=torch.long)
    keys = ("hidden", "fused") if cfg.arch == "eagle3" or cfg.fused_input else ("hidden",)
    train(cfg, target, [r for d in dirs for r in distill.load_records(d, keys)], draft_vocab, deadline)
    print(f"wrote {cfg.out / 'head'}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    try:
        return run(TrainConfig(**vars(build_parser().parse_args(argv))))
    except (UsageError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    tp.exit_with(main)
