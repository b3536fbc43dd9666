# Writes an int8 / int4 weight-only quantised copy of a converted checkpoint or EAGLE head directory, and
# measures a quantised checkpoint's logit error against the float one. The layer itself is quant.py's.
import interrupt  # noqa: F401  first of all: Ctrl-C during the imports below exits 130 in one line too
import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn

import atomic
import tp
from checkpoint import load_model
from errors import UsageError, UsageParser
from model import ModelArgs, causal_mask
from quant import GROUPSIZES, MODES, quantize_model
from tokenizer import load_tokenizer
from weights import load_head

EVAL_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books far "
    "faster than any scribe. Within fifty years, presses were running in more than two hundred European "
    "cities, and the price of a book fell so sharply that reading spread from monasteries and universities "
    "to merchants, craftsmen and their children. Scholars argue about how much the press changed religion, "
    "science and politics, but few doubt that it changed how ideas travel."
)


def default_out(checkpoint: Path, mode: str, groupsize: int) -> Path:
    suffix = "int8" if mode == "int8" else f"int4-g{groupsize}"
    return checkpoint.with_name(f"{checkpoint.name}-{suffix}")


def read_config(checkpoint: Path) -> dict:
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint} has no config.json")
    return json.loads((checkpoint / "config.json").read_text())


def load_float(checkpoint: Path, config: dict) -> nn.Module:
    """A target checkpoint or an EAGLE head dir (config kind "eagle"), fp32 on the CPU."""
    if config.get("quantization"):
        raise ValueError(f"{checkpoint} is already quantised ({config['quantization']})")
    if config.get("kind") == "eagle":
        return load_head(checkpoint, ModelArgs.load(checkpoint / "config.json"))
    return load_model(checkpoint)


def quantize_checkpoint(checkpoint: Path, out: Path, mode: str, groupsize: int = 32) -> Path:
    """Writes out/: model.safetensors with the quantised tensors, config.json with "quantization", and every
    other file of the source (the tokenizer's)."""
    from safetensors.torch import save_file

    checkpoint, out = Path(checkpoint), Path(out)
    config = read_config(checkpoint)
    model = quantize_model(load_float(checkpoint, config), mode, groupsize)
    config["quantization"] = {"mode": mode, "groupsize": groupsize} if mode == "int4" else {"mode": mode}
    if config.get("tie_embeddings"):
        config["tie_embeddings"] = False
        config["quantization"]["untied_lm_head"] = True  # output is a quantised copy of the float embedding
    out.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            atomic.write(out / f.name, lambda tmp: shutil.copy2(f, tmp))
    atomic.write(out / "model.safetensors", lambda tmp: save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp)))
    atomic.write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    return out


@torch.inference_mode()
def logit_error(checkpoint_dir, quant_dir, device="cpu", prompt_ids=None, dtype=None) -> dict:
    """Logits of the quantised checkpoint against the float one over one prompt (EVAL_TEXT by default):
    max and mean |delta logit| and how often the two agree on the top-1 token."""
    if prompt_ids is None:
        prompt_ids = load_tokenizer(checkpoint_dir).encode(EVAL_TEXT)
    dtype = dtype or (torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16)
    x = torch.tensor([prompt_ids], device=device)
    pos = torch.arange(x.shape[1], device=device)
    logits = []
    for path in (checkpoint_dir, quant_dir):
        model = load_model(path, device, dtype)
        model.setup_caches(x.shape[1])
        logits.append(model(x, pos, pos, causal_mask(pos, x.shape[1]))[0][0].float())
    ref, quant = logits
    delta = (quant - ref).abs()
    return {
        "tokens": x.shape[1],
        "max_abs_delta": round(delta.max().item(), 4),
        "mean_abs_delta": round(delta.mean().item(), 4),
        "top1_agreement": round((quant.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4),
        "ref_logit_std": round(ref.std().item(), 4),
        "dtype": str(dtype).removeprefix("torch."),
    }


# ---------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = UsageParser(description="Write an int8 / int4 weight-only quantised copy of a checkpoint or EAGLE head dir.")
    p.add_argument("--checkpoint", type=Path, required=True, help="converted checkpoint or EAGLE head dir")
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--groupsize", type=int, choices=GROUPSIZES, default=32, help="int4 only (default 32)")
    p.add_argument("--out", type=Path, default=None, help="default: CHECKPOINT-int8 / CHECKPOINT-int4-gG")
    p.add_argument("--eval-against", type=Path, metavar="FLOAT_DIR", default=None,
                   help="instead of quantising, print the logit error of --checkpoint (quantised) against FLOAT_DIR as JSON")
    p.add_argument("--device", default="cpu", help="for --eval-against")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="for --eval-against: both models run in it (default: bf16 on CUDA, fp32 on CPU)")
    return p


def main(argv=None) -> int:
    try:
        opts = build_parser().parse_args(argv)
        if opts.eval_against is not None:
            print(json.dumps(logit_error(opts.eval_against, opts.checkpoint, opts.device, dtype=getattr(torch, opts.dtype) if opts.dtype else None)))
            return 0
        if opts.mode is None:
            raise UsageError("--mode int8|int4 is required (or --eval-against FLOAT_DIR)")
        out = opts.out or default_out(opts.checkpoint, opts.mode, opts.groupsize)
        print(quantize_checkpoint(opts.checkpoint, out, opts.mode, opts.groupsize))
    except (UsageError, ValueError, OSError, RuntimeError) as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    tp.exit_with(main)
