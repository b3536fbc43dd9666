# How a step is compiled: torch.compile(fullgraph) with the device's Inductor settings, set in this one place (a
# backend's, ops.inductor_settings), its own code object per Generator, shapes static unless asked.
import time
import types

import torch

import ops

COMPILE_CHOICES = ("auto", "max", "packed")  # the CLI's --compile values (packed: True; max and auto: a CPU's, cpu/inductor.py)


def compiled(fn, device=None, frozen=None, **kw):
    """torch.compile(fullgraph) with this device's Inductor settings (frozen: ops.prepare's answer, e.g. the options of
    graphs over frozen weights). Compiled artefacts persist in Inductor's on-disk caches (FX graph and kernel caches),
    so a second process with the same model warms up faster."""
    torch._dynamo.config.use_recursive_dict_tags_for_guards = True  # skip unchanged modules' guards: far fewer checks a call
    torch._dynamo.config.capture_scalar_outputs = True  # model.live_width's .item() stays in the graph
    if device is not None:
        import torch._inductor.config as inductor_config

        # Global: every graph of the process shares them (options= below carries only a Generator's weight key).
        for key, value in ops.inductor_settings(torch.device(device), frozen).items():
            setattr(inductor_config, key, value)
    # Dynamo keeps its cache and recompile budget (8 variants) per code object: each Generator's copy of a step has
    # its own, so many tree shapes in one process never share one budget. Its automatic dynamic shapes go by source
    # location instead, so shapes are static unless asked: a second tree would trace symbolic (SDPA, slow kernels).
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    # options= rather than the global config: each Generator's graphs carry the key of their own weights.
    return torch.compile(own, fullgraph=True, **{"dynamic": False, "options": frozen} | kw)


def sizing_compile(target, head=None, compile=True):
    """How sizing.py compiles the passes it times: as the Generator compiles its steps (weights packed, or frozen
    under --compile max; on a CPU precompiled and saved), the sizes sizing marks dynamic symbolic so one graph serves
    many tree sizes. -> fn -> a callable compiled at its first call."""
    device = target.tok_embeddings.weight.device
    frozen = ops.prepare(compile, target, head)
    precompile = ops.step_compiler(device, frozen)

    def compile_fn(fn):
        if precompile is None:
            return compiled(fn, device, frozen, dynamic=None, mode="reduce-overhead" if device.type == "cuda" else None)
        step = None

        def run(*args):
            nonlocal step
            if step is None:  # sizing says how long it runs; a package's own lines would interleave with its
                step, _ = precompile(f"sizing{fn.__name__}", fn, args, None, lambda *_: None)
            return step(*args)
        return run
    compile_fn.compile = compile  # part of sizing's cache key: --compile max's costs are its own
    return compile_fn


def faster(step, eager, args: tuple, log, reps: int = 3):
    """step (compiled) unless its eager code ran faster on this machine -> the one to run. Timed the least of reps
    turns each, on the threads the machine's load leaves (ops.pacing): a compiled step is never chosen where it loses."""
    best = [float("inf")] * 2
    with ops.pacing(args[0].tok_embeddings.weight.device) as pace:
        for i in [0, 1] * reps:
            pace()
            t0 = time.perf_counter()
            (step, eager)[i](*args).tolist()
            best[i] = min(best[i], time.perf_counter() - t0)
    if best[0] <= best[1]:
        return step
    log(f"warning: the compiled {eager.__name__} ran slower than its eager code on this machine "
        f"({1000 * best[0]:.1f} against {1000 * best[1]:.1f} ms a call): it runs eagerly")
    return eager
