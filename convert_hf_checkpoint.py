# Converts HF LLaMA-architecture checkpoints, llama.cpp GGUF files and official EAGLE-1/2/3 heads into our
# layout: one directory with model.safetensors (our names, fused wqkv, q/k rows in the interleaved RoPE
# layout), config.json (ModelArgs, chat family, stop tokens, BOS) and the tokenizer files.
import interrupt  # noqa: F401  first of all: Ctrl-C during the imports below exits 130 in one line too
import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors import SafetensorError
from tqdm import tqdm

import atomic
import tokenizer as tok
import tp
from draft import Eagle3Head, EagleHead
from model import ModelArgs, Transformer, eagle3_taps, fuse_rows, rope_frequencies
from weights import check_head_fits, load_state, save_head

HF_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
}
GGUF_TOP_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_output.weight": "attention.wo.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
}
EAGLE_TOP_NAMES = {"fc.weight": "fc.weight", "fc.bias": "fc.bias"}
EAGLE_LAYER_NAMES = {k: v for k, v in HF_LAYER_NAMES.items() if k != "input_layernorm.weight"}
EAGLE3_NAMES = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
                "midlayer.hidden_norm.weight": "layers.0.hidden_norm.weight",
                "midlayer.input_layernorm.weight": "layers.0.emb_norm.weight",  # the official name; it norms the embedding
                **{"midlayer." + k: "layers.0." + v for k, v in EAGLE_LAYER_NAMES.items()}}

