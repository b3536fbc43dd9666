# The CPU fast path, entered through ops.py when this package is imported (eaglet.py does, as the loading code):
# kernels.cpp's bf16 kernels for attention over few queries, the draws, their random bits and the tree's top-k, the
# linears prepacked for oneDNN or the rows kernel (linears.py), and Inductor's CPU settings, --compile auto's
# measurement and compiled steps saved per machine (inductor.py). Off a CPU every hook keeps ops.py's own behaviour.
# Why each piece: docs/cpu.md.
import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

import ops
from cpu import hugepages, inductor, kernels, linears, threads
from draft import DraftHead
from model import FEW_QUERIES

PLAIN = {name: getattr(ops, name) for name in ("prepare", "inductor_settings", "step_compiler", "pacing", "random_bits",
                                             "keyed_bits", "live_width")}  # ops.py's own, off a CPU and as the fallbacks


def prepare(compile, target, *drafters):
    """ops.prepare on a CPU. A bf16 target's logits are fp32 sums where the rows kernel runs (linears.logits_in_fp32),
    compiled or not. compile True: every float linear prepacked (pack_linears), a draft head's in int8 codes (its
    outputs only rank drafts; the verify decides what is kept), the packed weights then on huge pages (hugepages.py);
    "max": the weights left for Inductor to freeze -> the options of graphs over them."""
    device = target.tok_embeddings.weight.device
    if device.type != "cpu":
        return PLAIN["prepare"](compile, target, *drafters)
    models = [m for m in (target, *drafters) if m is not None]
    if any(p.dtype == torch.bfloat16 for m in models for p in m.parameters()):
        kernels.build()  # attention's kernel serves frozen graphs too
    linears.logits_in_fp32(target)
    if compile == "max":
        return inductor.frozen_options(*models)
    if compile:
        linears.pack_linears(*models)
        for head in (m for m in models if isinstance(m, DraftHead)):
            linears.draft_head_in_int8(head)
    hugepages.gather([m for model in models for m in model.modules() if isinstance(m, linears.PackedLinear)])
    return None


def inductor_settings(device: torch.device, frozen) -> dict:
    return inductor.settings(frozen) if device.type == "cpu" else PLAIN["inductor_settings"](device, frozen)


def step_compiler(device: torch.device, frozen):
    return inductor.step_compiler(device, frozen) if device.type == "cpu" else PLAIN["step_compiler"](device, frozen)


def pacing(device: torch.device):
    return threads.pacing() if device.type == "cpu" else PLAIN["pacing"](device)


def lm_head_argmax(output, h: torch.Tensor, noise=None, rows=None):
    """ops.lm_head_argmax on a CPU: from the LM head's int8 screen where it has one (kernels.lm_head_argmax: the exact
    logits' token, few of them computed), for up to kernels.SCREEN_MAX_ROWS rows."""
    if linears.screens(output) and h.numel() <= kernels.SCREEN_MAX_ROWS * h.shape[-1]:
        return kernels.lm_head_argmax(output, h, 1.0, noise, rows)
    return None


def keyed_bits(keys: torch.Tensor, width: int) -> torch.Tensor:
    """ops.keyed_bits on a CPU: eaglet::random_bits, the same SplitMix64 counter in C++, for wide tables."""
    if kernels.BUILT and keys.device.type == "cpu" and width >= kernels.RANDOM_BITS_MIN:
        return torch.ops.eaglet.random_bits(keys, [width])
    return PLAIN["keyed_bits"](keys, width)


def live_width(last_slot: torch.Tensor, length: int) -> int:
    """ops.live_width on a CPU: the slots up to last_slot, the largest of a batch's (ops.batch_max); one graph for every
    width (an unbacked size when compiled)."""
    if last_slot.device.type != "cpu":
        return PLAIN["live_width"](last_slot, length)
    width = int(ops.batch_max(last_slot).item()) + 1
    torch._check(width >= 1)
    torch._check(width <= length)
    return width


def few_queries(q: torch.Tensor) -> bool:
    """ops.few_queries on a CPU: SDPA tiles over queries, slow when few (a verify's 16); attend_few up to
    model.FEW_QUERIES (statically_known_true: a graph for any number of rows, the prefill, keeps SDPA)."""
    return q.device.type == "cpu" and statically_known_true(q.shape[2] <= FEW_QUERIES)


def random_bits(shape, device) -> torch.Tensor:
    """ops.random_bits on a CPU: eaglet::random_bits for tables of kernels.RANDOM_BITS_MIN elements or more."""
    if kernels.BUILT and torch.device(device).type == "cpu" and torch.Size(shape).numel() >= kernels.RANDOM_BITS_MIN:
        return kernels.random_bits(shape, device)
    return PLAIN["random_bits"](shape, device)


ops.register(attends=kernels.attends, attend=kernels.attend, argmax=kernels.argmax, topk=kernels.topk,
             lm_head_argmax=lm_head_argmax, random_bits=random_bits, keyed_bits=keyed_bits, live_width=live_width,
             few_queries=few_queries, choose=inductor.choose, prepare=prepare,
             inductor_settings=inductor_settings, step_compiler=step_compiler, kernel_name=linears.packed_kernel,
             pacing=pacing, watch_load=threads.watch_load)
