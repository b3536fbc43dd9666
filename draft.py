# The draft heads. EAGLE-1/2 (kind "eagle"): fc over [token embedding; target feature], then one decoder
# layer without the input norm (config n_layer; the official heads have one, further layers have the norm, as in the
# official code); no embedding, final norm or LM head of its own: the caller embeds tokens and reads logits with the
# target's tensors, so they are shared, never copied. With taps (this project's extension), where the target's feature
# enters (the first draft level) the head also reads EAGLE-3's fused states through `fuse`, added to fc's output.
# EAGLE-3 (kind "eagle3"): fc maps the target's fused features (the states entering three layers, 3*dim)
# to dim; one decoder layer whose attention reads [norm(token embedding); norm(h)] (2*dim) with the
# residual on h; its own final norm and LM head over a draft vocabulary. Deeper draft levels feed the
# layer's own output back as h, skipping fc. The embedding is still the target's. Loading and saving: weights.py.
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import ops
import quant
from model import Attention, FeedForward, KVCache, ModelArgs, RMSNorm, TransformerBlock, rope_at, rope_table


class DraftHead(nn.Module):
    """What the speculative cycle needs of any head: caches, logits over the draft vocabulary, the map to target ids."""

    kind = ""

    def __init__(self, args: ModelArgs, draft_vocab_size: int, taps: tuple = ()):
        super().__init__()
        self.args = args
        self.max_seq_length = 0
        self.taps = tuple(taps)  # the target layers whose entering states the head reads (target.taps; n_layer: the post-norm one)
        self.token_table = None
        # Target ids the head may propose (empty: all). Each draft level reads its LM head: 16k of 49k rows, a third
        self.register_buffer("draft_vocab", torch.zeros(draft_vocab_size, dtype=torch.long, device="cpu"),
                             persistent=draft_vocab_size > 0)  # off the meta device: a checkpoint without one never fills it

    def embed(self, tokens: Tensor, embedding: Tensor) -> Tensor:
        """The target's embedding rows (shared, never copied), plus the head's own learned row if it has a token table."""
        emb = F.embedding(tokens, embedding)
        return emb if self.token_table is None else emb + self.token_table[self.token_row[tokens]].to(emb.dtype)

    def setup_caches(self, max_seq_length: int, dtype=None):
        norm = self.layers[0].ffn_norm.weight  # norms stay float in quantised heads
        dtype = dtype or norm.dtype
        self.max_seq_length = max_seq_length
        for layer in self.layers:
            a = layer.attention
            a.kv_cache = KVCache(1, a.n_kv, max_seq_length, a.head_dim, dtype).to(norm.device)
        # Heads use the RoPE of their own config (its scaling included), sized by the target's context,
        # not the head's max_position_embeddings (often 2048, shorter than the target).
        self.register_buffer("rope", rope_table(self.args, max_seq_length).to(norm.device), persistent=False)

    def target_ids(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target token ids."""
        return draft_ids if self.lm_head is None else self.draft_vocab[draft_ids]


class EagleHead(DraftHead):
    kind = "eagle"

    def __init__(self, args: ModelArgs, fc_bias: bool = True, draft_vocab_size: int = 0, token_table: bool = False, taps: tuple = ()):
        super().__init__(args, draft_vocab_size, taps)  # taps: (n_layer, then the layers fuse reads) or none
        self.fc = nn.Linear(2 * args.dim, args.dim, bias=fc_bias)
        self.fuse = nn.Linear((len(taps) - 1) * args.dim, args.dim, bias=False) if taps else None
        # A learned input row per draft-vocabulary token (the last: every other one), added to its embedding: what follows
        # a token ("trud": "ged") is lexical knowledge one layer over a frozen embedding learns slowly. A lookup: no draft time.
        rows = draft_vocab_size or args.vocab_size  # without a draft vocabulary, one per token id
        self.token_table = nn.Parameter(torch.zeros(rows + 1, args.dim)) if token_table else None
        if token_table:  # target id -> row
            row = torch.full((args.vocab_size,), rows) if draft_vocab_size else torch.arange(rows)
            self.register_buffer("token_row", row.int())
        # The official heads have one layer (n_layer 1); the official code norms the input of any later one.
        self.layers = nn.ModuleList([TransformerBlock(args, input_norm=i > 0) for i in range(max(1, args.n_layer))])
        self.lm_head = None  # set by use_draft_vocab: the target's LM head rows for draft_vocab

    def logits(self, h: Tensor, target_output: nn.Module) -> Tensor:
        """Draft logits over the draft vocabulary (the target's LM head when there is none)."""
        return target_output(h) if self.lm_head is None else self.lm_head(h)

    def forward(self, tokens: Tensor, embedding: Tensor, feature: Tensor, input_pos, cache_pos, mask, attention=None) -> Tensor:
        """tokens [B, T] (target ids; embedding: the target's weight), feature [B, T, dim] (with taps, the target's: len(taps)
        * dim) -> predicted next features [B, T, dim] (pre LM head, no norm). attention: one per layer, or None (Eagle3Block)."""
        emb = self.embed(tokens, embedding)
        feature, fused = feature.to(emb.dtype).split([self.args.dim, feature.shape[-1] - self.args.dim], dim=-1)
        x = self.fc(ops.cat([emb, feature], dim=-1))
        if fused.shape[-1]:  # static: the target's states with taps, not the head's own output one level up
            x = x + self.fuse(fused)
        rope = rope_at(self.rope, input_pos, x.shape[0])
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, cache_pos, mask, attention and attention[i])
        return x


class Eagle3Block(nn.Module):
    """EAGLE-3's decoder layer: attention over [emb_norm(embedding); hidden_norm(h)], residual on h."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.emb_norm = RMSNorm(args.dim, args.norm_eps)  # official: input_layernorm
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, in_dim=2 * args.dim)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, emb: Tensor, h: Tensor, rope: Tensor, cache_pos: Tensor, mask: Tensor, attention=None) -> Tensor:
        """attention(x, rope, cache_pos, mask): training swaps in its own (train_draft's unrolled steps)."""
        x = ops.cat([self.emb_norm(emb), self.hidden_norm(h)], dim=-1)
        h = h + (attention or self.attention)(x, rope, cache_pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Eagle3Head(DraftHead):
    kind = "eagle3"

    def __init__(self, args: ModelArgs, draft_vocab_size: int, taps: tuple):
        super().__init__(args, draft_vocab_size, taps)  # empty until known: load_head fills in the official layers of the target
        self.fc = nn.Linear(3 * args.dim, args.dim, bias=False)
        self.layers = nn.ModuleList([Eagle3Block(args)])
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, draft_vocab_size, bias=False)

    def logits(self, h: Tensor, target_output: nn.Module = None) -> Tensor:
        """Draft logits over the head's own vocabulary (draft ids; target_ids maps them)."""
        return self.lm_head(self.norm(h))

    def forward(self, tokens: Tensor, embedding: Tensor, feature: Tensor, input_pos, cache_pos, mask, attention=None) -> Tensor:
        """tokens [B, T] (embedding: the target's weight); feature [B, T, taps * dim] (the target's fused states) or [B, T,
        dim] (the head's own output one level up, which skips fc) -> the layer's output [B, T, dim], before the final norm."""
        emb = self.embed(tokens, embedding)
        h = feature.to(emb.dtype)
        if h.shape[-1] != self.args.dim:  # static: the shape decides at trace time
            h = self.fc(h)
        return self.layers[0](emb, h, rope_at(self.rope, input_pos, h.shape[0]), cache_pos, mask, attention and attention[0])


def use_draft_vocab(head: EagleHead, target_output: nn.Module, size=None) -> EagleHead:
    """Gives the head an LM head over the first `size` tokens of its draft vocabulary (default all of it;
    0: none, draft over the target's whole vocabulary). The rows are copied from the target's LM head,
    quantised the same way when it is. An EAGLE-3 head keeps its own LM head and vocabulary."""
    if isinstance(head, Eagle3Head):
        if size is not None and size != len(head.draft_vocab):
            raise ValueError(f"an EAGLE-3 head drafts over its own vocabulary of {len(head.draft_vocab)} tokens; --draft-vocab cannot change it")
        return head
    size = len(head.draft_vocab) if size is None else size
    if size > len(head.draft_vocab) and len(head.draft_vocab):
        raise ValueError(f"--draft-vocab {size} exceeds the head's draft vocabulary of {len(head.draft_vocab)}")
    head.lm_head = None
    if size == 0 or not len(head.draft_vocab):
        head.draft_vocab = head.draft_vocab[:0]
        return head
    vocab = head.draft_vocab[:size].contiguous()
    n = target_output.out_features
    if int(vocab.min()) < 0 or int(vocab.max()) >= n:
        raise ValueError(f"draft vocabulary has token ids outside the target's vocabulary [0, {n})")
    if len(vocab.unique()) != len(vocab):
        # Two siblings with one token would give that token two chances to be accepted: biased at T > 0.
        raise ValueError(f"draft vocabulary repeats token ids ({len(vocab) - len(vocab.unique())} duplicates)")
    head.draft_vocab = vocab
    float_w = target_output.dequantize(torch.float32) if isinstance(target_output, quant.QuantLinear) else target_output.weight
    rows = nn.Linear(float_w.shape[1], size, bias=False, device=float_w.device, dtype=float_w.dtype)
    rows.weight.data.copy_(float_w[head.draft_vocab.to(float_w.device)])
    if isinstance(target_output, quant.QuantLinear):
        rows = quant.QuantLinear.from_linear(rows, target_output.mode, target_output.groupsize)
        rows.to(device=target_output.scales.device, dtype=target_output.scales.dtype)
    head.lm_head = rows
    return head