TOKENIZER_FILES = ["tokenizer.model", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
DOWNLOAD_PATTERNS = ["*.json", "model*.safetensors", "tokenizer.model", "original/tokenizer.model", "chat_template.jinja"]
LLAMA_MODEL_TYPES = {"llama", "mistral"}


# ---------------------------------------------------------------- shared pieces

def rename(name: str, top_names: dict, layer_pattern: str, layer_names: dict) -> str:
    if name in top_names:
        return top_names[name]
    m = re.fullmatch(layer_pattern, name)
    if m and m[2] in layer_names:
        return f"layers.{m[1]}.{layer_names[m[2]]}"
    raise ValueError(f"unexpected tensor {name!r}: not a plain LLaMA checkpoint")


def interleave_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rotate-half rows (per head: the first halves of all pairs, then the second halves) -> pairs side by side."""
    head_dim = w.shape[0] // n_heads
    return w.view(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def fuse_layers(state: dict, args: ModelArgs, n_layer: int, interleave: bool):
    """wq / wk / wv -> one wqkv and w1 / w3 -> one w13 per layer, as the modules keep them; HF q/k rows are put in
    the interleaved RoPE layout first."""
    for i in range(n_layer):
        fuse_rows(state, f"layers.{i}.feed_forward.", parts=("w1", "w3"), fused="w13")
        prefix = f"layers.{i}.attention."
        try:
            q, k, v = (state.pop(prefix + f"w{c}.weight") for c in "qkv")
        except KeyError as e:
            raise ValueError(f"the checkpoint lacks {e.args[0]}") from None
        if interleave:
            q, k = interleave_rotary(q, args.n_head), interleave_rotary(k, args.n_local_heads)
        state[prefix + "wqkv.weight"] = torch.cat([q, k, v])


def check_fits(state: dict, module: torch.nn.Module, skip=()):
    """One-line ValueError at the first tensor that the module would not accept."""
    expected = {k: v.shape for k, v in module.state_dict().items() if k not in skip}
    for k, shape in expected.items():
        if k not in state:
            raise ValueError(f"the checkpoint lacks {k}")
        if state[k].shape != shape:
            raise ValueError(f"{k} has shape {tuple(state[k].shape)}, the config implies {tuple(shape)}")
    for k in state:
        if k not in expected:
            raise ValueError(f"unexpected tensor {k}")


def read_json(path: Path, default: Optional[dict] = None) -> dict:
    if path.is_file():
        return json.loads(path.read_text())
    if default is None:
        raise FileNotFoundError(f"{path} does not exist")
    return default


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs from an HF config.json (transformers 4 and 5 layouts)."""
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and isinstance(cfg.get("rope_parameters"), dict):  # transformers >= 5 layout
        rp = cfg["rope_parameters"]
        if rp.get("rope_type", "default") != "default":
            scaling = rp
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    return ModelArgs(
        dim=cfg["hidden_size"],
        n_layer=cfg["num_hidden_layers"],
        n_head=cfg["num_attention_heads"],
        n_local_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or 0,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_base=float(theta),
        rope_scaling=scaling,
        block_size=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def args_from_hf(config: dict, path: Path) -> ModelArgs:
    try:
        args = args_from_hf_config(config)
    except KeyError as e:
        raise ValueError(f"{path} lacks {e.args[0]}") from None
    rope_frequencies(args)  # raises now on a rope_scaling type we cannot run, not at generation time
    return args


def weight_files(hf_dir: Path) -> list[Path]:
    for index_name in ["model.safetensors.index.json", "pytorch_model.bin.index.json"]:
        if (hf_dir / index_name).is_file():
            shards = read_json(hf_dir / index_name)["weight_map"].values()
            return [hf_dir / f for f in sorted(set(shards))]
    for name in ["model.safetensors", "pytorch_model.bin"]:
        if (hf_dir / name).is_file():
            return [hf_dir / name]
    raise FileNotFoundError(f"no model.safetensors, pytorch_model.bin or shard index in {hf_dir}")


def read_weights(hf_dir: Path) -> dict:
    files = weight_files(hf_dir)
    state = {}
    for f in tqdm(files, desc="reading shards", unit="shard", file=sys.stderr, disable=len(files) == 1):
        state.update(load_state(f))  # .bin files are read with weights_only=True
    return state


def save_weights(state: dict, out_dir: Path):
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic.write(out_dir / "model.safetensors", lambda tmp: save_file({k: v.contiguous() for k, v in state.items()}, str(tmp)))


def stop_tokens(tokenizer, family: str, eos_ids: list) -> list[int]:
    chat_ids = [tokenizer.special_id(text) for text in tok.CHAT_STOP_STRINGS.get(family, [])]
    return list(dict.fromkeys(i for i in [*eos_ids, *chat_ids] if i is not None))


def as_list(value) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def is_rotary_buffer(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")  # recomputed from the config, never loaded


# ---------------------------------------------------------------- HF checkpoints

def check_llama(config: dict, path: Path):
    kind = config.get("model_type")
    if kind not in LLAMA_MODEL_TYPES:
        architectures = ", ".join(config.get("architectures") or []) or "no architectures"
        raise ValueError(f"{path}: model_type {kind!r} ({architectures}) is not a LLaMA-architecture model")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{path}: attention or MLP biases are not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: activation {config['hidden_act']!r} is not supported (only silu)")


def hf_chat_template(hf_dir: Path, tokenizer_config: dict) -> Optional[str]:
    if (hf_dir / "chat_template.jinja").is_file():  # where recent transformers saves it
        return (hf_dir / "chat_template.jinja").read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def hf_bos_token(tokenizer, tokenizer_config: dict) -> Optional[int]:
    if isinstance(tokenizer, tok.SentencePieceTokenizer):
        return tokenizer.bos_id  # Llama-2, Vicuna and Mistral prompts always start with <s>
    begin = tokenizer.special_id("<|begin_of_text|>")
    if begin is not None:
        return begin  # Llama-3's tokenizer.json adds it in its post-processor, whatever add_bos_token says
    return tokenizer.bos_id if tokenizer_config.get("add_bos_token") else None


def convert_hf(hf_dir, out_dir, name: Optional[str] = None) -> ModelArgs:
    """An HF LLaMA-architecture directory (safetensors or .bin, sharded or not) -> our checkpoint in out_dir.

    `name` (default: the directory) helps to recognise a chat format when the tokenizer has no template."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    config = read_json(hf_dir / "config.json")
    check_llama(config, hf_dir)
    args = args_from_hf(config, hf_dir / "config.json")
    if config.get("sliding_window"):
        # Mistral's windowed attention equals full attention up to the window, and we only do full attention.
        args.block_size = min(args.block_size, config["sliding_window"])
    sources = {n: hf_dir / n for n in TOKENIZER_FILES}
    if not sources["tokenizer.model"].is_file():
        sources["tokenizer.model"] = hf_dir / "original" / "tokenizer.model"  # Llama-3 keeps its tiktoken file there
    sources = {n: p for n, p in sources.items() if p.is_file()}
    if "tokenizer.model" not in sources and "tokenizer.json" not in sources:
        raise FileNotFoundError(f"no tokenizer.model or tokenizer.json in {hf_dir}")

    layer_pattern = r"model\.layers\.(\d+)\.(.+)"
    weights = {k: w for k, w in read_weights(hf_dir).items() if not is_rotary_buffer(k)}
    state = {rename(k, HF_TOP_NAMES, layer_pattern, HF_LAYER_NAMES): w for k, w in weights.items()}
    if args.tie_embeddings:
        state.pop("output.weight", None)  # some tied checkpoints store the copy anyway
    fuse_layers(state, args, args.n_layer, interleave=True)
    with torch.device("meta"):
        check_fits(state, Transformer(args), skip={"output.weight"} if args.tie_embeddings else ())
    save_weights(state, out_dir)

    for n, path in sources.items():
        atomic.write(out_dir / n, lambda tmp: shutil.copyfile(path, tmp))
    tokenizer = tok.load_tokenizer(out_dir)
    tokenizer_config = read_json(out_dir / "tokenizer_config.json", default={})
    generation_config = read_json(hf_dir / "generation_config.json", default={})
    family = tok.detect_chat_family(hf_chat_template(hf_dir, tokenizer_config), name or str(hf_dir))
    eos_ids = as_list(generation_config.get("eos_token_id")) + as_list(config.get("eos_token_id"))
    args.chat_template, args.stop_tokens = family, stop_tokens(tokenizer, family, eos_ids)
    args.bos_token = hf_bos_token(tokenizer, tokenizer_config)
    args.save(out_dir / "config.json")
    return args


# ---------------------------------------------------------------- GGUF files

def convert_gguf(gguf_path, out_dir) -> ModelArgs:
    """A llama.cpp GGUF file (architecture llama, any quantisation) -> our checkpoint in fp32 in out_dir."""
    import gguf

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path} does not exist")
    # The reader memory-maps the file and trusts its offsets: a truncated file fails anywhere inside numpy.
    unreadable = (ValueError, IndexError, KeyError, TypeError, EOFError)
    try:
        reader = gguf.GGUFReader(gguf_path)
    except unreadable as e:
        raise ValueError(f"{gguf_path} is truncated or not a GGUF file ({type(e).__name__}: {str(e)[:120]})") from None

    def meta(key, default=None):
        return reader.fields[key].contents() if key in reader.fields else default

    if meta("general.architecture") != "llama":
        raise ValueError(f"{gguf_path}: architecture {meta('general.architecture')!r} is not supported (only llama)")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"{gguf_path}: Llama-3.1 RoPE scaling (rope_freqs) is not supported; convert the HF checkpoint")
    scaling = meta("llama.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"{gguf_path}: RoPE scaling {scaling!r} is not supported (only linear)")

    state = {}
    for t in tqdm(reader.tensors, desc="dequantising", unit="tensor", file=sys.stderr, leave=False):  # gone when done: errors stay one line
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)  # float32 in nn.Linear's (out, in) layout
        except unreadable as e:
            raise ValueError(f"{gguf_path}: tensor {t.name} is truncated or malformed ({str(e)[:120]})") from None
        w = np.array(w, dtype=np.float32)  # a copy: F32 tensors come back as read-only memmaps
        state[rename(t.name, GGUF_TOP_NAMES, r"blk\.(\d+)\.(.+)", GGUF_LAYER_NAMES)] = torch.from_numpy(w)
    n_head, dim = meta("llama.attention.head_count"), meta("llama.embedding_length")
    args = ModelArgs(
        dim=dim,
        n_layer=meta("llama.block_count"),
        n_head=n_head,
        n_local_heads=meta("llama.attention.head_count_kv", n_head),
        head_dim=meta("llama.attention.key_length", dim // n_head),
        intermediate_size=meta("llama.feed_forward_length"),
        vocab_size=state["tok_embeddings.weight"].shape[0],
        # stored as float32: 7 significant digits give back the value that was written (1e-5, not 9.99999975e-06)
        norm_eps=float(f"{meta('llama.attention.layer_norm_rms_epsilon', 1e-5):.7g}"),
        rope_base=float(meta("llama.rope.freq_base", 10000.0)),
        rope_scaling={"rope_type": "linear", "factor": meta("llama.rope.scaling.factor")} if scaling == "linear" else None,
        block_size=meta("llama.context_length", 4096),
        tie_embeddings="output.weight" not in state,
    )
    if meta("llama.rope.dimension_count", args.head_dim) != args.head_dim:
        raise ValueError(f"{gguf_path}: RoPE over part of each head is not supported")
    fuse_layers(state, args, args.n_layer, interleave=False)  # llama.cpp stores q/k rows interleaved already
    with torch.device("meta"):
        check_fits(state, Transformer(args), skip={"output.weight"} if args.tie_embeddings else ())
    save_weights(state, out_dir)

    atomic.write_text(out_dir / "tokenizer.json", tok.tokenizer_json_from_gguf(gguf_path))
    facts = tok.gguf_tokenizer_facts(gguf_path)
    family = tok.detect_chat_family(facts["chat_template"], gguf_path.name)
    args.chat_template, args.stop_tokens = family, stop_tokens(tok.load_tokenizer(out_dir), family, as_list(facts["eos_id"]))
    args.bos_token = facts["bos_id"] if facts["add_bos"] else None
    args.save(out_dir / "config.json")
    return args


# ---------------------------------------------------------------- official EAGLE heads

def convert_eagle(head_dir, out_dir, target_dir=None) -> ModelArgs:
    """An official EAGLE-1/2 or EAGLE-3 head (config.json + pytorch_model.bin or model.safetensors) -> a
    weights.load_head directory. With target_dir (our converted target) the head must fit it."""
    head_dir, out_dir = Path(head_dir), Path(out_dir)
    config = read_json(head_dir / "config.json")
    raw = {k.removeprefix("model."): w for k, w in read_weights(head_dir).items() if not is_rotary_buffer(k)}
    args = args_from_hf(config, head_dir / "config.json")
    target = ModelArgs.load(Path(target_dir) / "config.json") if target_dir is not None else None
    if target is not None:
        check_head_fits(args, target)
    raw.pop("embed_tokens.weight", None)  # a copy of the target's embedding, which the head shares instead
    if "d2t" in raw or any(k.startswith("midlayer.") for k in raw):
        return convert_eagle3(config, raw, out_dir, args, target)

    state = {rename(k, EAGLE_TOP_NAMES, r"layers\.(\d+)\.(.+)", HF_LAYER_NAMES): w for k, w in raw.items()}  # layer 0 has no input norm
    fuse_layers(state, args, max(1, args.n_layer), interleave=True)  # the official configs say 1 layer
    with torch.device("meta"):
        head = EagleHead(args, fc_bias="fc.bias" in state)  # the key decides: configs often omit "bias"
    check_fits(state, head)
    head.load_state_dict(state, assign=True)
    save_head(head, out_dir)
    return args


def eagle3_draft_vocab(raw: dict, draft_size: int, vocab_size: int) -> torch.Tensor:
    """The target id of each draft id: d + d2t[d] (no d2t: the draft vocabulary is the target's), checked
    against the t2d mask when there is one."""
    d2t, t2d = raw.pop("d2t", None), raw.pop("t2d", None)
    ids = torch.arange(draft_size)
    if d2t is not None:
        if d2t.shape != (draft_size,):
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}, draft_vocab_size {draft_size} implies ({draft_size},)")
        ids = ids + d2t.long()
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size or len(ids.unique()) != len(ids)):
        raise ValueError(f"d2t maps draft ids outside the vocabulary of {vocab_size} or onto one id twice")
    if t2d is not None:
        if t2d.shape != (vocab_size,):
            raise ValueError(f"t2d has {t2d.numel()} entries, the head's vocabulary {vocab_size}")
        if int(t2d.bool().sum()) != draft_size or not bool(t2d.bool()[ids].all()):
            raise ValueError("t2d does not mark the target ids that d2t maps to")
    return ids


def convert_eagle3(config: dict, raw: dict, out_dir: Path, args: ModelArgs, target: Optional[ModelArgs]) -> ModelArgs:
    """The official EAGLE-3 head layout -> ours: midlayer -> layers.0, q/k rows interleaved, d2t offsets
    -> draft_vocab (target ids), the taps of the target when known (else load_head picks the official ones)."""
    fused_dim = config.get("target_hidden_size") or args.dim
    if fused_dim != args.dim:  # the embedding is the target's, so the head must be as wide as the target
        raise ValueError(f"EAGLE-3 head hidden size {args.dim} differs from its target_hidden_size {fused_dim}: not supported")
    draft_size = config.get("draft_vocab_size") or args.vocab_size
    unknown = sorted(k for k in raw if k not in EAGLE3_NAMES and k not in ("d2t", "t2d"))
    if unknown:
        raise ValueError(f"unexpected tensor {unknown[0]!r}: not an EAGLE-3 head")
    draft_vocab = eagle3_draft_vocab(raw, draft_size, args.vocab_size)
    state = {EAGLE3_NAMES[k]: w for k, w in raw.items()}
    fuse_layers(state, args, 1, interleave=True)
    state["draft_vocab"] = draft_vocab
    with torch.device("meta"):
        head = Eagle3Head(args, draft_size, eagle3_taps(target.n_layer) if target else ())
    check_fits(state, head)
    head.load_state_dict(state, assign=True)
    save_head(head, out_dir)
    return args


# ---------------------------------------------------------------- the hub and the embedded default

def download(repo_id: str) -> Path:
    import huggingface_hub

    path = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS))
    if not any(path.glob("model*.safetensors")):  # older repos and EAGLE heads ship only pickled weights
        path = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS + ["pytorch_model*.bin"]))
    return path


# ---------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Convert an HF LLaMA checkpoint, a GGUF file or an official EAGLE-1/2/3 head.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint-dir", type=Path, help="HF directory: config.json, weights, tokenizer")
    source.add_argument("--gguf", type=Path, help="llama.cpp GGUF file of a llama-architecture model")
    source.add_argument("--repo-id", help="HF hub repository to download and convert")
    parser.add_argument("--eagle", action="store_true", help="the source is an official EAGLE-1/2 or EAGLE-3 draft head")
    parser.add_argument("--target", type=Path, help="with --eagle: our converted target, which the head must fit")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.target and not opts.eagle:
        parser.error("--target goes with --eagle")
    if opts.gguf and opts.eagle:
        parser.error("--eagle converts an HF head directory, not a GGUF file")
    try:
        if opts.gguf:
            convert_gguf(opts.gguf, opts.out)
        else:
            source_dir = download(opts.repo_id) if opts.repo_id else opts.checkpoint_dir
            if not source_dir.is_dir():
                raise FileNotFoundError(f"{source_dir} is not a directory")
            if opts.eagle:
                convert_eagle(source_dir, opts.out, opts.target)
            else:
                convert_hf(source_dir, opts.out, name=opts.repo_id)
    except (OSError, ValueError, SafetensorError) as e:  # SafetensorError: safetensors' own, a full disk's too
        print(f"error: {(str(e).splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        return 2
    print(f"wrote {opts.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    tp.exit_with(main)
