# Benchmark prompts: MT-bench-format jsonl, the 80 MT-bench questions by default (data/mt_bench.jsonl), and 12 coding and
# maths questions (data/code_math.jsonl). bench.py and calibration.py time and measure on them; distill.py keeps both
# out of the data a head is trained on.
import json
from pathlib import Path

from errors import UsageError, one_line
from tokenizer import check_text

MT_BENCH = Path(__file__).resolve().parent / "data" / "mt_bench.jsonl"
CODE_MATH = MT_BENCH.with_name("code_math.jsonl")  # 12 coding and maths questions: a benchmark of another kind of text


def load_conversations(path=MT_BENCH, limit=None) -> list:
    """MT-bench format: one JSON object per line with `turns` (or a single `prompt`). A limit takes
    conversations spread evenly over the file, so a subset still spans every category."""
    try:
        rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        conversations = [r.get("turns") or [r["prompt"]] for r in rows]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"prompts file {path}: not MT-bench-format UTF-8 jsonl ({type(e).__name__}: {one_line(e, 120)})") from None
    if not conversations or not all(isinstance(t, str) and t for turns in conversations for t in turns):
        raise UsageError(f"prompts file {path}: no conversations, or a turn that is not a non-empty string")
    for i, turns in enumerate(conversations):
        for turn in turns:
            check_text(turn, f"prompts file {path}, conversation {i + 1}")  # a JSON escape can make a lone surrogate
    return conversations[:: max(1, len(conversations) // limit)][:limit] if limit else conversations
