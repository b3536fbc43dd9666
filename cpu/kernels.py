# The CPU kernels of kernels.cpp (bf16 passes of few rows on AVX512-BF16, AMX tiles where the CPU has them) and of
# kernels_fp32.cpp (fp32 passes of few rows on AVX2): built on first use with torch.utils.cpp_extension, registered as
# torch ops (eaglet::rows_mm, attend, argmax, topk, sample, lm_head_argmax, random_bits; eaglet::rows_mm_fp32,
# rows_mm_codes) with shape functions for tracing and vmap rules for batch.py, and the weight layouts they read.
# cpu/__init__.py hands attend, argmax, topk, the target's draws (lm_head_argmax, sample) and random_bits to ops.py;
# cpu/linears.py runs the linears on rows_mm and keeps the LM head's screen.
import functools
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from errors import one_line
from progress import ticking

LANES = 16  # outputs a vector holds (fp32 accumulators)
BUILT = False  # the eaglet:: ops are registered (build() built them)
AMX = False  # the rows_mm ops run on AMX tiles (build() found them and Linux granted them)
AMX_MIN_ROWS = 3  # fewer rows keep vdpbf16ps: a compiled one-row decode step, its linears between vector code, ran slower on tiles
# lm_head_argmax for at most this many rows: its two 8-bit levels cost twice the bf16 head's tile multiplies, which
# past about 32 rows cost more than the bytes it saves (docs/cpu.md)
SCREEN_MAX_ROWS = 32
AMX_ATTEND_ROWS = 8  # attend on tiles from this many query rows a KV head (a tree verify's; a decode step's 3 stay on vectors)
SOURCE = Path(__file__).with_name("kernels.cpp")
SOURCE_FP32 = Path(__file__).with_name("kernels_fp32.cpp")


def cpu_flags() -> set:
    """The CPU's flags (/proc/cpuinfo), empty off x86-64 Linux or with EAGLET_KERNELS=0, which turns the kernels off
    (oneDNN and Inductor's code serve: for comparison, and cpu/inductor.choose's quantised targets)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") or os.environ.get("EAGLET_KERNELS") == "0":
        return set()
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def cpu_has_bf16_dot() -> bool:
    """AVX512-BF16 (vdpbf16ps) and AVX512-VNNI (vpdpbusd, which every CPU with the first has), read from the CPU's
    flags; elsewhere the kernels are never built."""
    return {"avx512_bf16", "avx512_vnni"} <= cpu_flags()


def cpu_has_fma() -> bool:
    """AVX2 with FMA, read from the CPU's flags: where kernels_fp32.cpp runs (every x86-64 CPU of the last decade)."""
    return {"avx2", "fma"} <= cpu_flags()


def cpu_has_amx() -> bool:
    """AMX tiles with bf16 and int8 (rows_mm's and lm_head_argmax's tile paths); EAGLET_AMX=0 keeps vdpbf16ps and
    vpdpbusd, for comparison."""
    return {"amx_tile", "amx_bf16", "amx_int8"} <= cpu_flags() and os.environ.get("EAGLET_AMX") != "0"


