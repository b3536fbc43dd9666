# generate.py end to end on the embedded default model: greedy parity with transformers, bad input.
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoint
import generate
from model import ModelArgs
from tokenizer import encode_prompt

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["What is the capital of France?", "Explain in two sentences why the sky is blue.", "Write a short poem about the ocean."]


@pytest.fixture(scope="module")
def default_dir():
    try:
        return checkpoint.default_checkpoint()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def run_json(*argv):
    return json.loads(subprocess.run([sys.executable, "generate.py", "--json", *argv], cwd=REPO, capture_output=True, text=True, check=True).stdout)


@pytest.fixture(scope="module")
def hf_greedy(default_dir):
    """transformers' greedy generate on the same GGUF, the reference for our output."""
    transformers = pytest.importorskip("transformers")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from checkpoint import smollm2_gguf

    gguf = Path(smollm2_gguf())
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    from tokenizer import load_tokenizer

    tok, args = load_tokenizer(default_dir), ModelArgs.load(default_dir / "config.json")
    out = {}
    for prompt in PROMPTS:
        ids = encode_prompt(tok, args, [{"role": "user", "content": prompt}], chat=True)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, eos_token_id=args.stop_tokens, pad_token_id=args.stop_tokens[0])
        out[prompt] = gen[0, len(ids):].tolist()
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers(default_dir, hf_greedy, prompt):
    ours = run_json("--prompt", prompt, "--max-new-tokens", "48", "--dtype", "float32")  # exact parity needs fp32
    assert ours["token_ids"] == hf_greedy[prompt]
    assert ours["new_tokens"] == len(ours["token_ids"]) <= 48
    if "France" in prompt:
        assert "Paris" in ours["text"]


def test_a_batch_of_prompts_answers_each_as_alone(default_dir, hf_greedy):
    # three prompts through two rows (the first row done takes the third), eagle2 with the shipped head: every answer is
    # the same greedy answer as transformers'
    argv = [x for prompt in PROMPTS for x in ("--prompt", prompt)]
    r = subprocess.run([sys.executable, "generate.py", "--json", *argv, "--batch-size", "2", "--max-new-tokens", "48", "--dtype", "float32", "--speculate", "eagle2",
                        "--depth", "4", "--topk", "6", "--num-draft-tokens", "16"], cwd=REPO, capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["index"] for row in rows] == [0, 1, 2]
    assert [row["token_ids"] for row in rows] == [hf_greedy[p] for p in PROMPTS]
    assert all(row["mean_accept_len"] > 1 for row in rows)


BAD = [
    (["--checkpoint", "/nonexistent/model"], "does not exist"),
    (["--checkpoint", str(REPO / "tests")], "config.json"),
    (["--speculate", "medusa"], "unknown --speculate"),
    (["--max-new-tokens", "9000"], "exceeds the context"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--frequency-penalty", "3"], "--frequency-penalty"),
    (["--logit-bias", "5=1"], "--logit-bias"),
    (["--logit-bias", "5:200"], "--logit-bias"),
    (["--logit-bias", "99999999:-100", "--prompt", "a"], "--logit-bias"),
    (["--speculate", "eagle2", "--draft-vocab", "-1"], "--draft-vocab"),
    (["--speculate", "eagle2", "--num-draft-tokens", "60", "--depth", "2", "--topk", "4"], "exceeds"),
    (["--prompts", "/nonexistent/prompts.jsonl"], "prompts file"),
    (["--prompt", "a", "--interactive"], "--interactive"),
    (["--prompt", "a", "--prompt", "b", "--batch-size", "-1"], "--batch-size"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_is_one_line_exit_2(default_dir, argv, message):
    # --dtype: a first run on a fresh machine would also report its dtype measurement on stderr
    r = subprocess.run([sys.executable, "generate.py", "--dtype", "float32", *argv], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_long_step_says_every_few_seconds_how_long_it_has_run():
    """progress.ticking: a line per interval while the block runs, none after it ends, none for a block done sooner."""
    import time

    from progress import ticking

    lines = []
    with ticking("compiling the cycle", lines.append, every=0.05):
        time.sleep(0.4)
    said = len(lines)
    time.sleep(0.2)
    assert said >= 2 and len(lines) == said and all(line.startswith("  compiling the cycle: ") for line in lines), lines
    with ticking("quick", lines.append, every=5.0):
        pass
    assert len(lines) == said
