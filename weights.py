# Reading and writing weights: safetensors state dicts (a pickle only as weights_only), and EAGLE heads' directories
# (config.json beside model.safetensors), checked against the target they draft for.
import hashlib
import json
import pickle
from pathlib import Path

import torch

import atomic
import interrupt
import quant
from draft import DraftHead, Eagle3Head, EagleHead
from errors import one_line
from model import ModelArgs, eagle3_taps


def load_state(path: Path) -> dict:
    """Weights from a safetensors file, or a pickle read with weights_only=True."""
    path = Path(path)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        with interrupt.held():  # Ctrl-C here is an interrupt, never a damaged file
            if path.suffix == ".safetensors":
                return load_file(str(path))
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except (SafetensorError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise ValueError(f"{path} is truncated or not a weights file ({one_line(e)})") from None


def digest(named_tensors) -> str:
    """A digest of (name, tensor) pairs: names, dtypes, shapes and bytes, in the order given."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in named_tensors:
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def save_head(head: DraftHead, out_dir):
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    head.args.save(out_dir / "config.json")
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg.update(kind=head.kind, draft_vocab_size=len(head.draft_vocab))
    if head.taps:
        cfg.update(taps=list(head.taps))
    if head.kind == "eagle":
        cfg.update(fc_bias=head.fc.bias is not None, token_table=head.token_table is not None)
    atomic.write_text(out_dir / "config.json", json.dumps(cfg, indent=2) + "\n")
    own_lm_head = head.kind == "eagle3"  # an EAGLE-1/2 head's rows are the target's, copied at load time
    state = {k: v.contiguous() for k, v in head.state_dict().items() if own_lm_head or not k.startswith("lm_head.")}
    atomic.write(out_dir / "model.safetensors", lambda tmp: save_file(state, str(tmp)))


def check_head_fits(head: ModelArgs, target: ModelArgs):
    if head.dim != target.dim:
        raise ValueError(f"draft head hidden size {head.dim} does not fit the target's {target.dim}")
    if head.vocab_size != target.vocab_size:
        raise ValueError(f"draft head vocabulary {head.vocab_size} does not fit the target's {target.vocab_size}")


def load_head(path, target_args: ModelArgs, device="cpu", dtype=torch.float32) -> DraftHead:
    """Loads a converted head directory (kind eagle or eagle3) and checks that it fits the target."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"draft head {path} has no config.json (convert official heads with convert_hf_checkpoint.py --eagle)")
    try:
        cfg = json.loads(cfg_path.read_text())
        kind = cfg.get("kind")
        if kind not in ("eagle", "eagle3"):
            raise ValueError(f"{path} is not an EAGLE head (its config.json lacks kind=eagle or kind=eagle3)")
        args = ModelArgs.load(cfg_path)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise ValueError(f"{cfg_path}: {one_line(e)}") from None
    check_head_fits(args, target_args)
    n_layer = target_args.n_layer
    if kind == "eagle3":
        taps = tuple(cfg.get("taps") or eagle3_taps(n_layer))  # converted without a target: the official layers
        fits = len(taps) == 3 and all(0 <= t < n_layer for t in taps)
    else:  # the post-norm state (tap n_layer) first, then the layers whose entering states the head fuses, if any
        taps = tuple(cfg.get("taps") or ())
        fits = not taps or (len(taps) > 1 and taps[0] == n_layer and all(0 <= t < n_layer for t in taps[1:]))
    if not fits:
        raise ValueError(f"draft head taps {list(taps)} do not fit the target's {n_layer} layers")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"draft head {path} has no .safetensors weights")
    with torch.device("meta"):
        if kind == "eagle3":
            head = Eagle3Head(args, cfg["draft_vocab_size"], taps)
        else:
            head = EagleHead(args, cfg.get("fc_bias", True), cfg.get("draft_vocab_size", 0), cfg.get("token_table", False), taps)
    quant.prepare(head, cfg)
    try:
        head.load_state_dict(load_state(files[0]), assign=True)
    except RuntimeError as e:
        raise ValueError(f"{files[0]} does not match its config.json: {one_line(e)}") from None
    return head.to(device=device, dtype=dtype)
