# The command line: answer one prompt, a batch, or chat (--interactive, terminal.py), with vanilla or speculative
# decoding, streaming the text as it is committed. Everything it does goes through eaglet.load_generator; read
# generator.py next, then speculate.py.
import interrupt  # noqa: F401  first of all: Ctrl-C during the imports below exits 130 in one line too
import argparse
import json
import sys
from pathlib import Path

import torch

import tp
from checkpoint import parse_logit_bias
from eaglet import add_model_flags, check_sampling, load_generator
from errors import UsageError, UsageParser
from prompts import load_conversations
from terminal import chat, status_line, streamer
from tokenizer import check_text, encode_prompt

DEFAULT_PROMPT = "What is the capital of France?"


def build_parser() -> argparse.ArgumentParser:
    p = UsageParser(description="Generate text with a LLaMA-family model, optionally with speculative decoding.")
    p.add_argument("--prompt", action="append", default=None, help="default: What is the capital of France?; repeated: answered in one batch")
    p.add_argument("--prompts", type=Path, default=None, help="answer the first turns of an MT-bench-format jsonl in one batch")
    p.add_argument("--batch-size", type=int, default=0, help="several prompts: this many rows at a time, a row that is done taking the next prompt (default: all)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="apply the chat template (default: on for chat models)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (argmax)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's: each token's logit less this per occurrence in the answer (-2 to 2)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's: each token's logit less this once it occurs in the answer (-2 to 2)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID:BIAS", help="add BIAS (-100 to 100) to token ID's logit; repeatable")
    p.add_argument("--seed", type=int, default=0)
    add_model_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--interactive", action="store_true", help="chat in the terminal; the caches keep the conversation between turns")
    return p


def answer_batch(gen, tokenizer, prompts: list, opts, sampling, quiet: bool) -> int:
    """Several prompts in one batch (Generator.generate_batch): each answer in order, or one JSON object per answer."""
    stops = gen.target.args.stop_tokens
    results = gen.generate_batch(prompts, opts.max_new_tokens, sampling, stops, opts.batch_size)
    for i, result in enumerate([] if quiet else results):
        text = tokenizer.decode([t for t in result.token_ids if t not in stops])
        if opts.json:
            print(json.dumps({"index": i, "text": text, "token_ids": result.token_ids, **result.metrics(gen.spec)}))
        else:
            print(f"[{i}] {text}")
            print(status_line(result, gen.spec), file=sys.stderr)
    if not quiet and not opts.json:
        total = sum(len(r.token_ids) for r in results)
        print(f"[batch of {len(results)}: {total} tokens in {results[0].seconds:.2f} s, {total / results[0].seconds:.1f} tok/s]", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    quiet = tp.rank() != 0  # every rank generates the same tokens; rank 0 alone prints them
    try:
        opts = build_parser().parse_args(argv)
        sampling = check_sampling(opts.temperature, opts.top_k, opts.top_p, parse_logit_bias(opts.logit_bias), opts.frequency_penalty, opts.presence_penalty)
        questions = [check_text(q, "--prompt") for q in opts.prompt or []] + ([turns[0] for turns in load_conversations(opts.prompts)] if opts.prompts else [])
        if opts.batch_size < 0:
            raise UsageError(f"--batch-size must be >= 0, got {opts.batch_size}")
        if opts.interactive and (opts.prompt or opts.prompts or sys.stdin is None):  # None: started with stdin closed
            raise UsageError("--interactive reads its prompts from stdin" + (", which is closed" if sys.stdin is None else ", not --prompt or --prompts"))
        gen, tokenizer = load_generator(opts.checkpoint, opts.draft, opts.speculate, device=opts.device, dtype=opts.dtype, compile=opts.compile,
                                        depth=opts.depth, topk=opts.topk, num_draft_tokens=opts.num_draft_tokens, speculate_k=opts.speculate_k,
                                        draft_vocab=opts.draft_vocab, draft_checkpoint=opts.draft_checkpoint, lookup_slots=opts.lookup_slots, sampling=sampling,
                                        batch=min(opts.batch_size or len(questions), len(questions)) or 1)  # a batch's tree is sized for its rows
        margs = gen.target.args
        chat_template = opts.chat if opts.chat is not None else bool(margs.chat_template)
        torch.manual_seed(opts.seed)
        if opts.interactive:
            if tp.world_size() > 1:
                raise UsageError("--interactive runs in one process, not under torchrun")
            return chat(gen, tokenizer, opts, sampling, chat_template)
        prompts = [encode_prompt(tokenizer, margs, [{"role": "user", "content": q}], chat_template) for q in questions or [DEFAULT_PROMPT]]
        if len(prompts) > 1:
            return answer_batch(gen, tokenizer, prompts, opts, sampling, quiet)
        stream, _ = streamer(tokenizer, margs.stop_tokens, show=not opts.json and not quiet)
        result = gen.generate(prompts[0], opts.max_new_tokens, sampling, margs.stop_tokens, stream)
    except UsageError as e:
        if not quiet:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if quiet:
        return 0
    text = tokenizer.decode([t for t in result.token_ids if t not in margs.stop_tokens])
    metrics = result.metrics(gen.spec) | {"dtype": str(gen.target.tok_embeddings.weight.dtype).removeprefix("torch."),
                                           "compile_s": round(gen.compile_seconds, 1)}  # spent before the answer, not in its tok/s
    if opts.json:
        print(json.dumps({"text": text, "token_ids": result.token_ids, **metrics}))
    else:
        print()
        summary = ", ".join(f"{k} {v}" for k, v in metrics.items() if k not in ("accept_len_hist",))
        print(f"[{summary}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    tp.exit_with(main)
