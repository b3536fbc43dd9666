# The Gumbels of float32 uniforms, the noise sampling.gumbel replaced, and bench.py run with them in the cycle: the other
# side of docs/cpu.md's T=1 comparison of the two noises (noise_cost.py times them alone). They stand in for the keyed
# float64 ones (sampling.keyed_gumbel), so a seed no longer fixes the draws: the speed and tau are what this compares.
# Compiled steps are saved by the source they run, not by this swap, so the run keeps its own under
# $EAGLET_CACHE/float32-noise, beside the real ones; the machine's measurements are copied there and the checkpoints
# linked, so both sides run the same tree.
#
#   python bench/float32_noise.py --modes none,eagle2 --compile --num-prompts 12 --max-new-tokens 128 --temperature 1
import os
import runpy
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def gumbel32(shape, device):
    """float32 uniforms (k/2^24 near 1): a token below ~3.6e-9 of the top one's probability is never drawn."""
    return -torch.log(-torch.log(torch.rand(shape, device=device)))


def own_cache() -> Path:
    """$EAGLET_CACHE/float32-noise: the real cache's measurements copied, its checkpoints linked, no compiled steps."""
    import cachedir

    real = cachedir.root()
    own = real / "float32-noise"
    own.mkdir(parents=True, exist_ok=True)
    for entry in real.iterdir():
        if entry.is_file():
            shutil.copyfile(entry, own / entry.name)  # dtypes.json, tree_sizes.json: the choices the real run makes
        elif entry.name not in ("compiled", own.name) and not (own / entry.name).exists():
            (own / entry.name).symlink_to(entry)  # the converted default model
    return own


def main():
    os.environ["EAGLET_CACHE"] = str(own_cache())
    import sampling
    from bench.float32_noise import gumbel32  # by its module's name: a saved step checks its functions' source there,
    # and __main__ is bench.py once it runs

    sampling.keyed_gumbel = lambda keys, width: gumbel32((*keys.shape, width), keys.device)
    sys.argv[0] = str(ROOT / "bench" / "bench.py")
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # run as a script: the project's root, not this folder, is the import root
    main()
