# The default device and dtype. Device: CUDA if there is one. Dtype: CUDA: bf16. CPU: whichever decodes faster here,
# measured once per machine and cached (dtypes.json beside the tree sizes): CPUs differ, even among those with
# AVX512-BF16, where bf16 reads half the bytes with native dot products (docs/cpu.md). A CPU without native bf16
# (neither AVX512-BF16 nor AMX on x86) is ruled out without measuring.
import platform
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

import cachedir
import ops
import tp

CACHE = "dtypes.json"
# bf16 rounds activations to 8 bits of mantissa, so it must win clearly, not by noise.
MIN_GAIN = 1.1
ROUNDS, ROUND_GAP_S = 12, 0.5


def cpuinfo() -> list:
    """/proc/cpuinfo's lines (none where there is no such file)."""
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def cpu_name() -> str:
    name = next((line.split(":", 1)[1].strip() for line in cpuinfo() if line.startswith("model name")), None)
    return name or platform.processor() or platform.machine()


def native_bf16(device="cpu") -> bool:
    """bf16 matmuls run natively (where they are emulated they are slower than fp32)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True  # no cheap query elsewhere (ARM bf16 is a feature flag): let the measurement decide
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def _linear_ms(weights: list, dtypes: tuple, reps: int = 15) -> list:
    """Milliseconds per pass over all weights, for each dtype: the least disturbed of reps passes, the dtypes
    taking turns so that a burst of load elsewhere hits both."""
    runs = [([w.to(d) for w in weights], [torch.randn(1, w.shape[1], dtype=d) for w in weights]) for d in dtypes]
    best = [float("inf")] * len(dtypes)
    for _ in range(reps):
        for i, (ws, xs) in enumerate(runs):
            t0 = time.perf_counter()
            for x, w in zip(xs, ws):
                F.linear(x, w)
            best[i] = min(best[i], time.perf_counter() - t0)
    return [round(1000 * t, 3) for t in best]


@torch.inference_mode()
def measure_cpu() -> dict:
    """One-row matmuls over 108 MB of fp32 weights (more than any L3 cache, like a model's decode step) in
    fp32 and bf16, on one thread: milliseconds each. One thread measures what the core's instructions do; with
    all threads a busy machine decides (a descheduled thread stalls bf16's parallel GEMV by a whole time slice) and
    a wrong choice would stay cached."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=g) for out, inp in ((2048, 2048), (5632, 2048), (2048, 5632))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # A shared host slows a process for seconds at a time, and then bf16's pass more than fp32's: rounds spread
        # over a few seconds, each dtype's best of them, until bf16 wins clearly (most machines: the first round).
        fp32, bf16 = float("inf"), float("inf")
        for r in range(ROUNDS):
            time.sleep(ROUND_GAP_S if r else 0)
            fp32, bf16 = map(min, zip((fp32, bf16), _linear_ms(weights, (torch.float32, torch.bfloat16))))
            if fp32 > MIN_GAIN * bf16:
                break
        return {"float32_ms": fp32, "bfloat16_ms": bf16}
    finally:
        torch.set_num_threads(threads)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def free_bytes(device) -> Optional[int]:
    """Memory a new allocation on device may take: CUDA's free memory, or Linux's MemAvailable; None where unknown."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        kib = next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemAvailable:"))
        return int(kib) * 1024
    except (OSError, StopIteration, ValueError):
        return None


def synchronizer(device):
    """A function that waits for the device's queued work (timing): CUDA runs asynchronously, a CPU does not."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def default_dtype(device, log=print) -> torch.dtype:
    """bf16 on CUDA; on a CPU the faster of fp32 and bf16, measured once per machine (cached) and logged."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.bfloat16
    if tp.rank() != 0:
        log = lambda s: None  # noqa: E731
    if not native_bf16():  # no measurement to report: the summary line names the dtype
        return torch.float32
    key = f"{cpu_name()} | torch {torch.__version__}"
    valid = lambda e: e["choice"] in ("float32", "bfloat16") and cachedir.number(e["float32_ms"]) and cachedir.number(e["bfloat16_ms"])  # noqa: E731
    entry = tp.from_rank0(cachedir.entry(CACHE, key, valid))  # tensor-parallel ranks must agree
    if entry is None:  # said once, when measured; every run names its dtype in its summary line
        disturbed = ops.watch_load()
        entry = tp.from_rank0(measure_cpu())
        entry["choice"] = "bfloat16" if entry["float32_ms"] > MIN_GAIN * entry["bfloat16_ms"] else "float32"
        cachedir.store(CACHE, key, entry, disturbed())
        log(f"dtype {entry['choice']} (one-row matmuls: float32 {entry['float32_ms']} ms, bfloat16 {entry['bfloat16_ms']} ms "
            f"on this CPU; cached in {cachedir.root() / CACHE}; --dtype overrides)")
    return getattr(torch, entry["choice"])
