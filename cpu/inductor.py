# How a CPU's steps are compiled: Inductor's settings for them, set in this one place (the vanilla step and every cycle
# share them), over weights prepacked for oneDNN or the rows kernel (cpu/linears.py) or, under --compile max, frozen
# for Inductor's GEMM templates; --compile auto takes whichever of the two measured faster on this CPU (choose). The
# packed steps are compiled once per machine and saved (precompiled, at the end of this file). Why: docs/cpu.md.
import contextlib
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn as nn
from torch._inductor.custom_graph_pass import CustomGraphPass

import atomic
import cachedir
import dtypes
import ops
import quant
import tp
import weights
from compiling import compiled
from cpu import kernels, linears
from errors import one_line
from model import KVCache, ModelArgs, Transformer, causal_mask
from progress import ticking

ROOT = Path(__file__).resolve().parents[1]

# cpp_wrapper calls the kernels from C++, no Python between them (the CPU's answer to CUDA graphs). The weights come
# prepacked (cpu/linears.py), not frozen: one copy for every graph, where each frozen graph holds its own. The GEMM
# templates (max_autotune) win on some CPUs and lose on others: see choose. The wrapper and the kernels build apart, in
# parallel: a cold step compiles in about two thirds of the time and runs as fast (docs/cpu.md). Without the wrapper's
# size, stride and alignment checks of the buffers between kernels (hundreds a cycle, each through the C shim, on shapes
# the trace fixed); the checks on data-dependent scalars and the kernels' bounds checks on gathered indices stay.
CPU_INDUCTOR = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True, "freezing": False, "max_autotune": False,
                "size_asserts": False, "alignment_asserts": False}
