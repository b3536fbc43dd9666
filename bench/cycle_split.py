# Where a compiled cycle's time goes, part by part, beside each part's floor on this CPU (bench.py --split with
# --compile; a decode step's for vanilla). torch's profiler sees eaglet's kernels as torch ops with their shapes (every
# linear, attention, the draws, the tree's top-k) and Inductor's fused loops not at all: those, with the C++ wrapper
# between calls, are "other kernels"; what the Generator's Python loop adds between compiled calls (reading the
# committed tokens, building the next call) is "host", and the head's eager pass over each prompt before the first
# cycle, shared among the answer's cycles, "head prompt pass". A part's floor is the longer of its bytes at the rate eaglet's
# kernel streams the target's weights from memory here and its FLOPs at the rate the kernel reaches on a weight held
# in cache (AMX tiles where the CPU has them): what the part would cost if it only moved its data once and multiplied.
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from tokenizer import encode_prompt

PARTS = ("target linears", "target attention", "draws", "head linears", "head attention", "tree selection",
         "other kernels", "host", "head prompt pass")
TREE_OPS = ("topk", "sort", "cumsum")  # the draft tree's selection


def rates(target, reps: int = 5) -> dict:
    """The CPU's rates as eaglet's kernels reach them: GB/s streaming the target's weights once at one row (the decode
    step's linears, from memory), GFLOP/s at 16 rows over one layer's largest weight again and again (from cache)."""
    layers = [m for m in target.modules() if isinstance(m, torch.nn.Linear) and getattr(m, "packed", None) is not None]
    dtype = target.tok_embeddings.weight.dtype
    xs = {id(m): torch.randn(1, m.in_features, dtype=dtype) for m in layers}
    with torch.inference_mode():
        stream = min(seconds(lambda: [m(xs[id(m)]) for m in layers]) for _ in range(reps))
        big = max(layers[:-1] or layers, key=lambda m: m.weight.numel())
        x16, n = torch.randn(16, big.in_features, dtype=dtype), 50
        hot = min(seconds(lambda: [big(x16) for _ in range(n)]) for _ in range(reps)) / n
    return {"GB/s": sum(m.packed.numel() * m.packed.element_size() for m in layers) / stream / 1e9,  # packed: what is read
            "GFLOP/s": 2 * 16 * big.weight.numel() / hot / 1e9}


