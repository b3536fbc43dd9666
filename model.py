# The LLaMA Transformer with a static KV cache. forward() takes the RoPE positions, the KV slots and the attention mask
# apart, because a draft tree needs them apart: a tree node's slot is L + node, its position is L + depth, its mask row
# its ancestors. Plain torch throughout: a backend may replace the nn.Linear layers in place (ops.prepare;
# cpu/linears.py packs them for its kernels) and serves attention over few queries through ops.attend.
import json
import math
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

import atomic
import ops


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_local_heads: int = -1  # key/value heads (GQA); -1 means n_head
    head_dim: int = 0  # 0 means dim // n_head
    intermediate_size: int = 11008
    vocab_size: int = 32000
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: Optional[dict] = None  # Llama-3.1 style {"rope_type": "llama3", "factor": ..., ...}
    block_size: int = 4096  # max_position_embeddings
    tie_embeddings: bool = False
    chat_template: str = ""  # llama2 | vicuna | llama3 | chatml | "" (none)
    stop_tokens: list = field(default_factory=list)
    bos_token: Optional[int] = None  # prepended to every prompt when set

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if not self.head_dim:
            self.head_dim = self.dim // self.n_head

    @classmethod
    def load(cls, path) -> "ModelArgs":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(Path(path).read_text()).items() if k in known})

    def save(self, path):
        atomic.write_text(path, json.dumps(asdict(self), indent=2) + "\n")


def rope_frequencies(args: ModelArgs) -> Tensor:
    d = args.head_dim
    freqs = 1.0 / (args.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = args.rope_scaling
    if not s:
        return freqs
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return freqs / s["factor"]
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * freqs / factor + smooth * freqs
    return torch.where(wavelen < old_len / hi, freqs, torch.where(wavelen > old_len / lo, freqs / factor, mid))


def rope_table(args: ModelArgs, length: int) -> Tensor:
    """[length, 2, head_dim] in fp32: each pair's cos twice, then its sin as (-sin, sin), what apply_rope multiplies."""
    angles = torch.outer(torch.arange(length, dtype=torch.float64), rope_frequencies(args))
    sin = angles.sin()
    return torch.stack([angles.cos().repeat_interleave(2, -1), torch.stack([-sin, sin], -1).flatten(-2)], dim=-2).float()


def rope_at(table: Tensor, input_pos: Tensor, batch: int) -> Tensor:
    """Rows of a rope_table for positions [T] (shared by the batch) or [B, T] -> [B, T, 2, D]."""
    rope = table[input_pos]
    return rope.unsqueeze(0).expand(batch, -1, -1, -1) if rope.dim() == 3 else rope


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    # Interleaved pairs (2i, 2i+1), the Meta / gpt-fast layout; HF checkpoints are permuted into it. Written over whole
    # rows (x times the cos row, plus x with each pair swapped times the signed sin row), Inductor makes one vector
    # loop of it; over the pairs as two strided halves it made two scalar loops and a third to interleave them. The
    # products and sums are the same: x[2i] cos - x[2i+1] sin, x[2i+1] cos + x[2i] sin.
    xs = x.float()
    swapped = xs.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xs * rope[:, :, None, 0] + swapped * rope[:, :, None, 1]).type_as(x)