# --compile max: Inductor's C++ GEMM templates over frozen weights, for CPUs whose oneDNN GEMV is slow. The weights
# become graph constants, which Inductor's FX graph cache refuses as it comes (cache_frozen_graphs makes it store them).
CPU_INDUCTOR_MAX = CPU_INDUCTOR | {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
CACHE = "compile.json"
# Templates must win clearly: they cost minutes more to compile the first time, and GiB of FX graph cache.
MIN_GAIN = 1.2


def settings(frozen) -> dict:
    return CPU_INDUCTOR_MAX if frozen else CPU_INDUCTOR


def choose(compile, target, log=print):
    """compile "auto" (generate.py's and bench.py's --compile auto) -> True or "max": on a CPU "max" where a compiled
    one-row decode step of the target's shapes ran MIN_GAIN x faster under Inductor's GEMM templates than over the
    packed weights, measured once per machine, dtype and shapes and cached like the dtype; else True. A whole step, not
    its linears alone: the linears can time even where the step gains (docs/cpu.md), and the CPUs differ. A quantised
    target follows its activations' dtype: in bf16 the templates' int8 kernel can win as the float one does; in fp32
    it keeps packed, whose int8_rows_mm / int4_rows_mm kernels freezing turns off (quant.compiling_unfrozen).
    "packed" -> True; other values pass through."""
    weight = target.tok_embeddings.weight
    if compile != "auto":
        return True if compile == "packed" else compile
    quantised = any(isinstance(m, quant.QuantLinear) for m in target.modules())
    if weight.device.type != "cpu" or (quantised and weight.dtype == torch.float32):
        return True
    a = step_args(target.args, weight.element_size())
    kernel = "oneDNN" if quantised else linears.packed_kernel(target.layers[0].feed_forward.w13)  # QuantLinear is no RowsLinear
    key = f"{dtypes.cpu_name()} | torch {torch.__version__} | {weight.dtype} | dim {a.dim} ffn {a.intermediate_size} " \
          f"heads {a.n_head}/{a.n_local_heads}x{a.head_dim} vocab {a.vocab_size} layers {a.n_layer} | packed: {kernel}"
    entry = tp.from_rank0(cachedir.entry(CACHE, key, lambda e: e["choice"] in ("max", "packed")))  # tensor-parallel ranks must agree
    if entry is None:
        log(f"timing a compiled decode step with Inductor's GEMM templates and packed ({kernel}) on this CPU, "
            f"{weight.dtype} (once; a few minutes)")
        disturbed = ops.watch_load()
        try:
            with ticking("timing the decode step", log):
                entry = tp.from_rank0(measure_step(a, weight.dtype, rows_kernel=kernel != "oneDNN", codes=kernel.endswith("block codes")))
            entry["choice"] = "max" if entry["packed_ms"] > MIN_GAIN * entry["template_ms"] else "packed"
        except RuntimeError as e:  # a CPU where the templates do not compile: packed, and said once
            entry = {"choice": "packed", "packed_ms": None, "template_ms": str(e)}
        cachedir.store(CACHE, key, entry, disturbed())
        log(f"--compile: {entry['choice']} (a decode step: packed {entry['packed_ms']} ms, GEMM templates "
            f"{entry['template_ms']} ms; cached in {cachedir.root() / CACHE}; --compile max or packed overrides)")
    return "max" if entry["choice"] == "max" else True


def step_args(args, element_size: int, min_bytes: int = 128 << 20):
    """The target's ModelArgs cut to the layers whose weights, with the LM head's, hold min_bytes (four times a 32 MB
    L3: a decode step streams its weights from memory), or all of them."""
    layer = args.dim * (args.n_head + 2 * args.n_local_heads) * args.head_dim + args.n_head * args.head_dim * args.dim \
        + 3 * args.dim * args.intermediate_size
    head = args.vocab_size * args.dim
    return replace(args, n_layer=max(1, min(args.n_layer, math.ceil((min_bytes / element_size - head) / layer))))


def _decode(model, token, pos):
    return model(token, pos, pos, causal_mask(pos, model.max_seq_length))[0]


def measure_step(args, dtype, rows_kernel: bool = True, codes: bool = False) -> dict:
    """A one-row decode step of a Transformer(args) with random weights, compiled with the GEMM templates and
    packed (as a Generator compiles its steps, the FX graph cache left out): {"template_ms", "packed_ms"}. Timed in a
    child process, the templates first: once a model is packed for oneDNN, Inductor lowers its linear as a plain call
    for the rest of the process (linears.lower_packed_linear_as_a_call), so a frozen graph compiled after it would run
    oneDNN too. rows_kernel=False: packed over oneDNN even where the rows kernel runs (a quantised target's linears
    are its own). codes: the random weights made GGUF blocks, as the target's are, so packed reads them as codes."""
    dtype = str(dtype).removeprefix("torch.")
    child = [sys.executable, "-c", "import sys; from cpu import inductor; inductor.time_steps(*sys.argv[1:])", json.dumps(asdict(args)),
             dtype, "codes" * codes]
    env = os.environ | ({} if rows_kernel else {"EAGLET_KERNELS": "0"})
    run = subprocess.run(child, cwd=ROOT, capture_output=True, text=True, env=env)
    if run.returncode:
        raise RuntimeError(f"timing the decode step failed: {run.stderr.strip().splitlines()[-1:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


@torch.no_grad()  # freezing wants it
def time_steps(args: str, dtype: str, codes: str = "", reps: int = 20, slots: int = 256):
    """measure_step's child: prints the two times as JSON, the least disturbed of reps, the two taking turns."""
    runs = {}
    for name, setting in (("template_ms", "max"), ("packed_ms", True)):
        torch.manual_seed(0)
        model = Transformer(ModelArgs(**json.loads(args))).to(getattr(torch, dtype)).eval()
        if codes:
            as_q8_0_blocks(model)
        model.setup_caches(slots)
        step = compiled(_decode, "cpu", ops.prepare(setting, model))
        with torch._inductor.config.patch(fx_graph_cache=False):
            step(model, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))  # compiles (and autotunes)
        runs[name] = (step, model)
    best = dict.fromkeys(runs, float("inf"))
    for i in range(reps):
        token, pos = torch.full((1, 1), i + 1), torch.full((1,), i + 1)
        for name, (step, model) in runs.items():
            t0 = time.perf_counter()
            step(model, token, pos)
            best[name] = min(best[name], time.perf_counter() - t0)
    print(json.dumps({name: round(1000 * t, 3) for name, t in best.items()}))


def as_q8_0_blocks(model: nn.Module):
    """Every linear's weight, in place, as a Q8_0 GGUF dequantises it: per 32 inputs an fp16 scale times int8 codes."""
    for linear in (m for m in model.modules() if isinstance(m, nn.Linear) and m.in_features % 32 == 0):
        w = linear.weight.data.view(linear.out_features, -1, 32)
        scale = (w.abs().amax(-1, keepdim=True) / 127).half().float().clamp(min=2 ** -14)
        w.copy_(torch.round(w / scale).clamp(-127, 127) * scale)


def frozen_options(*models) -> dict:
    """The Inductor options of graphs over these models' frozen weights (--compile max), cached on disk like the rest."""
    cache_frozen_graphs()
    return {"post_grad_custom_pre_pass": FrozenWeights(*models)}


class FrozenWeights(CustomGraphPass):
    """A graph pass that does nothing; its uuid, a digest of the weights the graphs freeze, is part of the FX graph
    cache key. Inductor keys frozen weights by shape and dtype alone (fetching them from the live module on a hit),
    but stores the GEMM templates' repacked copies in the cache entry: without the digest, a checkpoint of the same
    shapes would run on another's weights. The KV caches, which the steps write, are not weights."""

    def __init__(self, *models):
        def frozen(model):
            caches = {id(b) for m in model.modules() if isinstance(m, KVCache) for b in m.buffers()}
            return [(name, t) for name, t in itertools.chain(model.named_parameters(), model.named_buffers()) if id(t) not in caches]

        self.digest = weights.digest(pair for model in filter(None, models) for pair in frozen(model))

    def __call__(self, graph):
        pass

    def uuid(self) -> str:
        return self.digest


def _ident(x):
    return x


def cache_frozen_graphs():
    """Lets Inductor's FX graph cache store graphs over frozen weights. Its weight-pack pass turns each frozen linear
    weight into an MKL/oneDNN tensor before the cache computes its key, and the cache refuses such tensors ("mkldnn
    tensors unpickleable"; every process compiled for minutes again), though a frozen tensor's value never enters
    the key and comes from the live graph on a hit. So they are keyed by shape and dtype, as every other frozen
    weight; FrozenWeights keys the values. Private API of torch 2.13 (requirements.txt): where it is missing,
    graphs go uncached as before."""
    import torch._inductor.codecache as cc
    from torch._inductor.freezing_utils import is_frozen_param

    validator, pickler = getattr(cc, "CacheabilityValidator", None), getattr(cc, "FxGraphCachePickler", None)
    if not hasattr(validator, "check_tensor") or not hasattr(pickler, "_reduce_tensor") or hasattr(pickler, "eaglet"):
        return
    check, reduce = validator.check_tensor, pickler._reduce_tensor

    def check_tensor(t):
        if not (t.is_mkldnn and is_frozen_param(t)):
            check(t)

    def reduce_tensor(self, t):
        if t.is_mkldnn and is_frozen_param(t):
            return _ident, (("frozen mkldnn", tuple(t.shape), str(t.dtype)),)
        return reduce(self, t)

    validator.check_tensor, pickler._reduce_tensor, pickler.eaglet = staticmethod(check_tensor), reduce_tensor, True



# ---------------------------------------------------------------- compiled steps saved to disk
# A step is traced and code-generated once per machine, model shape, tree and sampling rule; the next process loads
# the result (torch's precompile: Dynamo's bytecode and Inductor's code in one file) in a second instead of compiling
# it again for minutes. Dynamo's guards, which would re-check every input on every call, are left out of the package:
# the file's key names everything they would have checked (every tensor's shape, dtype and layout, every Python value
# the trace read off the modules, the tree, the sampling rule, this project's source, torch and the CPU), so a package
# is only ever found for inputs it was built for. A package that cannot be read, or whose key disagrees with its
# name, is said in one line and built again.
PACKAGES = "compiled"


def packages_enabled() -> bool:
    """EAGLET_PACKAGES=0 compiles a CPU's steps lazily at their first call instead, as torch.compile does."""
    return os.environ.get("EAGLET_PACKAGES", "1") != "0"


def step_compiler(device: torch.device, frozen):
    """ops.step_compiler: a CPU's packed steps are precompiled (frozen ones, --compile max's, cannot be in torch 2.13)."""
    return precompiled if device.type == "cpu" and frozen is None and packages_enabled() else None


def describe(x) -> str:
    """What a traced step reads off one argument, as text: a module's classes, plain attributes and tensors."""
    if isinstance(x, torch.nn.Module):
        lines = []
        for name, m in x.named_modules():
            plain = {k: v for k, v in vars(m).items() if not k.startswith("_") and is_plain(v)}
            tensors = {k: tensor_meta(t) for k, t in itertools.chain(m._parameters.items(), m._buffers.items())}
            lines.append(f"{name}: {type(m).__module__}.{type(m).__qualname__} {sorted(plain.items())} {sorted(tensors.items())}")
        return "\n".join(lines)
    return tensor_meta(x) if isinstance(x, torch.Tensor) else repr(x)


def is_plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (isinstance(v, tuple) and all(map(is_plain, v))) \
        or dataclasses.is_dataclass(v) and not isinstance(v, type)


def tensor_meta(t) -> str:
    if t is None:
        return "None"
    stride = "" if t.layout != torch.strided else f" stride {t.stride()}"
    marked = sorted(getattr(t, "_dynamo_dynamic_indices", ()))  # torch._dynamo.mark_dynamic's dims
    return f"{tuple(t.shape)} {t.dtype} {t.layout} {t.device.type}{stride}" + (f" dynamic {marked}" if marked else "")


@functools.cache
def machine() -> str:
    """The machine's side of a package key: torch, Python, the CPU and its instruction sets, threads."""
    flags = next((line.split(":", 1)[1].split() for line in dtypes.cpuinfo() if line.startswith("flags")), [])
    return f"torch {torch.__version__} | python {sys.version.split()[0]} | {dtypes.cpu_name()} | {' '.join(sorted(flags))} | " \
           f"threads {torch.get_num_threads()}"


@functools.cache
def source_digest() -> str:
    """This project's source, the root's and the CPU wing's: a step's code comes from any of it."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted([*ROOT.glob("*.py"), *ROOT.glob("cpu/*.py"), *ROOT.glob("cpu/*.cpp")]):
        h.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    return h.hexdigest()


def package_key(name: str, args: tuple, dynamic, layered: bool = False) -> str:
    # The settings precompiled's compile sets (compiling.compiled, frozen None), not the process's current ones: those
    # are Inductor's defaults until some graph compiles, so a process that loads every step would key them apart.
    # Whether the bf16 kernels are registered in this process decides what the trace calls (ops.attend, ops.argmax): a
    # step traced with them must not load where they are not (a process that never prepared a bf16 model).
    parts = [name, f"dynamic {dynamic} layered {layered}", machine(), source_digest(), repr(sorted(settings(None).items())),
             f"kernels {kernels.BUILT}"] + [describe(a) for a in args]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=20).hexdigest()


def keep_shape_guards(entries) -> list:
    """A dynamic step keeps the guards on its symbolic sizes (a prompt of one token is not one of many): the package
    key cannot name a size that changes from call to call."""
    return [e.guard_type == "SHAPE_ENV" for e in entries]


def precompiled(name: str, fn, args: tuple, dynamic=False, log=print, layered: bool = False) -> tuple:
    """fn compiled for args (a step of a Generator), loaded from this machine's package if there is one, else compiled
    now and saved. -> (callable, seconds spent compiling: 0 when loaded). dynamic: False, every size static; True,
    every size symbolic; None, the sizes marked dynamic (torch._dynamo.mark_dynamic). A step with symbolic sizes checks
    its size guards and runs eagerly on sizes outside them. layered: fn calls nested compile regions (model.hidden's
    run_layer), which only Inductor's Python wrapper calls: for a step that runs once an answer (the prefill), where
    Python between its kernels costs little."""
    folder = cachedir.root() / PACKAGES
    key = package_key(name, args, dynamic, layered)
    path = folder / f"{name}-{key}.pt2"
    step = load_package(path, key, fn, log)
    seconds = 0.0
    if step is None:
        t0 = time.perf_counter()
        log(f"compiling the {name.replace('_', ' ')} (once for this machine, model and tree; saved in {folder}) ...")
        guards = torch.compiler.skip_all_guards_unsafe if dynamic is False else keep_shape_guards
        # Inductor's oneDNN linear-add fusion fails inside a nested region (torch 2.13): over oneDNN's packed weights
        # the layers' graphs are inlined, one flat graph as for every other step.
        flat = layered and any(type(m) is linears.PackedLinear for a in args if isinstance(a, torch.nn.Module) for m in a.modules())
        options = {"guard_filter_fn": guards} | ({"cpp_wrapper": False} if layered and not flat else {})
        # Floats stay constants: a symbolic float makes the trace restart, which a precompile cannot do. Sizes are
        # dynamic only where marked (a batch's rows): automatic dynamic shapes, which go by source location, would make
        # a second tree's sizes symbolic.
        with torch.inference_mode(), torch._dynamo.config.patch(specialize_float=True, inline_invoke_subgraph=flat, automatic_dynamic_shapes=False), ticking(f"compiling the {name.replace('_', ' ')}", log):
            step = compiled(fn, "cpu", options=options, dynamic=dynamic).aot_compile((args, {}))
        seconds = time.perf_counter() - t0
        log(f"compiled the {name.replace('_', ' ')} in {seconds:.1f} s")
        save_package(step, path, key, log)
    if dynamic is False:
        return step, seconds
    return (lambda *a: step(*a) if step.guard_check(*a) else fn(*a)), seconds


def load_package(path: Path, key: str, fn, log):
    """The step saved at path, or None (no file; a damaged or mismatched one is said and removed)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log(f"warning: cannot read the compiled step {path} ({one_line(e)}): compiling it again")
        return None
    header, _, payload = data.partition(b"\n")
    try:
        if header.decode() != f"eaglet step {key}":
            raise ValueError("its key does not match its name")
        return torch.compiler.load_compiled_function(io.BytesIO(payload), f_globals=fn.__globals__)
    except Exception as e:  # noqa: BLE001  (a package is data from disk: whatever is wrong with it, it is rebuilt)
        log(f"warning: the compiled step {path} is damaged ({one_line(e)}): compiling it again")
        with contextlib.suppress(OSError):  # a read-only cache keeps it; the step is compiled all the same
            path.unlink()
        return None


def save_package(step, path: Path, key: str, log):
    """Written whole or not at all (atomic.py); a cache directory that takes no files is said in one line."""
    payload = f"eaglet step {key}\n".encode() + type(step).serialize(step).serialized_data
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write(path, lambda tmp: tmp.write_bytes(payload))
    except OSError as e:
        log(f"warning: cannot save the compiled step in {path.parent} ({one_line(e)}): the next run compiles it again")
