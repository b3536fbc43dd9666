# The seam between the algorithm and a backend: the few operations a backend may replace, and the hooks through which
# it readies the models and compiles the steps. What is here is plain torch and runs anywhere; cpu/ (imported by the
# loading code, eaglet.py) registers its kernels and its preparation with register(). model.py and sampling.py call
# these, never a kernel.
import torch
from torch import Tensor


# ---------------------------------------------------------------- operations

def attends(q: Tensor) -> bool:
    """Whether attend serves these queries (model.attend_few asks while tracing a compiled step)."""
    return False


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, tree_k: Tensor, tree_v: Tensor, scale: float) -> Tensor:
    """Attention of few queries q [B, H, T, D] over the cache's k/v [B, Hkv, S, D] and a verify's own tree_k/tree_v,
    one softmax over both, mask [B, H, T, S + T'] (model.attend_few computes the same in torch)."""
    raise NotImplementedError


def argmax(logits: Tensor) -> Tensor:
    return torch.argmax(logits, dim=-1)


def samples(logits: Tensor) -> bool:
    """Whether sample serves these logits."""
    return False


def sample(logits: Tensor, temperature: float, u: Tensor) -> Tensor:
    """One draw per row of softmax(logits / temperature) by the inverse CDF at u (float64 uniforms, a row each), as
    sampling.sample draws from the probabilities."""
    raise NotImplementedError


# ---------------------------------------------------------------- preparing and compiling

def choose(compile, target, log=print):
    """The CLI's --compile value -> the setting a Generator compiles with (True, or a backend's own, e.g. "max")."""
    return True if compile in ("auto", "packed") else compile


def prepare(compile, target, *drafters):
    """Readies the models' weights for decoding (compile: False, or choose's answer), in place. -> None, or the
    Inductor options of graphs over these weights (e.g. frozen weights' key)."""
    return None


def inductor_settings(device: torch.device, frozen) -> dict:
    """Inductor's global settings for this device's compiled steps (frozen: prepare's answer)."""
    return {"coordinate_descent_tuning": True} if device.type == "cuda" else {}  # CUDA: gpt-fast's


def step_compiler(device: torch.device, frozen):
    """None (steps compile lazily, at their first call, as torch.compile does) or a function (name, fn, args,
    dynamic, log) -> (step, seconds compiling) that builds a step before the answer and may load it from disk."""
    return None


def kernel_name(dtype) -> str:
    """What runs a prepared linear of this dtype: part of the keys of measured costs."""
    return "torch"


def register(**hooks):
    """A backend's replacements for the functions above, by name."""
    for name, fn in hooks.items():
        if name == "register" or not callable(globals().get(name)):
            raise KeyError(f"ops has no hook {name!r}")
        globals()[name] = fn
