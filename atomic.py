# Files the project writes are whole or absent: each is written beside its place under a temporary name, then renamed
# over it (os.replace is atomic on one filesystem), so a reader, a crash, Ctrl-C or a full disk never leaves half a file.
import os
from pathlib import Path


def write(path, fill):
    """fill(temporary path) writes the file's content; then it takes path's place. The temporary name keeps path's
    suffix (savefig and safetensors read it) and is removed if fill fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        fill(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path, text: str):
    write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
