# How the steps are compiled: torch.compile with each device's Inductor settings, set in this one place, and the
# CPU's weights prepacked for oneDNN (quant.PackedLinear) or, under --compile max, frozen for Inductor's GEMM templates.
import hashlib
import itertools
import types

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import quant
from model import KVCache

# Inductor settings for CPU steps, the one place they are set (the vanilla step and every cycle share them), measured
# on a 2-core AMD EPYC (BENCHMARKS.md): cpp_wrapper calls the kernels from C++, no Python between them (the CPU's
# answer to CUDA graphs). The weights come prepacked for oneDNN (quant.PackedLinear), not frozen: one copy for every
# graph, where each frozen graph holds its own. max_autotune (CPP GEMM templates) measured slower at one row there.
CPU_INDUCTOR = {"cpp_wrapper": True, "freezing": False, "max_autotune": False}
# --compile max: Inductor's C++ GEMM templates over frozen weights, for CPUs whose oneDNN GEMV is slow. On a 2-core
# AMD EPYC without AVX-512 (Zen 3) oneDNN's one-row fp32 linears stream 10 GB/s of a 24 GB/s DRAM and the templates
# 17.7: the fp32 decode step 48.7 -> 29.3 ms (BENCHMARKS.md); on a Zen 4 with AVX-512 BF16 the bf16 step 17.5 -> 10.4
# ms. The weights become graph constants, which Inductor's FX graph cache refuses as it comes (cache_frozen_graphs
# makes it store them).
CPU_INDUCTOR_MAX = CPU_INDUCTOR | {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
# CUDA: gpt-fast's setting; it tunes the fused int8 dequantise-and-GEMV kernels of quant.QuantLinear.
CUDA_INDUCTOR = {"coordinate_descent_tuning": True}


def compiled(fn, device=None, frozen=None, **kw):
    """torch.compile(fullgraph) with this device's Inductor settings (frozen, prepare's answer under --compile max:
    CPU_INDUCTOR_MAX's, keyed by the frozen weights). Compiled artefacts persist in Inductor's on-disk caches (FX
    graph and kernel caches), so a second process with the same model warms up faster."""
    torch._dynamo.config.use_recursive_dict_tags_for_guards = True  # skip unchanged modules' guards: 0.74 -> 0.29 ms a call
    torch._dynamo.config.capture_scalar_outputs = True  # model.live_width's .item() stays in the graph
    if device is not None:
        import torch._inductor.config as inductor_config

        # Global: every graph of the process shares them (options= below carries only a Generator's weight key).
        cpu = CPU_INDUCTOR_MAX if frozen else CPU_INDUCTOR
        for key, value in (cpu if torch.device(device).type == "cpu" else CUDA_INDUCTOR).items():
            setattr(inductor_config, key, value)
    # Dynamo keeps its cache and recompile budget (8 variants) per code object: each Generator's copy of a step has
    # its own, so many tree shapes in one process never share one budget. Its automatic dynamic shapes go by source
    # location instead, so shapes are static unless asked: a second tree would trace symbolic (SDPA, slow kernels).
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    # options= rather than the global config: each Generator's graphs carry the key of their own weights.
    return torch.compile(own, fullgraph=True, **{"dynamic": False, "options": frozen} | kw)


def prepare(compile, device, *models):
    """Readies the models' weights for compile (True, or "max") on device. -> None (the default settings: weights
    prepacked for oneDNN), or under --compile max on a CPU the Inductor options of graphs over these models' frozen
    weights (CPU_INDUCTOR_MAX, GEMM templates), cached on disk like the rest."""
    if compile == "max" and torch.device(device).type == "cpu":
        cache_frozen_graphs()
        return {"post_grad_custom_pre_pass": FrozenWeights(*models)}
    quant.pack_linears(*models)
    return None


class FrozenWeights(CustomGraphPass):
    """A graph pass that does nothing; its uuid, a digest of the weights the graphs freeze, is part of the FX graph
    cache key. Inductor keys frozen weights by shape and dtype alone (fetching them from the live module on a hit),
    but stores the GEMM templates' repacked copies in the cache entry: without the digest, a checkpoint of the same
    shapes would run on another's weights. The KV caches, which the steps write, are not weights."""

    def __init__(self, *models):
        h = hashlib.blake2b(digest_size=16)
        for model in filter(None, models):
            caches = {id(b) for m in model.modules() if isinstance(m, KVCache) for b in m.buffers()}
            for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
                if id(t) not in caches:
                    h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
                    h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        self.digest = h.hexdigest()

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


def sizing_compile(target, head=None, compile=True):
    """How sizing.py compiles the passes it times: as the Generator compiles its steps (weights packed, or frozen
    under --compile max), with the number of rows dynamic so one graph serves every tree size."""
    device = target.tok_embeddings.weight.device
    frozen = prepare(compile, device, target, head)
    compile_fn = lambda fn: compiled(fn, device, frozen, dynamic=True, mode="reduce-overhead" if device.type == "cuda" else None)  # noqa: E731
    compile_fn.compile = compile  # part of sizing's cache key: --compile max's costs are its own
    return compile_fn
