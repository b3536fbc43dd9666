# Throughput of the self-distillation data path on the embedded model: the batched sampler (B rows, N new
# tokens, no stop so every row makes N) and the feature pass. Reports wall tok/s and tokens per CPU-second
# (the machine is shared: CPU time is what a run costs), with the load average.
#
#   python bench/distill_speed.py --dtype bfloat16 --threads 1                # this tree's distill.sample_batch
#   python bench/distill_speed.py --dtype float32 --states --new-tokens 256   # as the data job runs it
import sys
from pathlib import Path

if not __package__:  # run as a script (python bench/bench.py): the project's root, not this folder, is the import root
    sys.path[0] = str(Path(__file__).resolve().parents[1])
import argparse
import contextlib
import os
import time

import torch  # noqa: E402

from checkpoint import default_checkpoint  # noqa: E402
from checkpoint import load_model
from tokenizer import encode_prompt  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402
from train import distill  # noqa: E402


def timed(label: str, fn, tokens_of) -> None:
    t0, c0 = time.perf_counter(), time.process_time()
    n = tokens_of(fn())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    load = open("/proc/loadavg").read().split()[0]
    print(f"{label}: {n} tokens in {wall:.2f} s, {n / wall:.1f} tok/s wall; cpu {cpu:.2f} s, {n / cpu:.1f} tok per cpu-s; load {load}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--states", action="store_true", help="the sampler keeps every position's states, as the data job does")
    p.add_argument("--features", action="store_true", help="also time distill.featurize on 48 conversations of 150-400 tokens")
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    ck = default_checkpoint()
    target, tok = load_model(ck, "cpu", getattr(torch, opts.dtype)), load_tokenizer(ck)
    def sample(*args):
        with distill.tapped(target) if opts.states else contextlib.nullcontext():
            rows = distill.sample_batch(*args, batch=opts.batch, compile=opts.compile, **({"states": True} if opts.states else {}))
        return [r[0] for r in rows] if opts.states else rows

    seeds, name = distill.SEEDS, "distill.sample_batch" + (" (compiled)" if opts.compile else "")
    prompts = [encode_prompt(tok, target.args, [{"role": "user", "content": s + " the sea"}], True)
               for s in (seeds * (opts.batch // len(seeds) + 1))[: opts.batch]]
    temperature = torch.tensor([0.0, 0.8] * (opts.batch // 2) + [0.0] * (opts.batch % 2))
    torch.manual_seed(0)
    for i in range(opts.runs):  # the first run includes compilation
        timed(f"{name} {opts.dtype} B={opts.batch} new={opts.new_tokens} threads {opts.threads} run {i}",
              lambda: sample(target, prompts, opts.new_tokens, temperature, 0.95, []), lambda rows: sum(map(len, rows)))
    if opts.features:
        g = torch.Generator().manual_seed(0)
        convs = [{"id": i, "prompt_len": 60, "tokens": torch.randint(0, target.args.vocab_size, (int(n),), generator=g).tolist()}
                 for i, n in enumerate(torch.randint(150, 400, (48,), generator=g))]
        for i in range(2):
            timed(f"distill.featurize {opts.dtype} threads {opts.threads} run {i}", lambda: distill.featurize(target, convs, 16384),
                  lambda states: sum(len(h) for h, _ in states.values()))


if __name__ == "__main__":
    main()
