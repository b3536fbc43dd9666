# The cost of sampling's float64 noise in isolation: the cycle's Gumbels [depth+1, V], the old float32 ones
# (-log(-log(torch.rand))) against sampling.gumbel's float64 ones (from 52-bit random integers), eager and compiled;
# and the verify's draw, argmax(logits / T + noise[depths]) over m+1 rows, with each noise (float32 logits plus float64
# Gumbels compare in float64: torch.argmax instead of the fp32 argmax kernel).
#
#   python bench/noise_cost.py                 # eager, the process's threads
#   python bench/noise_cost.py --threads 1 --compile
import sys
from pathlib import Path

if not __package__:  # run as a script (python bench/bench.py): the project's root, not this folder, is the import root
    sys.path[0] = str(Path(__file__).resolve().parents[1])
import argparse
import time
import types

import torch  # noqa: E402

from cpu import kernels  # noqa: E402
import sampling  # noqa: E402
from bench.float32_noise import gumbel32  # noqa: E402


def own(fn):
    """fn as its own code object: Dynamo's cache (8 graphs) is per code object."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


TRIALS = 15


def ms(fn, reps: int) -> float:
    """The fastest of TRIALS timings of reps calls each, per call: a shared machine's contention only ever adds time."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(TRIALS):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t) / reps * 1e3)
    return min(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--trials", type=int, default=15, help="timings of --reps calls each; the fastest counts")
    p.add_argument("--noise-only", action="store_true", help="skip the verify draw's timings")
    opts = p.parse_args()
    global TRIALS
    TRIALS = opts.trials
    if opts.threads:
        torch.set_num_threads(opts.threads)
    kernels.build()  # the fp32 argmax kernel, where this CPU runs it
    print(f"threads {torch.get_num_threads()}, vocab {opts.vocab}, CPU kernels {kernels.BUILT}")
    kinds = {"float32": gumbel32, "float64": sampling.gumbel}
    print("noise [depth+1, V], ms:       " + "".join(f"{f'd{d}':>9}" for d in range(2, 7)))
    for name, fn in kinds.items():
        row = [ms(lambda: fn((d + 1, opts.vocab), "cpu"), opts.reps) for d in range(2, 7)]
        print(f"  eager {name:<22}" + "".join(f"{t:9.3f}" for t in row))
        if opts.compile:
            compiled = {d: torch.compile(own(lambda d=d: fn((d + 1, opts.vocab), "cpu")), fullgraph=True, dynamic=False) for d in range(2, 7)}
            row = [ms(compiled[d], opts.reps) for d in range(2, 7)]
            print(f"  compiled {name:<19}" + "".join(f"{t:9.3f}" for t in row))
    if opts.noise_only:
        return
    # the verify's draw: m+1 rows at depth 6, each row's noise row by its depth
    print("verify draw argmax(l/T + noise[depths]), ms:" + "".join(f"{f'm{m}':>9}" for m in (8, 16, 60)))
    for name, fn in kinds.items():
        row = []
        for m in (8, 16, 60):
            logits = torch.randn(m + 1, opts.vocab) * 3
            depths = torch.arange(m + 1) % 7
            noise = fn((7, opts.vocab), "cpu")
            row.append(ms(lambda: sampling.draw(logits, "sample", None, noise[depths]), opts.reps))
        print(f"  eager {name:<38}" + "".join(f"{t:9.3f}" for t in row))
        if opts.compile:
            row = []
            for m in (8, 16, 60):
                logits = torch.randn(m + 1, opts.vocab) * 3
                depths = torch.arange(m + 1) % 7
                step = torch.compile(own(lambda logits, depths: sampling.draw(logits, "sample", None, fn((7, opts.vocab), "cpu")[depths])),
                                     fullgraph=True, dynamic=False)
                row.append(ms(lambda: step(logits, depths), opts.reps))
            print(f"  compiled, noise drawn in the graph, {name:<9}" + "".join(f"{t:9.3f}" for t in row))


if __name__ == "__main__":
    main()