@functools.cache
def build() -> bool:
    """Builds the kernels once a process (g++ and ninja, about 30 s the first time; torch's extension cache keeps them;
    with AMX the linears' tile path too) and registers them. -> whether they run here: the CPU has AVX512-BF16 and
    they built. A failed build says why once, on stderr, and leaves oneDNN and Inductor's code to serve."""
    if not cpu_has_bf16_dot():
        return False
    from torch.utils.cpp_extension import load

    for amx in ([["-mamx-tile", "-mamx-bf16", "-mamx-int8", "-DEAGLET_AMX"]] if cpu_has_amx() else []) + [[]]:  # a compiler without AMX: vdpbf16ps
        try:
            with ticking("building the CPU kernels (once per machine)", functools.partial(print, file=sys.stderr)):
                load("eaglet_rows_mm" + "_amx" * bool(amx), sources=[str(SOURCE)], is_python_module=False,
                     extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mavx512dq", *amx],
                     extra_ldflags=["-fopenmp"])
            break
        except Exception as e:  # no compiler, no ninja: a slower path, not a failure
            error = e
            if amx:  # said, or a compiler without AMX (or an error in the tile code) slows every pass unseen
                print(f"eaglet: the AMX kernels did not build ({one_line(e)}); vdpbf16ps serves", file=sys.stderr)
    else:
        print(f"eaglet: the bf16 kernels did not build ({one_line(error)}); oneDNN serves", file=sys.stderr)
        return False
    global AMX
    AMX = bool(amx) and torch.ops.eaglet.amx_set(True, AMX_MIN_ROWS, AMX_ATTEND_ROWS)  # the kernel asks Linux for the tile state once
    for op, dtype in (("rows_mm", torch.bfloat16), ("rows_mm_f32", torch.float32), ("rows_mm_int8", torch.bfloat16)):
        torch.library.register_fake(f"eaglet::{op}")(lambda x, w, *_, dtype=dtype: x.new_empty(*x.shape[:-1], w.shape[0] * LANES, dtype=dtype))
        torch.library.register_vmap(f"eaglet::{op}")(functools.partial(batch_rule, getattr(torch.ops.eaglet, op)))
    torch.library.register_fake("eaglet::argmax")(lambda x: x.new_empty(x.shape[:-1], dtype=torch.long))
    torch.library.register_vmap("eaglet::argmax")(functools.partial(batch_rule, torch.ops.eaglet.argmax))
    torch.library.register_fake("eaglet::lm_head_argmax")(lambda x, *_: x.new_empty(x.shape[:-1], dtype=torch.long))
    torch.library.register_vmap("eaglet::lm_head_argmax")(lm_head_batch_rule)
    torch.library.register_fake("eaglet::topk")(lambda x, k: (x.new_empty(*x.shape[:-1], k),
                                                              x.new_empty(*x.shape[:-1], k, dtype=torch.long)))
    torch.library.register_vmap("eaglet::topk")(topk_batch_rule)
    torch.library.register_fake("eaglet::sample")(lambda x, *_: x.new_empty(x.shape[:-1], dtype=torch.long))
    torch.library.register_vmap("eaglet::sample")(sample_batch_rule)
    torch.library.register_fake("eaglet::random_bits")(lambda seed, shape: seed.new_empty(*seed.shape, *shape))
    torch.library.register_vmap("eaglet::random_bits")(random_bits_batch_rule)
    torch.library.register_fake("eaglet::attend")(attend_out)
    torch.library.register_vmap("eaglet::attend")(attend_batch_rule)
    global BUILT
    BUILT = True
    return True


