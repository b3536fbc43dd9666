"""A load client for serve.py or any OpenAI-compatible server (llama-cpp-python's): streamed chat completions at T = 0
from N concurrent clients over the MT-bench first turns, reporting time to first token, per-token latency (p50, p95),
requests/s and tokens/s at each concurrency. --serve "FLAGS" starts serve.py with those flags on a free port first and
stops it after; --url measures a server already running. docs/serving.md has the figures and the commands.
"""
import sys
from pathlib import Path

if not __package__:  # run as a script (python bench/bench.py): the project's root, not this folder, is the import root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import interrupt  # noqa: E402,F401  first: Ctrl-C during the imports exits 130 in one line
import json  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import atomic  # noqa: E402
import tp  # noqa: E402
from errors import UsageError, UsageParser  # noqa: E402

REPO = Path(sys.path[0])
MT_BENCH = REPO / "data" / "mt_bench.jsonl"


def build_parser():
    p = UsageParser(description="Throughput and latency of an OpenAI-compatible server under concurrent streamed requests.")
    p.add_argument("--url", default=None, help="a running server's base URL (e.g. http://127.0.0.1:8000)")
    p.add_argument("--serve", default=None, help="start serve.py with these flags (one quoted string) instead")
    p.add_argument("--label", default=None, help="the name of this server in the output (default: --serve's flags or --url)")
    p.add_argument("--model", default="default", help="the model field sent (llama-cpp-python's server checks none)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--requests", type=int, default=16, help="requests at each concurrency")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--conversation", type=int, default=0, metavar="TURNS",
                   help="also one client's conversation of TURNS turns (the MT-bench questions), each request sending the whole history: "
                        "time to first token per turn")
    p.add_argument("--json-answers", action="store_true", help="every answer a JSON object {\"answer\": text} (response_format json_schema), "
                                                                "each question asking for one")
    p.add_argument("--out", type=Path, default=None, help="append the figures to this JSON file (a list)")
    return p


ANSWER_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"], "additionalProperties": False}}}


def questions(n: int, json_answers: bool = False) -> list:
    rows = [json.loads(line) for line in MT_BENCH.read_text(encoding="utf-8").splitlines() if line.strip()]
    ask = ' Reply with a JSON object {"answer": "..."}.' if json_answers else ""
    return [rows[i % len(rows)]["turns"][0] + ask for i in range(n)]


def one_request(client, model: str, question, max_tokens: int, response_format=None) -> dict:
    """One streamed chat completion of question (or a list of messages) -> its start, first-token and end times, the
    tokens it got and its text."""
    t0, first, tokens, text = time.perf_counter(), None, 0, []
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else question
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, **({"response_format": response_format} if response_format else {}))
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if chunk.choices and (chunk.choices[0].delta.content or (chunk.model_extra or {}).get("eaglet", {}).get("token_ids")):
            first = first or time.perf_counter()
            tokens += len((chunk.model_extra or {}).get("eaglet", {}).get("token_ids") or [0])
            text.append(chunk.choices[0].delta.content or "")
    return {"start": t0, "first": first or time.perf_counter(), "end": time.perf_counter(), "tokens": usage or tokens, "text": "".join(text)}


def conversation(client, model: str, turns: int, max_tokens: int) -> dict:
    """One client's conversation: each turn a new question after the answers so far, the whole history sent each time
    (as every OpenAI client does) -> time to first token per turn, and the last over the first."""
    history, ttft = [], []
    for q in questions(turns):
        history.append({"role": "user", "content": q})
        r = one_request(client, model, history, max_tokens)
        history.append({"role": "assistant", "content": r["text"]})
        ttft.append(round(1e3 * (r["first"] - r["start"]), 1))
    return {"conversation_turns": turns, "ttft_ms_per_turn": ttft, "last_over_first": round(ttft[-1] / ttft[0], 2)}


def percentile(values: list, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def run_level(client, model: str, prompts: list, concurrency: int, max_tokens: int, response_format=None) -> dict:
    """prompts answered by `concurrency` clients at once, each taking the next prompt when its answer is done."""
    results, lock, todo = [], threading.Lock(), list(prompts)

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                q = todo.pop(0)
            r = one_request(client, model, q, max_tokens, response_format)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["first"] - r["start"] for r in results]
    per_token = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "tokens": tokens, "seconds": round(wall, 2),
            "requests_per_s": round(len(results) / wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "ttft_p50_ms": round(1e3 * percentile(ttft, 0.5), 1), "ttft_p95_ms": round(1e3 * percentile(ttft, 0.95), 1),
            "per_token_p50_ms": round(1e3 * percentile(per_token, 0.5), 1), "per_token_p95_ms": round(1e3 * percentile(per_token, 0.95), 1)}


def start_server(flags: str) -> tuple:
    """serve.py with flags on a free port -> (process, its base URL), once it listens."""
    proc = subprocess.Popen([sys.executable, str(REPO / "serve.py"), *shlex.split(flags), "--port", "0"], cwd=REPO,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        print(line, end="", file=sys.stderr)
        if line.startswith("serving ") and " on http://" in line:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keeps its pipe drained
            return proc, line.rsplit(" on ", 1)[1].strip()
        if line.startswith("error:"):
            break
    proc.wait()
    raise UsageError(f"serve.py {flags} did not start (status {proc.returncode})")


def main(argv=None) -> int:
    try:
        a = build_parser().parse_args(argv)
        if (a.url is None) == (a.serve is None):
            raise UsageError("give one of --url and --serve")
        if a.requests < 1 or a.max_tokens < 1 or min(a.concurrency) < 1 or a.conversation < 0:
            raise UsageError("--requests, --max-tokens and --concurrency must be >= 1, --conversation >= 0")
        import openai

        proc, url = start_server(a.serve) if a.serve is not None else (None, a.url.rstrip("/"))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    label = a.label or (f"serve.py {a.serve}" if a.serve is not None else url)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        one_request(client, a.model, "Hello!", 8)  # a first answer outside the figures
        rows = []
        for c in a.concurrency:
            row = {"server": label, "max_tokens": a.max_tokens, "json_answers": a.json_answers} | run_level(
                client, a.model, questions(a.requests, a.json_answers), c, a.max_tokens, ANSWER_SCHEMA if a.json_answers else None)
            print(json.dumps(row), flush=True)
            rows.append(row)
        if a.conversation:
            row = {"server": label, "max_tokens": a.max_tokens} | conversation(client, a.model, a.conversation, a.max_tokens)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        if proc is not None:
            proc.send_signal(2)  # SIGINT: it drains and exits
            proc.wait()
    if a.out is not None:
        old = json.loads(a.out.read_text()) if a.out.is_file() else []
        atomic.write_text(a.out, json.dumps(old + rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    tp.exit_with(main)
