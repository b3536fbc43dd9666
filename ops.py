# The seam between the algorithm and a backend: the few operations a backend may replace, and the hooks through which
# it readies the models and compiles the steps. What is here is plain torch and runs anywhere; cpu/ (imported by the
# loading code, eaglet.py) registers its kernels and its preparation with register(). The algorithm's files call
# these, never a kernel.
import contextlib

import torch
from torch import Tensor


def attends(q: Tensor) -> bool:
    """Whether attend serves these few queries (model.attend_few asks while tracing a compiled step)."""
    return False


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, tree_k: Tensor, tree_v: Tensor, scale: float) -> Tensor:
    raise NotImplementedError  # model.attend_few's fused loops, in one kernel


def argmax(logits: Tensor) -> Tensor:
    return torch.argmax(logits, dim=-1)


def topk(x: Tensor, k: int) -> tuple:
    return torch.topk(x, k, dim=-1)  # (values, indices) of each row's k largest, descending: the draft tree's choice


def random_bits(shape, device) -> Tensor:
    return torch.randint(0, 1 << 52, shape, dtype=torch.long, device=device)  # sampling.uniform's k: 52 random bits each


def lm_head_draw(output, h: Tensor, sampling, noise=None, rows=None) -> Tensor:
    """The target's draws from its LM head over h (a backend may skip most logits); noise: Gumbels, a row for each of
    h's rows, or the rows of a table that rows picks (a tree's nodes draw with their depth's)."""
    return sampling.draw(output(h), noise if noise is None or rows is None else noise[rows])


def choose(compile, target, log=print):
    """The CLI's --compile value -> the setting a Generator compiles with (True, or a backend's own, e.g. "max")."""
    return True if compile in ("auto", "packed") else compile


def prepare(compile, target, *drafters):
    """Readies the models' weights for decoding (compile: False or choose's answer), in place. -> None, or the Inductor
    options of graphs over these weights."""
    return None


def inductor_settings(device: torch.device, frozen) -> dict:
    return {"coordinate_descent_tuning": True} if device.type == "cuda" else {}  # CUDA: gpt-fast's


def step_compiler(device: torch.device, frozen):
    """None (steps compile at their first call, as torch.compile does) or a function (name, fn, args, dynamic, log, layered) ->
    (step, seconds compiling) that builds a step before the answer, or loads it from disk (cpu/inductor.precompiled)."""
    return None


@contextlib.contextmanager
def pacing(device: torch.device):
    """Around an answer's loop of steps: yields pace(), called before each step, through which a backend fits its
    threads to the load the machine is under (cpu/threads.py); the setting it had comes back after."""
    yield lambda: None


def watch_load():
    """-> a function that says whether other processes took cores this process's threads needed since watch_load was
    called (a few words saying so) or not (None): what is measured on a busy machine is not kept (cachedir.store)."""
    return lambda: None


def kernel_name(linear) -> str:
    return "torch"  # what runs this linear once prepared: part of the keys of measured costs


def register(**hooks):
    for name, fn in hooks.items():
        if name == "register" or not callable(globals().get(name)):
            raise KeyError(f"ops has no hook {name!r}")
        globals()[name] = fn