@functools.cache
def build_fp32() -> bool:
    """Builds kernels_fp32.cpp once a process (AVX2 and FMA alone: no AVX-512 instruction can reach it) and registers
    eaglet::rows_mm_fp32 and rows_mm_codes. -> whether it runs here. A failed build says why once and leaves oneDNN to serve."""
    if not cpu_has_fma():
        return False
    from torch.utils.cpp_extension import load

    try:
        with ticking("building the CPU kernels (once per machine)", functools.partial(print, file=sys.stderr)):
            load("eaglet_rows_mm_fp32", sources=[str(SOURCE_FP32)], is_python_module=False,
                 extra_cflags=["-O3", "-fopenmp", "-mavx2", "-mfma"], extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no ninja: a slower path, not a failure
        print(f"eaglet: the fp32 kernel did not build ({one_line(e)}); oneDNN serves", file=sys.stderr)
        return False
    for op in ("rows_mm_fp32", "rows_mm_codes"):
        torch.library.register_fake(f"eaglet::{op}")(lambda x, w, *_: x.new_empty(*x.shape[:-1], w.shape[0] * LANES))
        torch.library.register_vmap(f"eaglet::{op}")(functools.partial(batch_rule, getattr(torch.ops.eaglet, op)))
    return True


def batch_rule(op, info, in_dims, x, *weight):
    """Under batch.py's vmap: leading dims are rows to the kernel, so the batch dim moves to the front, one call."""
    if any(d is not None for d in in_dims[1:]):
        raise NotImplementedError("eaglet::rows_mm batched over its weights")
    return op(x.movedim(in_dims[0], 0), *weight), 0


def to_front(x: Tensor, dim, n: int) -> Tensor:
    """x with its vmapped dim first; an unbatched x (dim None) expanded to the batch's n."""
    return x.expand(n, *x.shape) if dim is None else x.movedim(dim, 0)


def topk_batch_rule(info, in_dims, x, k):
    """Under batch.py's vmap: the batch dim to the front, one call."""
    return torch.ops.eaglet.topk(x.movedim(in_dims[0], 0), k), (0, 0)


def sample_batch_rule(info, in_dims, logits, u, inv_t):
    """Under batch.py's vmap: the logits' and uniforms' batch dims to the front, one call."""
    return torch.ops.eaglet.sample(*(to_front(x, d, info.batch_size) for x, d in zip((logits, u), in_dims)), inv_t), 0


def lm_head_batch_rule(info, in_dims, x, codes, w, stats, noise, noise_rows, inv_t):
    """Under batch.py's vmap: the rows' (and their noise's) batch dim to the front, one call; a batch's tables of noise
    rows stacked into one, each row's index moved to its own table's rows."""
    if any(d is not None for d in in_dims[1:4]):
        raise NotImplementedError("eaglet::lm_head_argmax batched over its weights")
    n = info.batch_size
    if noise.numel():
        noise = to_front(noise, in_dims[4], n)
    if noise.numel() and noise_rows.numel():
        rows = to_front(noise_rows, in_dims[5], n)
        rows = rows + noise.shape[1] * torch.arange(n, device=rows.device).view(n, *[1] * (rows.dim() - 1))
        noise_rows, noise = rows, noise.reshape(-1, noise.shape[-1])
    return torch.ops.eaglet.lm_head_argmax(to_front(x, in_dims[0], n), codes, w, stats, noise, noise_rows, inv_t), 0


def random_bits_batch_rule(info, in_dims, seed, shape):
    """Under batch.py's vmap (randomness "different": a seed a row): one call, a table a row."""
    return torch.ops.eaglet.random_bits(to_front(seed, in_dims[0], info.batch_size), shape), 0


def attend_batch_rule(info, in_dims, *args):
    """Under batch.py's vmap: the vmapped dim joins the batch dim (an unbatched input is expanded to it), one call."""
    def join(x, dim):
        x = to_front(x, dim, info.batch_size)
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    y = torch.ops.eaglet.attend(*(join(x, dim) for x, dim in zip(args[:6], in_dims)), args[6])
    return y.view(info.batch_size, -1, *y.shape[1:]), 0


def attend_out(q: Tensor, *_) -> Tensor:
    """eaglet::attend's output for q [B, H, T, D]: stored [B, T, H, D], so the output projection reads it as it is."""
    B, H, T, D = q.shape
    return q.new_empty(B, T, H, D).transpose(1, 2)


def attends(q: Tensor) -> bool:
    """Whether eaglet::attend serves these queries (ops.attends; asked while tracing: a flag, not a build)."""
    return BUILT and q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[-1] in (32, 64, 128, 256)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, tree_k: Tensor, tree_v: Tensor, scale: float) -> Tensor:
    """ops.attend by eaglet::attend (callers ask attends first)."""
    return torch.ops.eaglet.attend(q, k, v, mask, tree_k, tree_v, scale)


