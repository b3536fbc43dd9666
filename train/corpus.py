# The self-distilled corpus as a file that travels with the repository: the requests the target wrote and the token
# ids of its answers, without the features (those are rebuilt from the tokens by one feature pass, far faster than
# writing the answers again, and would not fit in git). One JSON line a conversation, xz-compressed:
#
#   {"request": "...", "temperature": 0.0, "prompt_len": 31, "tokens": [1, 9690, ...]}
#
#   python train/corpus.py pack out/distA:out/distB data/corpus/smollm2-135m-instruct.jsonl.xz
#   python train/corpus.py unpack data/corpus/smollm2-135m-instruct.jsonl.xz out/dist
#   python train/train_draft.py --out out/run --data-dir out/dist --data-only --num-prompts N   # features, then more
#
# unpack writes a data directory as distill.py leaves one, minus its features: requests.jsonl and conversations.jsonl
# with the conversations numbered in order, so a data job there featurises them and goes on writing new ones.
import sys
from pathlib import Path

if not __package__:  # run as a script (python train/corpus.py): the project's root, not this folder, is the import root
    sys.path[0] = str(Path(__file__).resolve().parents[1])
import interrupt  # noqa: F401  first of all: Ctrl-C during the imports below exits 130 in one line too
import json
import lzma
import os

import atomic
from errors import UsageError, UsageParser
from train import distill

FIELDS = ("temperature", "prompt_len", "tokens")


def conversations(data: Path) -> list:
    """A data directory's answered conversations with their requests, in id order."""
    requests = [r["request"] for r in distill.read_jsonl(data / "requests.jsonl")]
    convs = sorted(distill.read_jsonl(data / "conversations.jsonl"), key=lambda c: c["id"])
    if convs and convs[-1]["id"] >= len(requests):
        raise UsageError(f"{data}: a conversation answers request {convs[-1]['id']}, which requests.jsonl lacks")
    return [{"request": requests[c["id"]], **{k: c[k] for k in FIELDS}} for c in convs]


def pack(data_dirs: list, out: Path) -> int:
    """Every answered conversation of the data directories, in order, into out (xz, written whole or not at all)."""
    lines = [json.dumps(c, separators=(",", ":")) for d in data_dirs for c in conversations(d)]
    out.parent.mkdir(parents=True, exist_ok=True)

    def fill(tmp):
        with lzma.open(tmp, "wt", preset=9 | lzma.PRESET_EXTREME) as f:
            f.write("".join(line + "\n" for line in lines))

    atomic.write(out, fill)  # an interrupted pack leaves the old file
    return len(lines)


def read(corpus: Path) -> list:
    with lzma.open(corpus, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def unpack(corpus: Path, data: Path) -> int:
    """A fresh data directory from a corpus file: requests.jsonl and conversations.jsonl, ids 0..n-1."""
    if (data / "requests.jsonl").exists() or (data / "conversations.jsonl").exists():
        raise UsageError(f"{data} already holds a data set: unpack into a new directory")
    convs = read(corpus)
    data.mkdir(parents=True, exist_ok=True)
    # Each file whole or absent (a stop between the two: remove the directory and unpack again).
    atomic.write(data / "conversations.jsonl", lambda tmp: distill.append_jsonl(tmp, [{"id": i, **{k: c[k] for k in FIELDS}} for i, c in enumerate(convs)]))
    atomic.write(data / "requests.jsonl", lambda tmp: distill.append_jsonl(tmp, [{"request": c["request"]} for c in convs]))
    return len(convs)


def build_parser() -> UsageParser:
    p = UsageParser(description="Pack a self-distilled data set's conversations into a corpus file, or unpack one.")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("pack", help="data directories (joined by ':') -> a .jsonl.xz corpus")
    a.add_argument("data_dirs")
    a.add_argument("out", type=Path)
    b = sub.add_parser("unpack", help="a .jsonl.xz corpus -> a new data directory")
    b.add_argument("corpus", type=Path)
    b.add_argument("data_dir", type=Path)
    return p


def main(argv=None) -> int:
    try:
        opts = build_parser().parse_args(argv)
        if opts.command == "pack":
            dirs = [Path(d) for d in opts.data_dirs.split(os.pathsep) if d]
            for d in dirs:
                if not (d / "conversations.jsonl").exists():
                    raise UsageError(f"{d} holds no conversations.jsonl")
            n = pack(dirs, opts.out)
            print(f"{n} conversations -> {opts.out} ({opts.out.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
        else:
            if not opts.corpus.is_file():
                raise UsageError(f"{opts.corpus} does not exist")
            n = unpack(opts.corpus, opts.data_dir)
            print(f"{n} conversations -> {opts.data_dir} (a data job there featurises them first)", file=sys.stderr)
    except (UsageError, lzma.LZMAError, json.JSONDecodeError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
