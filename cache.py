# Where eaglet keeps what it makes on this machine: $EAGLET_CACHE, default ~/.cache/eaglet. The converted default
# model lives there, beside small JSON files of per-machine measurements (the dtype choice, the tree sizes).
import json
import os
from pathlib import Path

import tp


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLET_CACHE", "~/.cache/eaglet")).expanduser()


def read(name: str) -> dict:
    path = cache_dir() / name
    return json.loads(path.read_text()) if path.exists() else {}


def store(name: str, key: str, entry: dict):
    """Sets one key of a JSON measurement file (rank 0 alone writes under tensor parallelism)."""
    if tp.rank() != 0:
        return
    path = cache_dir() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(read(name) | {key: entry}, indent=2) + "\n")
    os.replace(tmp, path)  # readers never see a half-written file