def serves(logits: Tensor) -> bool:
    """Whether eaglet::argmax and eaglet::sample serve these logits (fp32 on a CPU with the kernels)."""
    return BUILT and logits.dtype == torch.float32 and logits.device.type == "cpu"


def argmax(logits: Tensor) -> Tensor:
    """torch.argmax(logits, -1), through eaglet::argmax where it serves."""
    return torch.ops.eaglet.argmax(logits) if serves(logits) else torch.argmax(logits, dim=-1)


TOPK_MAX = 16  # eaglet::topk inserts into a sorted list of k: a tree's k per node is at most this
TOPK_MIN_ROW = 128  # shorter rows (a level's pool of candidates) cost torch's topk no more than the kernel's call


def topk(x: Tensor, k: int) -> tuple:
    """torch.topk(x, k, dim=-1) (values, indices), through eaglet::topk for rows of a vocabulary (ties: the lower index
    first)."""
    if serves(x) and x.dim() >= 1 and x.shape[-1] >= TOPK_MIN_ROW and 1 <= k <= TOPK_MAX:
        return torch.ops.eaglet.topk(x, k)
    return torch.topk(x, k, dim=-1)


def sample(logits: Tensor, temperature: float, u: Tensor) -> Tensor:
    """One draw per row of softmax(logits / temperature) by eaglet::sample (callers ask serves first): sampling.sample's
    inverse CDF, one float64 uniform a row in (0, 1) (sampling.uniform), the softmax's exponentials in C++ and never a
    probability tensor."""
    assert u.dtype == torch.float64 and u.shape == logits.shape[:-1]
    return torch.ops.eaglet.sample(logits, u, 1.0 / temperature)


RANDOM_BITS_MIN = 4096  # from this many elements (a sampled cycle's Gumbels): fewer cost Inductor's randint no more


def random_bits(shape, device) -> Tensor:
    """torch.randint(0, 2^52, shape) in distribution, by eaglet::random_bits (callers ask BUILT): SplitMix64 over a
    counter from one 62-bit seed of torch's generator."""
    seed = torch.randint(0, 1 << 62, (), dtype=torch.long, device=device)
    return torch.ops.eaglet.random_bits(seed, list(shape))