class KVCache(nn.Module):
    def __init__(self, batch: int, heads: int, length: int, head_dim: int, dtype):
        super().__init__()
        shape = (batch, heads, length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        for name in ("k_tree", "v_tree"):  # a tree's own rows (setup_tree): a verify's until commit keeps some, a draft's
            self.register_buffer(name, None, persistent=False)

    # Writes are index_put_ over the slot dim moved first: under torch.vmap (batch.py) index_copy_ has no batching
    # rule, and its per-row fallback copied the whole cache at every write.
    def update(self, cache_pos, k: Tensor, v: Tensor, width: int):
        """k, v [B, Hkv, T, D] into slots cache_pos; None: a tree verify's rows into k_tree until keep; an int: a draft level's
        into k_tree from that row (so the head's cache takes one write a cycle: written at each level, Inductor copied all of
        it for every write but the last). -> the K, V the mask covers: the cache's, and a tree's (a verify's, every level's)."""
        if cache_pos is None or isinstance(cache_pos, int):
            at, n = cache_pos or 0, k.shape[2]  # a verify's tree may come out smaller than the room for it
            self.k_tree[:, :, at:at + n].copy_(k)
            self.v_tree[:, :, at:at + n].copy_(v)
            tree = (k, v) if cache_pos is None else (self.k_tree, self.v_tree)
            return self.k_cache[:, :, :width - tree[0].shape[2]], self.v_cache[:, :, :width - tree[0].shape[2]], tree
        self.k_cache.transpose(0, 2).index_put_((cache_pos,), k.transpose(0, 2))
        self.v_cache.transpose(0, 2).index_put_((cache_pos,), v.transpose(0, 2))
        return self.k_cache[:, :, :width], self.v_cache[:, :, :width], None  # the first width slots: what the mask covers

    def keep(self, rows: Tensor, dst: Tensor):
        """The tree's rows (update(None, ...)) into slots dst, the cache's one write a cycle: Inductor copied the whole
        cache of a graph that wrote it twice (tree rows, then accepted ones moved), reinplacing only the last write."""
        for cache, tree in ((self.k_cache, self.k_tree), (self.v_cache, self.v_tree)):
            cache.transpose(0, 2).index_put_((dst,), tree.transpose(0, 2)[rows])


def setup_tree(layers, rows: int):
    """Room in each layer's cache for a tree's own K/V rows (KVCache.update): a verify's, or a draft tree's."""
    for layer in layers:
        c = layer.attention.kv_cache
        if c.k_tree is None or c.k_tree.shape[2] != rows:
            c.k_tree, c.v_tree = (c.k_cache.new_zeros(*c.k_cache.shape[:2], rows, c.k_cache.shape[3]) for _ in range(2))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, in_dim: Optional[int] = None):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = args.n_head, args.n_local_heads, args.head_dim
        self.wqkv = nn.Linear(in_dim or args.dim, (args.n_head + 2 * args.n_local_heads) * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_head * args.head_dim, args.dim, bias=False)
        self.kv_cache: Optional[KVCache] = None
        self._register_load_state_dict_pre_hook(partial(fuse_rows, parts=("wq", "wk", "wv"), fused="wqkv"))

    def forward(self, x: Tensor, rope: Tensor, cache_pos: Tensor, mask: Tensor) -> Tensor:
        B, T, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(B, T, self.n_head, self.head_dim), rope).transpose(1, 2)
        k = apply_rope(k.view(B, T, self.n_kv, self.head_dim), rope).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        k, v, tree = self.kv_cache.update(cache_pos, k, v, mask.shape[-1]) if self.kv_cache is not None else (k, v, None)
        if tree or self.kv_cache is not None and ops.few_queries(q):
            y = attend_few(q, k, v, mask, tree)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_head)
        return self.wo(y.transpose(1, 2).reshape(B, T, q_size))


# Where a backend takes attend_few (ops.few_queries: a CPU, whose SDPA tiles over queries, slow when few), up to
# FEW_QUERIES; longer prompts keep SDPA, training its backward. Compiled: fused loops up to FUSED_QUERIES, a backend's
# kernel up to KERNEL_QUERIES.
FEW_QUERIES, FUSED_QUERIES, KERNEL_QUERIES = 256, 16, 64


def attend_few(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, tree=None) -> Tensor:
    """Attention for a few queries per row: q [B, H, T, D], k/v [B, Hkv, S, D], bool mask [T, S], [B, 1, T, S] or
    [B, H, T, S]. tree: (k, v) of a tree verify's own rows after the S, read apart and meeting the cache's in one
    softmax (the cache is not copied to join them); the mask covers both."""
    (B, H, T, D), n_kv, S = q.shape, k.shape[1], k.shape[2]
    G = H // n_kv
    if (compiling := torch.compiler.is_compiling()) and statically_known_true(T <= KERNEL_QUERIES) and ops.attends(q):
        return ops.attend(q.contiguous(), k, v, mask.expand(B, H, T, -1), *(tree or (k[:, :, :0], v[:, :, :0])), D**-0.5)
    fused = compiling and statically_known_true(T <= FUSED_QUERIES)
    if mask.dim() == 4:
        mask = mask.reshape(B, n_kv, G, T, -1) if mask.shape[1] != 1 else mask.unsqueeze(1)
    parts = [(k, v, mask[..., :S])] + ([(*tree, mask[..., S:])] if tree else [])
    # Compiled, products and sums fuse into a loop over the cache; as matmuls each is an extern call (a verify's
    # unbacked live_width keeps the templates off), a sixth of a cycle. Eagerly, matmuls win. The cache's scores and the
    # tree's meet in one softmax by a shared max and sum, not a cat: under torch.vmap a cat whose width is
    # data-dependent cannot be traced.
    if fused:
        qg = q.view(B, n_kv, G, T, 1, D).float()
        scores = [(qg * kk[:, :, None, None].float()).sum(-1) for kk, _, _ in parts]  # [B, Hkv, G, T, S] each
    else:
        qg = q.reshape(B, n_kv, G * T, D)
        scores = [(qg @ kk.transpose(-1, -2)).float().view(B, n_kv, G, T, -1) for kk, _, _ in parts]
    scores = [s.masked_fill(~m, float("-inf")) * D**-0.5 for s, (_, _, m) in zip(scores, parts)]
    top = torch.stack([s.amax(-1) for s in scores]).amax(0).unsqueeze(-1)
    probs = [torch.exp(s - top) for s in scores]
    total = sum(p.sum(-1, keepdim=True) for p in probs)
    if fused:
        y = sum((p.unsqueeze(-1) * vv[:, :, None, None].float()).sum(-2) for p, (_, vv, _) in zip(probs, parts))
    else:
        y = sum(p.to(vv.dtype).reshape(B, n_kv, G * T, -1) @ vv for p, (_, vv, _) in zip(probs, parts)).float().view(B, n_kv, G, T, D)
    return (y.view(B, n_kv, G, T, D) / total).to(v.dtype).view(B, H, T, D)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)  # gate (w1) and up (w3), one GEMM
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)  # down
        self._register_load_state_dict_pre_hook(partial(fuse_rows, parts=("w1", "w3"), fused="w13"))

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, input_norm: bool = True):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        # The EAGLE head's single layer has no input norm: fc output goes straight into attention.
        self.attention_norm = RMSNorm(args.dim, args.norm_eps) if input_norm else nn.Identity()
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, rope: Tensor, cache_pos: Tensor, mask: Tensor, attention=None) -> Tensor:  # see Eagle3Block
        h = x + (attention or self.attention)(self.attention_norm(x), rope, cache_pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))


