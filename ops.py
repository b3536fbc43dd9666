# The seam between the algorithm and a backend: the few operations a backend may replace, and the hooks through which
# it readies the models and compiles the steps. What is here is plain torch and runs anywhere; cpu/ (imported by the
# loading code, eaglet.py) registers its kernels and its preparation with register(). The algorithm's files call
# these, never a kernel.
import contextlib

import torch
import torch.nn.functional as F
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


GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # SplitMix64's constants as int64 (two's complement)
MIX = (0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64))


def shift_right(z: Tensor, s: int) -> Tensor:
    return (z >> s) & ((1 << (64 - s)) - 1)  # logical: int64's >> keeps the sign


def splitmix64(z: Tensor) -> Tensor:
    """SplitMix64's finaliser over int64 tensors taken as unsigned 64-bit words (products wrap)."""
    z = (z ^ shift_right(z, 30)) * MIX[0]
    z = (z ^ shift_right(z, 27)) * MIX[1]
    return z ^ shift_right(z, 31)


def keyed_bits(keys: Tensor, width: int) -> Tensor:
    """[..., width] int64 of 52 random bits, each row a function of its key alone: SplitMix64 of a counter from it
    (a backend's kernel gives the same bits)."""
    base = splitmix64(keys) + GOLDEN
    return shift_right(splitmix64(base.unsqueeze(-1) + torch.arange(width, device=keys.device) * GOLDEN), 12)


def cat(parts: list, dim: int = 0) -> Tensor:
    """torch.cat(parts, dim); compiled, as zero-padded parts summed: under torch.vmap with a dynamic batch dim (batch.py's
    steps, one graph for every number of rows) torch.cat's batching rule fixes the batch size, pads do not."""
    if len(parts) == 1 or not torch.compiler.is_compiling():
        return torch.cat(parts, dim)
    total, at, out = sum(p.shape[dim] for p in parts), 0, None
    for p in parts:
        d = dim % p.dim()
        q = F.pad(p, [0, 0] * (p.dim() - 1 - d) + [at, total - at - p.shape[d]])
        out = q if out is None else out | q if p.dtype == torch.bool else out + q
        at += p.shape[d]
    return out


def lm_head_argmax(output, h: Tensor, noise=None, rows=None):
    """argmax(output(h) + noise) (noise: None, a row for each of h's rows, or the rows of a table that rows picks) by a
    backend that reads less than the whole LM head (cpu/: its int8 screen), or None where none serves."""
    return None


def live_width(last_slot: Tensor, length: int) -> int:
    """Cache slots a pass reads, of length: all of them here (a GPU's CUDA graphs replay fixed shapes); a CPU reads up to
    last_slot, where attention costs what it reads (cpu/__init__.py), the largest of a batch's rows under torch.vmap."""
    return length


def few_queries(q: Tensor) -> bool:
    """Whether attention over a KV cache takes model.attend_few for these queries [B, H, T, D] instead of SDPA."""
    return False


@torch.library.custom_op("eaglet::batch_max", mutates_args=())
def batch_max(x: Tensor) -> Tensor:
    """x itself; under torch.vmap (batch.py) the largest of x over the rows, unbatched: what every row's pass must read."""
    return x.clone()


batch_max.register_fake(lambda x: torch.empty_like(x))
torch.library.register_vmap("eaglet::batch_max")(lambda info, in_dims, x: (x if in_dims[0] is None else x.amax(in_dims[0]), None))


@torch.library.custom_op("eaglet::argmax_scores", mutates_args=())
def argmax_scores(scores: Tensor) -> Tensor:
    """torch.argmax(scores, -1) of a sampled draw's float64 scores, as an op Inductor does not fuse: its vectorised argmax
    over a fused float32 + float64 sum picks wrong indices (torch 2.13, C++ backend); over stored scores it is exact."""
    return torch.argmax(scores, dim=-1)


argmax_scores.register_fake(lambda x: x.new_empty(x.shape[:-1], dtype=torch.long))
torch.library.register_vmap("eaglet::argmax_scores")(lambda info, in_dims, x: (argmax_scores(x.movedim(in_dims[0], 0) if in_dims[0] is not None else x), 0 if in_dims[0] is not None else None))


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