def pack(weight: Tensor) -> Tensor:
    """bf16 [out, in] -> int32 [out/16, in/2, 16]: element (b, p, i) holds weight[16b + i, 2p : 2p + 2]."""
    out_features, in_features = weight.shape
    return weight.reshape(out_features // LANES, LANES, in_features // 2, 2).transpose(1, 2).contiguous() \
        .view(torch.int32).view(out_features // LANES, in_features // 2, LANES)


def pack_int8(codes: Tensor) -> Tensor:
    """int8 codes [out, in] -> int16 [out/16, in/2, 16]: pack's layout, each pair of codes in 2 bytes instead of 4."""
    out_features, in_features = codes.shape
    return codes.reshape(out_features // LANES, LANES, in_features // 2, 2).transpose(1, 2).contiguous() \
        .view(torch.int16).view(out_features // LANES, in_features // 2, LANES)


def screens(linear: nn.Module) -> bool:
    """Whether eaglet::lm_head_argmax serves draws from this LM head: bf16 rows packed for rows_mm (its exact
    logits), a vocabulary of whole 32s (the kernel takes two blocks of 16 at a time), on a CPU with the kernels."""
    w = linear.weight
    return BUILT and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.shape[0] % (2 * LANES) == 0 and w.shape[1] % 4 == 0


def screen_codes(weight: Tensor) -> tuple:
    """bf16 [V, K] -> lm_head_argmax's int8 codes and per-row stats: codes int32 [V/16, K/4, 16], word (b, p, i) the
    codes of weight[16b + i, 4p : 4p + 4] (vpdpbusd's and the int8 B tile's layout); stats fp32 [4, V]: each row's
    scale sw (codes ~ weight / sw, |code| <= 127), its codes' sum C, and the bound's factors kx = max|w - sw code| +
    (K + 16) 2^-24 max|w| (the estimate's weight error, the exact fp32 sum's rounding and the kernel's own, per unit of
    ||x||_1) and kq = sw sum|code| (per unit of max|x - x^|), both rounded up (kernels.cpp's lm_head_argmax)."""
    V, K = weight.shape
    w = weight.double()
    top = w.abs().amax(1)
    sw = torch.where(top > 0, top / 127, torch.ones_like(top)).float().double()  # the fp32 scale the kernel multiplies by
    codes = torch.round(w / sw[:, None]).clamp(-127, 127)
    kx = (w - codes * sw[:, None]).abs().amax(1) + (K + 16) * 2.0 ** -24 * top
    kq = sw * codes.abs().sum(1)
    stats = torch.stack([sw, codes.sum(1), round_up_fp32(kx), round_up_fp32(kq)]).float().contiguous()
    packed = codes.to(torch.int8).reshape(V // LANES, LANES, K // 4, 4).transpose(1, 2).contiguous()
    return packed.view(torch.int32).view(V // LANES, K // 4, LANES), stats


def round_up_fp32(x: Tensor) -> Tensor:
    """fp64 -> the fp32 values at or above it."""
    f = x.float()
    return torch.where(f.double() < x, torch.nextafter(f, torch.full_like(f, float("inf"))), f).double()


def lm_head_argmax(linear: nn.Module, h: Tensor, inv_t: float = 1.0, noise=None, rows=None) -> Tensor:
    """argmax(linear(h) * inv_t + noise) over the last dim (noise: fp64 Gumbels like it, or rows of them that rows
    [...] picks for each of h's rows, or None at T=0) by eaglet::lm_head_argmax from linear's screen
    (cpu/linears.py), the logits those of one row through rows_mm_f32."""
    noise = h.new_empty(0, dtype=torch.float64) if noise is None else noise
    rows = h.new_empty(0, dtype=torch.long) if rows is None else rows
    return torch.ops.eaglet.lm_head_argmax(h, linear.codes, linear.packed, linear.stats, noise, rows, inv_t)


def pack_fp32(weight: Tensor) -> Tensor:
    """[out, in] -> [out/16, in, 16] (fp32 weights, or block_codes' codes): element (b, k, i) holds weight[16b + i, k]."""
    out_features, in_features = weight.shape
    return weight.reshape(out_features // LANES, LANES, in_features).transpose(1, 2).contiguous()


def block_codes(weight: Tensor):
    """fp32 [out, in] -> kernels_fp32.cpp's codes for rows_mm_codes (pack_codes' layout), if the weight has them (a
    checkpoint converted from a llama.cpp Q4_1 or Q8_0 GGUF: every 32 inputs' weights are scale * code + offset, bit
    for bit), else None. Callers ask build_fp32 first."""
    codes, dm = torch.ops.eaglet.block_codes(weight.detach())
    return None if not codes.numel() else pack_codes(codes, dm)


def pack_codes(codes: Tensor, dm: Tensor) -> tuple:
    """int8 codes [out, in] and scales and offsets [out, in/32, 2] -> rows_mm_codes' [out/16, in, 16] (pack_fp32's
    layout) and [out/16, in/32, 2, 16]."""
    out_features, groups, _ = dm.shape
    return pack_fp32(codes), dm.reshape(out_features // LANES, LANES, groups, 2).permute(0, 2, 3, 1).contiguous()


def fits(linear: nn.Linear) -> bool:
    """Whether a rows kernel serves this linear: bf16 by rows_mm (AVX512-BF16), fp32 by rows_mm_fp32 (AVX2)."""
    w = linear.weight
    if w.device.type != "cpu" or w.shape[0] % LANES:
        return False
    if w.dtype == torch.bfloat16:
        return w.shape[1] % 2 == 0 and build()
    return w.dtype == torch.float32 and build_fp32()
