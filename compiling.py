# How the steps are compiled: torch.compile with each device's Inductor settings, set in this one place, and the
# CPU's weights prepacked for oneDNN (quant.PackedLinear) or, under --compile max, frozen for Inductor's GEMM templates.
import types

import torch

import quant

# Inductor settings for CPU steps, the one place they are set (the vanilla step and every cycle share them), measured
# on a 2-core AMD EPYC (BENCHMARKS.md): cpp_wrapper calls the kernels from C++, no Python between them (the CPU's
# answer to CUDA graphs). The weights come prepacked for oneDNN (quant.PackedLinear), not frozen: Inductor's FX graph
# cache stores no frozen graph. max_autotune (CPP GEMM templates) measured slower at one row there: off by default.
CPU_INDUCTOR = {"cpp_wrapper": True, "freezing": False, "max_autotune": False}
# --compile max: Inductor's C++ GEMM templates over frozen weights, for CPUs whose oneDNN GEMV is slow. On a 2-core
# AMD EPYC without AVX-512 (Zen 3) oneDNN's one-row fp32 linears stream 10 GB/s of a 24 GB/s DRAM and the templates
# 17.7: the fp32 decode step 48.7 -> 29.3 ms (BENCHMARKS.md). The cost: the weights are graph constants, which the
# FX graph cache does not store, so every process compiles again (minutes; the C++ kernels are reused from disk).
CPU_INDUCTOR_MAX = CPU_INDUCTOR | {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
# CUDA: gpt-fast's setting; it tunes the fused int8 dequantise-and-GEMV kernels of quant.QuantLinear.
CUDA_INDUCTOR = {"coordinate_descent_tuning": True}


def compiled(fn, device=None, templates: bool = False, **kw):
    """torch.compile(fullgraph) with this device's Inductor settings (templates: CPU_INDUCTOR_MAX's). Compiled
    artefacts persist in Inductor's on-disk caches (FX graph and kernel caches), so a second process with the same
    model warms up faster."""
    torch._dynamo.config.use_recursive_dict_tags_for_guards = True  # skip unchanged modules' guards: 0.74 -> 0.29 ms a call
    torch._dynamo.config.capture_scalar_outputs = True  # model.live_width's .item() stays in the graph
    if device is not None:
        import torch._inductor.config as inductor_config

        # Global, not options=: every graph of the process shares them.
        cpu = CPU_INDUCTOR_MAX if templates else CPU_INDUCTOR
        for key, value in (cpu if torch.device(device).type == "cpu" else CUDA_INDUCTOR).items():
            setattr(inductor_config, key, value)
    # Dynamo keeps its cache and recompile budget (8 variants) per code object: each Generator's copy of a step has
    # its own, so many tree shapes in one process never share one budget. Its automatic dynamic shapes go by source
    # location instead, so shapes are static unless asked: a second tree would trace symbolic (SDPA, slow kernels).
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(own, fullgraph=True, **{"dynamic": False} | kw)


def prepare(compile, device, *models) -> bool:
    """Readies the models' weights for compile (True, or "max") on device. -> whether the steps use GEMM templates
    (--compile max on a CPU: CPU_INDUCTOR_MAX, weights left for freezing) rather than oneDNN-prepacked weights."""
    templates = compile == "max" and torch.device(device).type == "cpu"
    if not templates:
        quant.pack_linears(*models)
    return templates


def sizing_compile(target, head=None, compile=True):
    """How sizing.py compiles the passes it times: as the Generator compiles its steps (weights packed, or frozen
    under --compile max), with the number of rows dynamic so one graph serves every tree size."""
    device = target.tok_embeddings.weight.device
    templates = prepare(compile, device, target, head)
    compile_fn = lambda fn: compiled(fn, device, templates, dynamic=True, mode="reduce-overhead" if device.type == "cuda" else None)  # noqa: E731
    compile_fn.compile = compile  # part of sizing's cache key: --compile max's costs are its own
    return compile_fn
