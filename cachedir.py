# Where eaglet keeps what it makes on this machine: $EAGLET_CACHE, default ~/.cache/eaglet. The converted default
# model lives there, beside small JSON files of per-machine measurements (the dtype choice, the tree sizes). They are
# data from disk: a file or entry that is damaged or unreadable is said once on stderr and measured again, and a
# directory that cannot be written (read-only, full) leaves the measurement unsaved, said once: never fatal.
import json
import os
import sys
from pathlib import Path

import atomic
import tp

_warned = set()  # (file, what): each said once a process


def root() -> Path:
    return Path(os.environ.get("EAGLET_CACHE", "~/.cache/eaglet")).expanduser()


def warn(path: Path, what: str):
    if (path, what) not in _warned and tp.rank() == 0:
        _warned.add((path, what))
        print(f"warning: {path}: {what}", file=sys.stderr)


def read(name: str) -> dict:
    path = root() / name
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        warn(path, f"unreadable, ignored and measured again ({type(e).__name__}: {' '.join(str(e).split())[:120]})")
        return {}
    if not isinstance(data, dict):
        warn(path, "not a JSON object, ignored and measured again")
        return {}
    return data


def entry(name: str, key: str, valid):
    """The entry of key in a measurement file, or None when there is none or valid(entry) does not hold (an exception in
    valid counts as damage): a damaged entry is said once, then measured again and rewritten."""
    value = read(name).get(key)
    try:
        ok = value is None or bool(valid(value))
    except (TypeError, ValueError, KeyError, AttributeError, IndexError):
        ok = False
    if not ok:
        warn(root() / name, f"entry {key!r} is damaged ({' '.join(json.dumps(value).split())[:80]}), measured again")
    return value if ok else None


def number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def store(name: str, key: str, entry: dict, disturbed=None):
    """Sets one key of a JSON measurement file (rank 0 alone writes under tensor parallelism). disturbed: what took the
    machine while the entry was measured (ops.watch_load), if anything: then it serves this run alone, said once, and
    the next run measures again, so that a busy moment never stays cached as the machine's speed."""
    if tp.rank() != 0:
        return
    if disturbed:
        warn(root() / name, f"measured while {disturbed}: used for this run, measured again next run")
        return
    path = root() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, json.dumps(read(name) | {key: entry}, indent=2) + "\n")  # readers never see half a file
    except OSError as e:
        warn(path.parent, f"cannot save measurements here ({e.strerror or e}), so they are made again next run")
