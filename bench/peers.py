# What users compare us with, on our prompts, chat template and token budget: HF transformers `generate` (plain
# and with prompt lookup) and llama.cpp (through llama-cpp-python). Both are optional, benchmark-only
# dependencies (docs/results.md says how to install them); bench.py --peers skips a missing one with a note.
#
# Each peer gets the same token ids we feed our model (our tokenizer and template), runs greedy, stops on our
# stop tokens or the budget, and is timed like Generator.generate: prefill included, model loading excluded.
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from model import ModelArgs
from weights import load_state

PEERS = ("transformers", "llama.cpp")
LLAMA_CPP_TYPES = ("bf16", "q8_0", "q4_1")  # q4_1: the shipped GGUF itself; f32 joins them when we decode in fp32


class PeerUnavailable(Exception):
    """A peer that cannot run here: its package is missing or it cannot read this checkpoint."""


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def deinterleave_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved RoPE rows (ours, llama.cpp's) -> HF rotate-half rows; convert_hf_checkpoint.interleave_rotary's inverse."""
    head_dim = w.shape[0] // n_heads
    return w.view(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def float_state(checkpoint: Path) -> tuple:
    """(ModelArgs, per-matrix fp32 state with wq / wk / wv apart) of a float checkpoint."""
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("quantization"):
        raise PeerUnavailable("peers run float checkpoints (use the float one; llama.cpp quantises its own copy)")
    args = ModelArgs.load(checkpoint / "config.json")
    state = {k: v.float() for k, v in load_state(checkpoint / "model.safetensors").items()}
    q_size, kv_size = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
    for i in range(args.n_layer):
        wq, wk, wv = state.pop(f"layers.{i}.attention.wqkv.weight").split([q_size, kv_size, kv_size])
        state |= {f"layers.{i}.attention.w{c}.weight": w for c, w in zip("qkv", (wq, wk, wv))}
        if f"layers.{i}.feed_forward.w13.weight" in state:  # checkpoints converted before w13 keep w1 / w3 apart
            w1, w3 = state.pop(f"layers.{i}.feed_forward.w13.weight").chunk(2)
            state |= {f"layers.{i}.feed_forward.w1.weight": w1, f"layers.{i}.feed_forward.w3.weight": w3}
    state.setdefault("output.weight", state["tok_embeddings.weight"])
    return args, state


# ---------------------------------------------------------------- HF transformers

def transformers_model(checkpoint: Path, dtype):
    if not has("transformers"):
        raise PeerUnavailable("transformers is not installed (pip install transformers)")
    from transformers import LlamaConfig, LlamaForCausalLM

    args, state = float_state(checkpoint)
    config = LlamaConfig(hidden_size=args.dim, intermediate_size=args.intermediate_size, num_hidden_layers=args.n_layer,
                         num_attention_heads=args.n_head, num_key_value_heads=args.n_local_heads, head_dim=args.head_dim,
                         vocab_size=args.vocab_size, rms_norm_eps=args.norm_eps, rope_theta=args.rope_base,
                         rope_scaling=args.rope_scaling, max_position_embeddings=args.block_size,
                         tie_word_embeddings=args.tie_embeddings)
    names = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj", "feed_forward.w3": "mlp.up_proj",
             "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj"}
    hf = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"],
          "lm_head.weight": state["output.weight"]}
    for i in range(args.n_layer):
        for ours, theirs in names.items():
            w = state[f"layers.{i}.{ours}.weight"]
            if ours in ("attention.wq", "attention.wk"):
                w = deinterleave_rotary(w, args.n_head if ours == "attention.wq" else args.n_local_heads)
            hf[f"model.layers.{i}.{theirs}.weight"] = w
    model = LlamaForCausalLM(config)  # on the CPU, not meta: the rotary buffers are computed at construction
    model.load_state_dict(hf, strict=not args.tie_embeddings)
    return model.to(dtype).eval()


@torch.inference_mode()
def transformers_generate(model, prompt: list, max_new_tokens: int, stop_ids, lookup: int = 0) -> tuple:
    """-> (new token ids, seconds). lookup > 0: prompt lookup decoding with that many tokens."""
    x = torch.tensor([prompt])
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    t0 = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=list(stop_ids), pad_token_id=list(stop_ids)[0], **kw)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t0


# ---------------------------------------------------------------- llama.cpp

GGUF_NAMES = {"attention_norm": "attn_norm", "ffn_norm": "ffn_norm", "attention.wq": "attn_q", "attention.wk": "attn_k",
              "attention.wv": "attn_v", "attention.wo": "attn_output", "feed_forward.w1": "ffn_gate",
              "feed_forward.w2": "ffn_down", "feed_forward.w3": "ffn_up"}


def gguf_source(checkpoint: Path) -> Path:
    """The GGUF whose metadata (tokenizer, hyperparameters) a written GGUF copies: the shipped one of the default model."""
    from checkpoint import DEFAULT_NAME, smollm2_gguf

    if checkpoint.name != DEFAULT_NAME:
        raise PeerUnavailable(f"llama.cpp needs GGUF tokenizer metadata; only the default model's is at hand ({checkpoint.name})")
    try:
        return smollm2_gguf()
    except FileNotFoundError as e:
        raise PeerUnavailable(str(e)) from None


def write_gguf(checkpoint: Path, out: Path, qtype: str) -> Path:
    """Our float weights as a GGUF of qtype (f32, bf16 or q8_0), metadata copied from the source GGUF. q/k rows stay as
    they are: llama.cpp stores them in the interleaved layout we use."""
    import gguf
    import numpy as np

    source = gguf.GGUFReader(gguf_source(checkpoint))
    args, state = float_state(checkpoint)
    kind, file_type = {"f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
                       "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
                       "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}[qtype]
    writer = gguf.GGUFWriter(str(out), "llama")
    for key, field in source.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type", "general.quantization_version"):
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def add(name, w: torch.Tensor, matrix: bool):
        a = w.numpy().astype(np.float32)
        if not matrix or qtype == "f32":  # norms stay fp32, as llama.cpp's converter writes them (f32: everything)
            writer.add_tensor(name, a)
            return
        writer.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)  # bytes; the writer derives the shape

    add("token_embd.weight", state["tok_embeddings.weight"], True)
    add("output_norm.weight", state["norm.weight"], False)
    if not args.tie_embeddings:
        add("output.weight", state["output.weight"], True)
    for i in range(args.n_layer):
        for ours, theirs in GGUF_NAMES.items():
            add(f"blk.{i}.{theirs}.weight", state[f"layers.{i}.{ours}.weight"], not ours.endswith("norm"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def llama_cpp_model(checkpoint: Path, qtype: str, n_ctx: int, threads: int):
    """A llama_cpp.Llama over our checkpoint at qtype: the shipped Q4_1 GGUF, or our weights written as a GGUF into a
    temporary directory that is gone once the model is loaded (llama.cpp maps the file, and the mapping outlives its
    name): a run's few hundred MB never stay behind."""
    if not has("llama_cpp"):
        raise PeerUnavailable("llama-cpp-python is not installed (pip install llama-cpp-python; builds in ~3 min)")
    import llama_cpp

    def load(path: Path):
        return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)

    if qtype == "q4_1":
        return load(gguf_source(checkpoint))
    with tempfile.TemporaryDirectory(prefix="eaglet-gguf-", ignore_cleanup_errors=True) as tmp:
        path = Path(tmp) / f"{checkpoint.name}.{qtype}.gguf"
        write_gguf(checkpoint, path, qtype)
        return load(path)


