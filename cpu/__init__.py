# The CPU fast path, entered through ops.py when this package is imported (eaglet.py does, as the loading code):
# kernels.cpp's bf16 kernels for attention over few queries, the draws, their random bits and the tree's top-k, the
# linears prepacked for oneDNN or the rows kernel (linears.py), and Inductor's CPU settings, --compile auto's
# measurement and compiled steps saved per machine (inductor.py). Off a CPU every hook keeps ops.py's own behaviour.
# Why each piece: docs/cpu.md.
import torch

import ops
from cpu import hugepages, inductor, kernels, linears, threads
from draft import DraftHead
from sampling import Sampling, uniform

PLAIN = {name: getattr(ops, name) for name in ("prepare", "inductor_settings", "step_compiler", "pacing", "random_bits",
                                             "lm_head_draw")}  # ops.py's own, off a CPU and as the fallbacks


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


def lm_head_draw(output, h: torch.Tensor, rule: Sampling, noise=None, rows=None) -> torch.Tensor:
    """ops.lm_head_draw on a CPU: a draw that is an argmax (greedy, or Gumbel noise without top-k or top-p) from the LM
    head's int8 screen where it has one, for up to kernels.SCREEN_MAX_ROWS rows (kernels.lm_head_argmax: the exact
    logits' token, few of them computed); a plain sample by eaglet::sample; else sampling's own draw."""
    t, plain = rule.temperature, not rule.top_k and rule.top_p >= 1.0
    few = h.numel() <= kernels.SCREEN_MAX_ROWS * h.shape[-1]
    if linears.screens(output) and few and (not t or (noise is not None and plain)):
        return kernels.lm_head_argmax(output, h, 1.0 / (t or 1.0), noise, rows if noise is not None else None)
    if not (t and plain and noise is None):
        return PLAIN["lm_head_draw"](output, h, rule, noise, rows)
    logits = output(h)
    return kernels.sample(logits, t, uniform(logits.shape[:-1], logits.device)) if kernels.serves(logits) else rule.draw(logits)


def random_bits(shape, device) -> torch.Tensor:
    """ops.random_bits on a CPU: eaglet::random_bits for tables of kernels.RANDOM_BITS_MIN elements or more."""
    if kernels.BUILT and torch.device(device).type == "cpu" and torch.Size(shape).numel() >= kernels.RANDOM_BITS_MIN:
        return kernels.random_bits(shape, device)
    return PLAIN["random_bits"](shape, device)


ops.register(attends=kernels.attends, attend=kernels.attend, argmax=kernels.argmax, topk=kernels.topk,
             lm_head_draw=lm_head_draw, random_bits=random_bits, choose=inductor.choose, prepare=prepare,
             inductor_settings=inductor_settings, step_compiler=step_compiler, kernel_name=linears.packed_kernel,
             pacing=pacing, watch_load=threads.watch_load)