def timed(fn, total: list):
    """fn, its seconds added to total[0] at each call."""
    def run(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            total[0] += time.perf_counter() - t0
    return run


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rows_of(shape) -> int:
    n = 1
    for x in shape[:-1]:
        n *= x
    return n


def cost(name: str, shapes: list) -> tuple:
    """(bytes, FLOPs) an eaglet kernel call moves and computes, from its input shapes; (0, 0) for other ops."""
    if name.startswith("eaglet::rows_mm"):
        x, w = shapes[0], shapes[1]
        width = {"eaglet::rows_mm_int8": 2, "eaglet::rows_mm_codes": 1}.get(name, 4)  # bytes a packed element holds
        return w[0] * w[1] * w[2] * width, 2 * rows_of(x) * w[0] * 16 * x[-1]
    if name == "eaglet::lm_head_argmax":  # the LM head's int8 codes, 4 a word, and the draw (its exact rows are few)
        x, codes = shapes[0], shapes[1]
        return codes[0] * codes[1] * codes[2] * 4, 2 * rows_of(x) * codes[0] * 16 * x[-1]
    if name == "eaglet::attend":
        (b, h, t, d), k, kt = shapes[0], shapes[1], shapes[4]
        slots = k[2] + kt[2]
        return 2 * b * k[1] * slots * d * 2, 4 * b * h * t * slots * d
    if name in ("eaglet::argmax", "eaglet::sample"):
        return 4 * rows_of(shapes[0]) * shapes[0][-1], 0
    return 0, 0


def part(name: str, shapes: list, target_rows: int) -> str:
    """The part of a cycle an op belongs to ("" for none of them). target_rows: the rows of the target's pass (the
    verify's, or one for a decode step); a head's passes have other row counts (its context, its levels) and, compiled
    on a CPU, int8 weights. Where a head's pass has the verify's rows in fp32, it counts as the target's."""
    if name.startswith("eaglet::rows_mm"):
        return "target linears" if name != "eaglet::rows_mm_int8" and rows_of(shapes[0]) == target_rows else "head linears"
    if name == "eaglet::lm_head_argmax":
        return "target linears"  # its LM head, and the draw from it
    if name == "eaglet::attend":
        return "target attention" if shapes[0][2] == target_rows else "head attention"
    if name in ("eaglet::argmax", "eaglet::sample"):
        return "draws"
    return "tree selection" if any(op in name for op in TREE_OPS) else ""


def start(gen, prompt: list, sampling):
    """The prompt's prefill, then -> a function that runs one compiled cycle (or decode step) as Generator.answer
    calls it, nothing else."""
    gen.generate(prompt, 1, sampling, stop_ids=set())  # the state holds the prompt, its first token and the rule
    step = gen.step("cycle" if gen.spec else "plain", sampling.kind)
    args = (gen.target, gen.drafter, gen.state, gen.spec, sampling.kind)
    return lambda: step(*args).tolist()


@torch.inference_mode()
def split(gen, tokenizer, prompts: list, max_new_tokens: int, sampling) -> dict:
    """ms per cycle (a decode step for vanilla) of each part of gen's compiled steps over these prompts, and each part's
    floor. The cycles run three ways: as the Generator runs them (the whole), alone after each prompt's prefill (the
    compiled calls), and alone under the profiler (the parts; "other kernels" is what the compiled calls leave, so the
    profiler's own cost falls out)."""
    encoded = [encode_prompt(tokenizer, gen.target.args, [{"role": "user", "content": p}]) for p in prompts]
    gen.generate(encoded[0], max_new_tokens, sampling)  # built and warm
    whole, steps, begin = 0.0, 0, [0.0]
    if gen.spec:  # the head's pass over the prompt (Generator.start), between the prefill and the first cycle
        gen.start = timed(gen.start, begin)
    for p in encoded:
        r = gen.generate(p, max_new_tokens, sampling, stop_ids=set())
        whole += r.seconds - r.prefill_seconds  # the prefill's seconds hold the head's prompt pass (Generator.begin)
        steps += r.cycles if gen.spec else len(r.token_ids) - 1
    vars(gen).pop("start", None)
    per = max(steps // len(encoded), 1)
    n, alone, events = per * len(encoded), 0.0, []
    for p in encoded:
        step = start(gen, p, sampling)
        alone += seconds(lambda: [step() for _ in range(per)])
    for p in encoded:
        step = start(gen, p, sampling)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(per):
                step()
        events += [(e.name, e.input_shapes, e.cpu_time_total) for e in prof.events()]
    target_rows = gen.spec.verify_len if gen.spec else 1
    ms, work = defaultdict(float), defaultdict(lambda: [0, 0])
    for name, shapes, us in events:
        if where := part(name, shapes, target_rows):
            ms[where] += us / 1000 / n
            b, f = cost(name, shapes)
            work[where][0] += b / n
            work[where][1] += f / n
    ms["other kernels"] = max(0.0, 1000 * alone / n - sum(ms.values()))
    ms["host"] = max(0.0, 1000 * whole / steps - 1000 * alone / n)
    ms["head prompt pass"] = 1000 * begin[0] / steps
    r = rates(gen.target)
    floors = {k: max(b / r["GB/s"] / 1e6, f / r["GFLOP/s"] / 1e6) for k, (b, f) in work.items()}
    return {"per": "cycle" if gen.spec else "decode step", "steps": steps, "ms": round(1000 * (whole + begin[0]) / steps, 3),
            "rates": {k: round(v, 1) for k, v in r.items()},
            "parts": {k: {"ms": round(ms.get(k, 0.0), 3), "floor_ms": round(floors.get(k, 0.0), 3),
                          "MB": round(work[k][0] / 1e6, 2), "GFLOP": round(work[k][1] / 1e9, 3)} for k in PARTS}}


def table(result: dict) -> str:
    """The split as a text table: ms per part, its floor, and the bytes and FLOPs behind the floor."""
    lines = [f"{'part':18} {'ms':>7} {'floor ms':>9} {'MB':>8} {'GFLOP':>7}"]
    for k, v in result["parts"].items():
        lines.append(f"{k:18} {v['ms']:7.3f} {v['floor_ms']:9.3f} {v['MB']:8.2f} {v['GFLOP']:7.3f}")
    total = sum(v["ms"] for v in result["parts"].values())
    floor = sum(v["floor_ms"] for v in result["parts"].values())
    lines.append(f"{'a ' + result['per']:18} {total:7.3f} {floor:9.3f}   (at {result['rates']['GB/s']} GB/s, {result['rates']['GFLOP/s']} GFLOP/s)")
    return "\n".join(lines)