def llama_cpp_generate(llm, prompt: list, max_new_tokens: int, stop_ids) -> tuple:
    """-> (new token ids, seconds), greedy."""
    out = []
    llm.reset()  # else llama-cpp-python keeps the KV of the prefix shared with the last prompt (the system prompt)
    t0 = time.perf_counter()
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(token)
        if token in stop_ids or len(out) >= max_new_tokens:
            break
    return out, time.perf_counter() - t0


def peer_runners(checkpoint: Path, names: list, dtype, n_ctx: int, log=lambda s: print(s, file=sys.stderr)) -> dict:
    """{row name: generate(prompt, max_new_tokens, stop_ids) -> (ids, seconds)} for every peer that can run; a
    note is logged for each that cannot."""
    runners = {}
    threads = torch.get_num_threads()
    if "transformers" in names:
        try:
            hf = transformers_model(checkpoint, dtype)
            precision = str(dtype).removeprefix("torch.")
            runners[f"hf {precision}"] = lambda p, n, s: transformers_generate(hf, p, n, s)
            runners[f"hf {precision} lookup10"] = lambda p, n, s: transformers_generate(hf, p, n, s, lookup=10)
        except PeerUnavailable as e:
            log(f"note: skipping transformers: {e}")
    if "llama.cpp" in names:
        for qtype in ("f32",) * (dtype == torch.float32) + LLAMA_CPP_TYPES:
            try:
                llm = llama_cpp_model(checkpoint, qtype, n_ctx, threads)
                runners[f"llama.cpp {qtype}"] = lambda p, n, s, llm=llm: llama_cpp_generate(llm, p, n, s)
            except PeerUnavailable as e:
                log(f"note: skipping llama.cpp {qtype}: {e}")
                if not has("llama_cpp"):
                    break
    return runners
