# Bad input, tried hard: every case gives one `error:` line and exit status 2 (never a traceback or a
# hang), or a documented, correct result.
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convert_hf_checkpoint import convert_hf
from draft import EagleHead, save_head
from hf_fixtures import write_gguf, write_hf_llama
from tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    hf = write_hf_llama(root / "hf", vocab=320, seed=0)  # block_size 256
    args = convert_hf(root / "hf", root / "ckpt")
    torch.manual_seed(1)
    head = EagleHead(args, draft_vocab_size=32)
    head.draft_vocab.copy_(torch.arange(32))
    save_head(head, root / "head")
    return root, hf


def run(script, *argv, timeout=120):
    # --dtype: a first run on a fresh machine would also report its dtype measurement on stderr
    dtype = ["--dtype", "float32"] if script in ("generate.py", "bench.py") else []
    return subprocess.run([sys.executable, script, *dtype, *map(str, argv)], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def assert_one_line_exit_2(r, message):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def broken_copy(root: Path, name: str, file: str, content: bytes) -> Path:
    out = root / name
    if not out.exists():
        shutil.copytree(root / "ckpt", out)
        (out / file).write_bytes(content)
    return out


def test_truncated_and_corrupted_weights(dirs):
    root, _ = dirs
    weights = (root / "ckpt" / "model.safetensors").read_bytes()
    for name, content in (("truncated", weights[: len(weights) // 2]), ("corrupted", b"\xff" * 4096)):
        ckpt = broken_copy(root, name, "model.safetensors", content)
        assert_one_line_exit_2(run("generate.py", "--checkpoint", ckpt), "truncated or not a weights file")


def test_config_that_disagrees_with_the_weights(dirs):
    root, _ = dirs
    config = json.loads((root / "ckpt" / "config.json").read_text())
    ckpt = broken_copy(root, "wrong-config", "config.json", json.dumps(config | {"intermediate_size": 96}).encode())
    assert_one_line_exit_2(run("generate.py", "--checkpoint", ckpt), "does not match its config.json")
    ckpt = broken_copy(root, "malformed-config", "config.json", b"{not json")
    assert_one_line_exit_2(run("generate.py", "--checkpoint", ckpt), "is not a model config")


def test_truncated_gguf_and_unsupported_architecture(dirs, tmp_path):
    import gguf

    root, hf = dirs
    good = tmp_path / "tiny.gguf"
    write_gguf(good, hf, root / "hf")
    data = good.read_bytes()
    for cut in (len(data) // 2, 200):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        assert_one_line_exit_2(run("convert_hf_checkpoint.py", "--gguf", tmp_path / "cut.gguf", "--out", tmp_path / "out"), "cut.gguf")
    other = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    other.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    other.write_header_to_file()
    other.write_kv_data_to_file()
    other.write_tensors_to_file()
    other.close()
    assert_one_line_exit_2(run("convert_hf_checkpoint.py", "--gguf", tmp_path / "gpt2.gguf", "--out", tmp_path / "out"),
                           "architecture 'gpt2' is not supported")


def test_empty_prompt(dirs):
    root, _ = dirs
    assert_one_line_exit_2(run("generate.py", "--checkpoint", root / "ckpt", "--no-chat", "--prompt", ""), "prompt is empty")
    # With the chat template an empty user turn is still a prompt: the template's own tokens.
    r = run("generate.py", "--checkpoint", root / "ckpt", "--prompt", "", "--max-new-tokens", "4", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["new_tokens"] >= 1, r.stderr


@pytest.mark.parametrize("mode", ["none", "eagle2"])
def test_prompt_at_the_context_limit(dirs, mode):
    root, _ = dirs
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 4
    n_prompt = len(load_tokenizer(root / "ckpt").encode(text))
    spec = ["--speculate", mode, "--draft", root / "head", "--num-draft-tokens", "8", "--depth", "3", "--topk", "4"] if mode != "none" else []
    base = ["--checkpoint", root / "ckpt", "--no-chat", "--prompt", text, *spec]
    r = run("generate.py", *base, "--max-new-tokens", 256 - n_prompt, "--json")  # prompt + new tokens = the whole context
    assert r.returncode == 0, r.stderr
    assert 1 <= json.loads(r.stdout)["new_tokens"] <= 256 - n_prompt
    assert_one_line_exit_2(run("generate.py", *base, "--max-new-tokens", 257 - n_prompt), "exceeds the context of 256")


def test_max_new_tokens_far_past_the_context(dirs):
    root, _ = dirs
    assert_one_line_exit_2(run("generate.py", "--checkpoint", root / "ckpt", "--max-new-tokens", 10**15, timeout=60), "exceeds the context")


def test_head_with_a_malformed_config(dirs):
    root, _ = dirs
    head = root / "bad-head"
    if not head.exists():
        shutil.copytree(root / "head", head)
        (head / "config.json").write_text('{"kind": "eagle", "dim": ')
    assert_one_line_exit_2(run("generate.py", "--checkpoint", root / "ckpt", "--speculate", "eagle2", "--draft", head), "config.json")


def test_draft_vocab_larger_than_the_heads(dirs):
    root, _ = dirs
    argv = ["--checkpoint", root / "ckpt", "--speculate", "eagle2", "--draft", root / "head", "--draft-vocab", 33]
    assert_one_line_exit_2(run("generate.py", *argv), "exceeds the head's draft vocabulary of 32")


def test_bench_prompts_that_are_not_utf8(dirs, tmp_path):
    root, _ = dirs
    prompts = tmp_path / "latin1.jsonl"
    prompts.write_bytes(json.dumps({"turns": ["caf\u00e9"]}).encode().replace(b"\\u00e9", b"\xe9") + b"\n")
    assert_one_line_exit_2(run("bench.py", "--checkpoint", root / "ckpt", "--modes", "none", "--prompts", prompts), "not MT-bench-format UTF-8 jsonl")


def test_bench_refuses_an_unknown_mode(dirs):
    root, _ = dirs
    # It once ran eagle2 under an unknown name (then "lookup") and reported it as that mode.
    assert_one_line_exit_2(run("bench.py", "--checkpoint", root / "ckpt", "--modes", "none,medusa"), "unknown --speculate mode 'medusa'")


def test_an_unknown_compile_setting(dirs):
    root, _ = dirs
    for script in ("generate.py", "bench.py"):
        assert_one_line_exit_2(run(script, "--checkpoint", root / "ckpt", "--compile", "fast"), "invalid choice: 'fast' (choose from 'auto', 'max', 'packed')")


def test_bench_runs_on_the_shipped_mt_bench_questions(dirs):
    root, _ = dirs
    r = run("bench.py", "--checkpoint", root / "ckpt", "--modes", "none", "--num-prompts", "2", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 conversations" in r.stdout
