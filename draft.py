# The EAGLE-1/2 draft head: fc over [token embedding; target feature], then one decoder layer without
# the input norm. It has no embedding, final norm or LM head of its own: the caller embeds tokens and
# reads logits with the target's tensors, so they are shared, never copied.
import json
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

import quantize
from model import KVCache, ModelArgs, TransformerBlock, _fuse_qkv, load_state, one_line, rope_at, rope_table


class EagleHead(nn.Module):
    def __init__(self, args: ModelArgs, fc_bias: bool = True, draft_vocab_size: int = 0):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(2 * args.dim, args.dim, bias=fc_bias)
        self.layers = nn.ModuleList([TransformerBlock(args, input_norm=False)])
        self.max_seq_length = 0
        # Target token ids the head may propose, most frequent first (empty: the whole vocabulary). A draft
        # step over 10 rows reads the LM head once per level; 16k of 49k rows cuts that read by two thirds.
        self.register_buffer("draft_vocab", torch.zeros(draft_vocab_size, dtype=torch.long, device="cpu"),
                             persistent=draft_vocab_size > 0)  # off the meta device: a checkpoint without one never fills it
        self.lm_head = None  # set by use_draft_vocab: the target's LM head rows for draft_vocab
        self._register_load_state_dict_pre_hook(_fuse_qkv)

    def setup_caches(self, max_seq_length: int, dtype=None):
        dtype = dtype or self.layers[0].ffn_norm.weight.dtype  # norms stay float in quantised heads
        self.max_seq_length = max_seq_length
        a = self.layers[0].attention
        a.kv_cache = KVCache(1, a.n_kv, max_seq_length, a.head_dim, dtype).to(self.fc.weight.device)
        # Heads use the RoPE of their own config (its scaling included), sized by the target's context,
        # not the head's max_position_embeddings (often 2048, shorter than the target).
        self.register_buffer("rope", rope_table(self.args, max_seq_length).to(self.fc.weight.device), persistent=False)

    def logits(self, h: Tensor, target_output: nn.Module) -> Tensor:
        """Draft logits over the draft vocabulary (the target's LM head when there is none)."""
        return target_output(h) if self.lm_head is None else self.lm_head(h)

    def target_ids(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target token ids."""
        return draft_ids if self.lm_head is None else self.draft_vocab[draft_ids]

    def forward(self, emb: Tensor, feature: Tensor, input_pos: Tensor, cache_pos: Tensor, mask: Tensor) -> Tensor:
        """emb, feature [B, T, dim] -> predicted next features [B, T, dim] (pre LM head, no norm)."""
        x = self.fc(torch.cat([emb, feature.to(emb.dtype)], dim=-1))
        rope = rope_at(self.rope, input_pos, x.shape[0])
        for layer in self.layers:
            x = layer(x, rope, cache_pos, mask)
        return x


def use_draft_vocab(head: EagleHead, target_output: nn.Module, size=None) -> EagleHead:
    """Gives the head an LM head over the first `size` tokens of its draft vocabulary (default all of it;
    0: none, draft over the target's whole vocabulary). The rows are copied from the target's LM head,
    quantised the same way when it is."""
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
    float_w = target_output.dequantize(torch.float32) if isinstance(target_output, quantize.QuantLinear) else target_output.weight
    rows = nn.Linear(float_w.shape[1], size, bias=False, device=float_w.device, dtype=float_w.dtype)
    rows.weight.data.copy_(float_w[head.draft_vocab.to(float_w.device)])
    if isinstance(target_output, quantize.QuantLinear):
        rows = quantize.QuantLinear.from_linear(rows, target_output.mode, target_output.groupsize)
        rows.to(device=target_output.scales.device, dtype=target_output.scales.dtype)
    head.lm_head = rows
    return head


def save_head(head: EagleHead, out_dir):
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    head.args.save(out_dir / "config.json")
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg.update(kind="eagle", fc_bias=head.fc.bias is not None, draft_vocab_size=len(head.draft_vocab))
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    state = {k: v.contiguous() for k, v in head.state_dict().items() if not k.startswith("lm_head.")}
    save_file(state, str(out_dir / "model.safetensors"))


def check_head_fits(head: ModelArgs, target: ModelArgs):
    if head.dim != target.dim:
        raise ValueError(f"draft head hidden size {head.dim} does not fit the target's {target.dim}")
    if head.vocab_size != target.vocab_size:
        raise ValueError(f"draft head vocabulary {head.vocab_size} does not fit the target's {target.vocab_size}")


def load_head(path, target_args: ModelArgs, device="cpu", dtype=torch.float32) -> EagleHead:
    """Loads a converted head directory and checks that it fits the target."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"draft head {path} has no config.json (convert official heads with convert_hf_checkpoint.py --eagle)")
    try:
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("kind") != "eagle":
            raise ValueError(f"{path} is not an EAGLE head (its config.json lacks kind=eagle)")
        args = ModelArgs.load(cfg_path)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise ValueError(f"{cfg_path}: {one_line(e)}") from None
    check_head_fits(args, target_args)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"draft head {path} has no .safetensors weights")
    with torch.device("meta"):
        head = EagleHead(args, fc_bias=cfg.get("fc_bias", True), draft_vocab_size=cfg.get("draft_vocab_size", 0))
    quantize.prepare(head, cfg)
    try:
        head.load_state_dict(load_state(files[0]), assign=True)
    except RuntimeError as e:
        raise ValueError(f"{files[0]} does not match its config.json: {one_line(e)}") from None
    return head.to(device=device, dtype=dtype)