@torch.compiler.nested_compile_region
def layer_region(layer: TransformerBlock, x: Tensor, rope: Tensor, cache_pos: Tensor, mask: Tensor) -> Tensor:
    return layer(x, rope, cache_pos, mask)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_seq_length = 0
        self.taps = ()  # layers whose input states forward() returns as draft features (EAGLE-3; n_layer: h); see hidden()

    def setup_caches(self, max_seq_length: int, batch: int = 1, dtype=None):
        """Allocates the KV caches and the RoPE table; the table always covers the whole cache."""
        dtype = dtype or self.norm.weight.dtype  # norms stay float in quantised models
        device = self.tok_embeddings.weight.device
        self.max_seq_length = max_seq_length
        for layer in self.layers:
            a = layer.attention
            a.kv_cache = KVCache(batch, a.n_kv, max_seq_length, a.head_dim, dtype).to(device)
        self.register_buffer("rope", rope_table(self.args, max_seq_length).to(device), persistent=False)

    def keep_kv(self, rows: Tensor, dst: Tensor):
        """Every layer's K/V of the last tree verify's rows into cache slots dst (a speculative commit)."""
        for layer in self.layers:
            layer.attention.kv_cache.keep(rows, dst)

    def hidden(self, idx: Tensor, input_pos: Tensor, cache_pos: Tensor, mask: Tensor, run_layer=None) -> tuple:
        """-> (post-norm hidden states, what the LM head reads; draft features, what a draft head reads). Draft features
        are the post-norm states themselves (EAGLE-1/2), or with self.taps set the hidden states entering those layers (tap
        n_layer: the post-norm state), concatenated [B, T, len(taps) * dim], taken from the forward that runs anyway.
        idx [B, T] tokens; input_pos [T] or [B, T] RoPE positions; cache_pos [T] KV slots; mask [T, S] or [B, T, S]
        bool over the first S cache slots (True = may attend; live_width). cache_pos None (a tree verify, setup_tree):
        the cache is read, not written; the mask covers its first S - T slots and then these T tokens, whose K/V wait
        for keep_kv. run_layer(layer, x, rope, cache_pos, mask), if given, runs each layer: layer_region compiles one
        graph of a layer (a nested compile region) instead of every layer traced in turn, for a pass run once an answer."""
        x = self.tok_embeddings(idx)
        rope = rope_at(self.rope, input_pos, x.shape[0])
        mask = mask.unsqueeze(-3) if mask.dim() == 3 else mask
        entering = {}
        for i, layer in enumerate(self.layers):
            if i in self.taps:
                entering[i] = x
            x = run_layer(layer, x, rope, cache_pos, mask) if run_layer else layer(x, rope, cache_pos, mask)
        h = entering[len(self.layers)] = self.norm(x)
        return h, (ops.cat([entering[i] for i in self.taps], dim=-1) if self.taps else h)

    def forward(self, idx: Tensor, input_pos: Tensor, cache_pos: Tensor, mask: Tensor):
        """-> (logits, draft features); see hidden()."""
        h, feat = self.hidden(idx, input_pos, cache_pos, mask)
        return self.output(h), feat


def eagle3_taps(n_layer: int) -> tuple:
    """The layers whose inputs an EAGLE-3 head reads: official (2, L//2, L-3), clamped for tiny test models."""
    return (min(2, n_layer - 1), n_layer // 2, max(n_layer - 3, 0))


def fuse_rows(state_dict: dict, prefix: str, *hook_args, parts: tuple, fused: str):
    """Matrices kept fused (one GEMM: wqkv, w13) may come apart in a checkpoint: stacks their rows and scales/zeros."""
    for suffix in ("weight", "scales", "zeros"):
        if f"{prefix}{parts[0]}.{suffix}" in state_dict:
            state_dict[f"{prefix}{fused}.{suffix}"] = torch.cat([state_dict.pop(f"{prefix}{p}.{suffix}") for p in parts])


def find_multiple(n: int, k: int) -> int:
    """n rounded up to a multiple of k."""
    return -(-n // k) * k


def causal_mask(cache_pos: Tensor, max_seq_length: int) -> Tensor:
    """Row i may read every slot up to and including cache_pos[i]; no wider than the slots any row reads."""
    width = ops.live_width(cache_pos.max(), max_seq_length)
    return torch.arange(width, device=cache_pos.device) <= cache_pos.unsqueeze(-1)


