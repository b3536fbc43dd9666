# What the terminal shows: an answer streamed as it is committed, a status line after it, and the chat loop of
# generate.py --interactive, whose earlier turns stay in the caches.
import json
import sys

from errors import UsageError
from tokenizer import StreamDecoder, check_text, encode_prompt


def streamer(tokenizer, stop_tokens, show: bool = True) -> tuple:
    """-> (on_tokens for Generator.generate, printing the text as it is committed when show; the answer's ids so far)."""
    decoder, ids = StreamDecoder(tokenizer), []

    def on_tokens(new):
        new = [t for t in new if t not in stop_tokens]
        ids.extend(new)
        if show:
            print(decoder.push(new), end="", flush=True)

    return on_tokens, ids


def status_line(result, spec) -> str:
    m = result.metrics(spec)
    parts = [f"{m['new_tokens']} tokens", f"{m['tokens_per_s']} tok/s"] + ([f"tau {m['mean_accept_len']}"] if "mean_accept_len" in m else [])
    return "[" + ", ".join(parts + [f"prefilled {result.prefilled} tokens"]) + "]"


def chat(gen, tokenizer, opts, sampling, chat_template: bool) -> int:
    """The terminal chat: a user turn per line, each answer streamed, then a status line. The conversation's
    earlier turns stay in the caches (Generator.generate(reuse=True)): a turn prefills only what is new."""
    margs, messages = gen.target.args, []
    dim = (lambda s: f"\033[2m{s}\033[0m") if sys.stderr.isatty() else (lambda s: s)
    print(dim("chat: /reset clears the conversation, /exit or end of input leaves, Ctrl-C stops an answer"), file=sys.stderr)
    sys.stdin.reconfigure(errors="surrogateescape")  # a line that is not UTF-8 is refused below, not a traceback
    while True:
        try:
            text = input("> " if sys.stdin.isatty() else "").strip()
        except EOFError:  # Ctrl-C here, between answers, leaves like anywhere else (interrupt.py)
            print(file=sys.stderr)
            return 0
        if text == "/exit":
            return 0
        if text == "/reset":
            messages = []
            print(dim("[conversation cleared]"), file=sys.stderr)
            continue
        if not text:
            continue
        try:
            turn = messages + [{"role": "user", "content": check_text(text, "that line")}]
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        prompt = encode_prompt(tokenizer, margs, turn, chat_template)
        if len(prompt) + opts.max_new_tokens > margs.block_size:
            print(f"the conversation ({len(prompt)} tokens) plus --max-new-tokens {opts.max_new_tokens} would exceed the context of "
                  f"{margs.block_size}: /reset to start over", file=sys.stderr)
            continue
        stream, ids = streamer(tokenizer, margs.stop_tokens, show=not opts.json)
        try:
            result = gen.generate(prompt, opts.max_new_tokens, sampling, margs.stop_tokens, stream, reuse=True)
            status = status_line(result, gen.spec)
        except KeyboardInterrupt:  # the answer so far stays in the conversation; the next turn prefills it afresh
            result, status = None, "[stopped]"
        messages = turn + [{"role": "assistant", "content": tokenizer.decode(ids)}]
        if opts.json:  # one object per answer: a transcript a program can read
            print(json.dumps({"text": messages[-1]["content"], "prompt_tokens": len(prompt)}
                             | ({"token_ids": result.token_ids, "prefilled": result.prefilled, **result.metrics(gen.spec)} if result else {"stopped": True})))
            continue
        print()
        print(dim(status), file=sys.stderr)
