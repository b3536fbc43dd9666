# Tensor parallelism (Megatron style) for the target under torchrun: every rank holds a slice of each
# layer's attention heads and MLP channels, and one all-reduce after `wo` and one after `w2` make the
# layer outputs whole again. Embedding, norms and LM head stay replicated, so the post-norm features,
# the logits and the EAGLE head (which reads all three) are the same on every rank.
import functools
import os
import sys
import traceback
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

import interrupt

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def maybe_init_dist() -> Optional[int]:
    """Starts the process group when launched by torchrun with more than one rank; returns the rank,
    or None when there is no tensor parallelism."""
    if dist.is_initialized():
        return dist.get_rank() if dist.get_world_size() > 1 else None
    if int(os.environ.get("WORLD_SIZE", 1)) < 2 or "RANK" not in os.environ:
        return None
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return dist.get_rank()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    # RANK is set before the group exists, so ranks other than 0 stay quiet even about early errors.
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def from_rank0(obj):
    """rank 0's obj on every rank: choices made from timings (the draft tree's size) must agree."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def exit_with(main):
    """sys.exit(main()), except that under tensor parallelism every way out leaves together: after a
    status (success or a usage error, which every rank reaches alike) the ranks meet at a barrier, then
    each destroys the group and leaves with os._exit; after an exception a rank leaves at once (torchrun
    stops the others). Why: a live gloo group left to interpreter shutdown aborted a rank about one run
    in thirty ("terminate called without an active exception", SIGABRT): its C++ threads and store were
    torn down by static destructors while the peer rank still talked to them. Ctrl-C: interrupt.leave, one line and
    status 130 on every rank (no barrier: the others are interrupted too, or torchrun stops them). A stdout that cannot
    be written (its reader gone, a full disk): interrupt.leave_without_stdout, the same way."""
    interrupt.watch_stdout()
    try:
        status = main()
        if sys.stdout is not None:
            sys.stdout.flush()  # what main printed is written here, where a failure is still this function's to report
    except KeyboardInterrupt:
        interrupt.leave()
    except BaseException as e:
        if failed := interrupt.stdout_failed(e):
            interrupt.leave_without_stdout(failed)
        if not dist.is_initialized():
            raise
        traceback.print_exc()
        status, meet = 1, False
    else:
        meet = True
    if not dist.is_initialized():
        sys.exit(status)
    try:
        if meet and dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=120))  # names a rank that never arrives
        elif meet:
            dist.barrier()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        status = status or 1
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def check_shardable(model: nn.Module, world: int):
    """Raises a one-line ValueError unless every sharded size divides by the world size and every
    sharded weight is float or int8 with one scale per output channel."""
    args = model.args
    for name, size in (("n_head", args.n_head), ("n_local_heads", args.n_local_heads), ("intermediate_size", args.intermediate_size)):
        if size % world:
            raise ValueError(f"tensor parallelism over {world} ranks needs {name} divisible by {world}, got {size}")
    for layer in model.layers:
        a, f = layer.attention, layer.feed_forward
        for linear in (a.wqkv, a.wo, f.w13, f.w2):
            check_linear(linear)


def check_linear(linear: nn.Module):
    tensors = dict(linear.named_parameters(recurse=False)) | dict(linear.named_buffers(recurse=False))
    weight, scales = tensors.get("weight"), tensors.get("scales")
    if weight is not None and weight.dtype in FLOAT_DTYPES and set(tensors) == {"weight"}:
        return
    if weight is not None and weight.dtype == torch.int8 and set(tensors) == {"weight", "scales"} and scales.shape == weight.shape[:1]:
        return
    layout = ", ".join(f"{k} {tuple(t.shape)} {t.dtype}" for k, t in tensors.items())
    raise ValueError(f"tensor parallelism supports float and int8 (per-channel scales) weights, not {type(linear).__name__} ({layout})")


def shard(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    size = t.shape[dim] // world
    # A copy, not a view: a view would keep the whole tensor alive.
    return t.narrow(dim, rank * size, size).clone(memory_format=torch.contiguous_format)


def shard_linear(linear: nn.Module, dim: int, rank: int, world: int, parts=None):
    """dim 0 keeps this rank's output channels (column parallel), dim 1 its input channels (row
    parallel). parts: row counts of fused matrices (q, k, v) sharded one by one. int8 scales belong
    to output channels, so they follow a dim-0 split and stay whole under a dim-1 split."""
    parts = parts or [linear.weight.shape[0]]
    for name, t in list(linear.named_parameters(recurse=False)) + list(linear.named_buffers(recurse=False)):
        if dim == 1 and t.dim() == 1:
            continue
        if dim == 0:
            new = torch.cat([shard(p, 0, rank, world) for p in t.split(parts)])
        else:
            new = shard(t, dim, rank, world)
        if isinstance(t, nn.Parameter):
            new = nn.Parameter(new, requires_grad=t.requires_grad)
        setattr(linear, name, new)
    if hasattr(linear, "out_features"):
        linear.out_features, linear.in_features = linear.weight.shape


def all_reduce_output(group):
    # funcol, unlike the in-place dist.all_reduce, returns a new tensor that torch.compile traces
    # with fullgraph; eagerly it works as well.
    def hook(module, inputs, output):
        return funcol.all_reduce(output, "sum", group)

    return hook


@functools.cache
def batch_collectives():
    """vmap rules for the functional all-reduce and its wait, so batch.py's rows share one collective: vmap's
    fallback for them handed each rank back its own partial sums, unreduced (a batch gave wrong tokens)."""
    def rule(op):
        def run(info, in_dims, x, *args):
            return (op(x, *args), None) if in_dims[0] is None else (op(x.movedim(in_dims[0], 0), *args), 0)
        return run

    for name in ("all_reduce", "wait_tensor"):
        torch.library.register_vmap(f"_c10d_functional::{name}", rule(getattr(torch.ops._c10d_functional, name)))


def shard_model(model: nn.Module, rank: int, world: int) -> nn.Module:
    """Keeps this rank's slice of every layer's heads and MLP channels (no communication)."""
    for layer in model.layers:
        a, f = layer.attention, layer.feed_forward
        shard_linear(a.wqkv, 0, rank, world, [a.n_head * a.head_dim, a.n_kv * a.head_dim, a.n_kv * a.head_dim])
        shard_linear(a.wo, 1, rank, world)
        shard_linear(f.w13, 0, rank, world, [f.w13.weight.shape[0] // 2] * 2)
        shard_linear(f.w2, 1, rank, world)
        a.n_head, a.n_kv = a.n_head // world, a.n_kv // world
    return model


def apply_tp(model: nn.Module) -> nn.Module:
    """Shards a Transformer's attention and MLP over the process group in place (before its caches
    are set up: setup_caches sizes each KV cache from the attention's local head counts). At world
    size 1 it returns the model untouched: no copies, no hooks."""
    world = world_size()
    if world < 2:
        return model
    check_shardable(model, world)
    batch_collectives()
    shard_model(model, dist.get_rank(), world)
    for layer in model.layers:
        layer.attention.register_forward_hook(all_reduce_output(dist.group.WORLD))
        layer.feed_forward.register_forward_hook(all_reduce_output(dist.group.WORLD))
    return model
