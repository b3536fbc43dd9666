# Bad input, tried hard: every case gives one `error:` line and exit status 2 (never a traceback or a
# hang), or a documented, correct result.
import errno
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cachedir
import checkpoint
import dtypes
import eaglet
import generate
import ops
import sampling
import sizing
from bench import bench
from cpu import inductor
from convert_hf_checkpoint import convert_hf
from draft import EagleHead
from errors import UsageError
from hf_fixtures import write_gguf, write_hf_llama
from sampling import Sampling
from speculate import SpecState
from tokenizer import load_tokenizer
import weights
from weights import save_head

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Every test (and the subprocesses it starts) measures into its own cache directory. In this process the machine
    counts as quiet: on a shared machine a busy moment would keep a measurement out of the cache with a warning line of
    its own (cachedir.store), and the tests here count the warnings a damaged or unwritable cache gives."""
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path / "eaglet-cache"))
    monkeypatch.setattr(cachedir, "_warned", set())
    monkeypatch.setattr(ops, "watch_load", lambda: lambda: None)
    return tmp_path / "eaglet-cache"


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
    dtype = ["--dtype", "float32"] if script in ("generate.py", "bench/bench.py") else []
    return subprocess.run([sys.executable, script, *dtype, *map(str, argv)], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def shown(err: str) -> list:
    """stderr's lines as a terminal shows them: a progress bar that erases itself (carriage returns) leaves nothing."""
    return [shown for line in err.split("\n") if (shown := line.rsplit("\r", 1)[-1].strip())]


def assert_one_line_exit_2(r, message):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = shown(r.stderr)
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
    assert_one_line_exit_2(run("bench/bench.py", "--checkpoint", root / "ckpt", "--modes", "none", "--prompts", prompts), "not MT-bench-format UTF-8 jsonl")


def test_bench_refuses_an_unknown_mode(dirs):
    root, _ = dirs
    # It once ran eagle2 under an unknown name (then "lookup") and reported it as that mode.
    assert_one_line_exit_2(run("bench/bench.py", "--checkpoint", root / "ckpt", "--modes", "none,medusa"), "unknown --modes 'medusa'")


def test_an_unknown_compile_setting(dirs):
    root, _ = dirs
    for script in ("generate.py", "bench/bench.py"):
        assert_one_line_exit_2(run(script, "--checkpoint", root / "ckpt", "--compile", "fast"), "invalid choice: 'fast' (choose from 'auto', 'max', 'packed')")


def test_bench_runs_on_the_shipped_mt_bench_questions(dirs):
    root, _ = dirs
    r = run("bench/bench.py", "--checkpoint", root / "ckpt", "--modes", "none", "--num-prompts", "2", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 conversations" in r.stdout


# ---------------------------------------------------------------- each case in-process where the CLI's main says it all

def cli(capsys, main, *argv) -> tuple:
    """(exit status, stderr's lines) of a CLI's main run in this process; generate.py and bench.py in fp32, so no
    dtype measurement speaks on stderr."""
    capsys.readouterr()
    status = main(["--dtype", "float32", *map(str, argv)] if main in (generate.main, bench.main) else list(map(str, argv)))
    return status, shown(capsys.readouterr().err)


def assert_one_error(result, message):
    status, lines = result
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (status, lines)


def with_config(root: Path, name: str, **changes) -> Path:
    config = json.loads((root / "ckpt" / "config.json").read_text())
    return broken_copy(root, name, "config.json", json.dumps(config | changes).encode())


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if the target starts to load: what is refused must be refused before the slow work."""
    def load_target(*args, **kw):
        raise AssertionError("the target was loaded before the bad input was refused")

    monkeypatch.setattr(eaglet, "load_target", load_target)


def test_config_with_a_value_of_the_wrong_type(dirs, capsys, no_loading):
    root, _ = dirs
    ckpt = with_config(root, "dim-as-text", dim="576")
    message = f'{ckpt / "config.json"} is not a model config (dim is "576", not an integer)'
    assert_one_error(cli(capsys, generate.main, "--checkpoint", ckpt), message)
    with pytest.raises(UsageError, match="dim is \"576\", not an integer"):
        eaglet.load_generator(ckpt, speculate="none", dtype="float32")
    for name, change, why in (("null-layers", {"n_layer": None}, "n_layer is null, not an integer"),
                              ("zero-heads", {"n_head": 0}, "n_head is 0, not positive"),
                              ("text-stops", {"stop_tokens": "2"}, 'stop_tokens is "2", not a list')):
        assert_one_error(cli(capsys, generate.main, "--checkpoint", with_config(root, name, **change)), why)


def test_checkpoint_without_a_tokenizer(dirs, capsys, no_loading):
    root, _ = dirs
    ckpt = root / "no-tokenizer"
    if not ckpt.exists():
        shutil.copytree(root / "ckpt", ckpt)
        (ckpt / "tokenizer.json").unlink()
    assert_one_error(cli(capsys, generate.main, "--checkpoint", ckpt), f"no tokenizer.model or tokenizer.json in {ckpt}")


def test_tokenizer_json_that_is_not_json(dirs, capsys, no_loading):
    root, _ = dirs
    ckpt = broken_copy(root, "tokenizer-not-json", "tokenizer.json", b"<html>not json</html>")
    assert_one_error(cli(capsys, generate.main, "--checkpoint", ckpt), f"{ckpt / 'tokenizer.json'} is not a tokenizer eaglet can read")


def test_unknown_chat_template_is_refused_before_the_model_loads(dirs, capsys, no_loading):
    root, _ = dirs
    ckpt = with_config(root, "unknown-template", chat_template="klingon")
    assert_one_error(cli(capsys, generate.main, "--checkpoint", ckpt), "chat_template 'klingon' is none of eaglet's: none, chatml")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-0.5"])
def test_temperature_that_is_not_a_finite_number_at_least_zero(dirs, capsys, value, no_loading):
    root, _ = dirs
    flag = f"--temperature={value}"  # "=": argparse takes a lone -inf for a flag
    assert_one_error(cli(capsys, generate.main, "--checkpoint", root / "ckpt", flag), f"--temperature must be finite and >= 0, got {value}")
    assert_one_error(cli(capsys, bench.main, "--checkpoint", root / "ckpt", "--modes", "none", flag), "--temperature must be finite")


def test_prompts_file_with_a_lone_surrogate(dirs, capsys, tmp_path, no_loading):
    root, _ = dirs
    prompts = tmp_path / "surrogate.jsonl"
    prompts.write_text('{"turns": ["fine"]}\n{"turns": ["half of a pair: \\ud83d"]}\n')  # JSON's escape of half an emoji
    message = f"prompts file {prompts}, conversation 2: a lone surrogate U+D83D at character 16 is not Unicode text"
    assert_one_error(cli(capsys, generate.main, "--checkpoint", root / "ckpt", "--prompts", prompts), message)
    assert_one_error(cli(capsys, bench.main, "--checkpoint", root / "ckpt", "--modes", "none", "--prompts", prompts), message)


def test_prompt_with_bytes_that_are_not_utf8(dirs):
    root, _ = dirs
    # Real argv bytes: Python hands them to the program as U+DC80..U+DCFF (surrogateescape).
    argv = [sys.executable, "generate.py", "--dtype", "float32", "--checkpoint", str(root / "ckpt"), "--prompt", b"caf\xe9 au lait"]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert_one_line_exit_2(r, "--prompt: byte 0xe9 at character 3 is not UTF-8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA runs --device cuda")
def test_device_cuda_without_cuda(dirs, capsys, no_loading):
    root, _ = dirs
    assert_one_error(cli(capsys, generate.main, "--checkpoint", root / "ckpt", "--device", "cuda"), "--device cuda: ")
    assert_one_error(cli(capsys, generate.main, "--checkpoint", root / "ckpt", "--device", "gpu"), "--device 'gpu' is not a device")
    with pytest.raises(UsageError, match="--device cuda:1: "):
        eaglet.load_generator(root / "ckpt", speculate="none", device="cuda:1")


def test_interactive_with_stdin_closed(dirs, capsys, monkeypatch, no_loading):
    root, _ = dirs
    monkeypatch.setattr(sys, "stdin", None)  # what Python makes of a closed fd 0 (`generate.py --interactive <&-`)
    assert_one_error(cli(capsys, generate.main, "--checkpoint", root / "ckpt", "--interactive"), "--interactive reads its prompts from stdin, which is closed")


def test_tree_flags_past_any_tree_are_refused_before_sizing(dirs, capsys, monkeypatch, no_loading):
    root, _ = dirs
    monkeypatch.setattr(sizing, "measure_tree", lambda *a, **k: pytest.fail("sized a tree for flags no tree can have"))
    base = ["--checkpoint", root / "ckpt", "--speculate", "eagle2", "--draft", root / "head"]
    status, lines = cli(capsys, generate.main, *base, "--num-draft-tokens", 10000)
    assert_one_error((status, lines), "--num-draft-tokens 10000 exceeds the 510 candidates of a tree of depth 6 and topk 10")
    assert "None" not in lines[0]
    assert_one_error(cli(capsys, generate.main, *base, "--num-draft-tokens", 300, "--depth", 3, "--topk", 10), "exceeds the 210 candidates of a tree of depth 3 and topk 10")
    assert_one_error(cli(capsys, generate.main, *base, "--depth", 100), "--depth 100 exceeds the 32 levels a cycle may have")
    assert_one_error(cli(capsys, generate.main, "--checkpoint", root / "ckpt", "--speculate", "lookup", "--speculate-k", 10000), "--speculate-k 10000 exceeds")
    assert_one_error(cli(capsys, bench.main, *base[:2], "--modes", "none,eagle2", "--depth", 100), "--depth 100 exceeds")


def test_bench_names_modes_in_its_message(dirs, capsys, no_loading):
    root, _ = dirs
    status, lines = cli(capsys, bench.main, "--checkpoint", root / "ckpt", "--modes", "bogus")
    assert_one_error((status, lines), "unknown --modes 'bogus'; choose from none, eagle2")
    assert "--speculate" not in lines[0]


def test_stop_tokens_outside_the_vocabulary(dirs, capsys, no_loading):
    root, _ = dirs
    ckpt = with_config(root, "stop-outside", stop_tokens=[2, 320])
    assert_one_error(cli(capsys, generate.main, "--checkpoint", ckpt), "stop_tokens holds 320, not a token id of the vocabulary [0, 320)")


# ---------------------------------------------------------------- the Python API: UsageError before torch sees the input

@pytest.fixture(scope="module")
def gen(dirs):
    root, _ = dirs
    return eaglet.load_generator(root / "ckpt", speculate="none", dtype="float32")[0]


@pytest.mark.parametrize("prompt, message", [
    ([1, 2, 320], "a prompt has token id 320, outside the vocabulary [0, 320)"),
    ([1, -1], "a prompt has token id -1, outside the vocabulary"),
    ([1.0, 2], "a prompt is a list of token ids (ints"),
    ([True, 2], "a prompt is a list of token ids (ints"),
    ("What is the capital of France?", "a prompt is a list of token ids"),
    ([], "the prompt is empty"),
])
def test_generate_refuses_prompts_that_are_not_token_ids_of_the_vocabulary(gen, prompt, message):
    with pytest.raises(UsageError) as e:
        gen.generate(prompt, 4)
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError) as e:
        gen.generate_batch([[5, 6], prompt], 4)
    assert message in str(e.value)


def test_generate_refuses_bad_stop_ids_sampling_and_lengths(gen):
    for kw, message in (({"stop_ids": [2, 1000]}, "stop_ids has token id 1000, outside the vocabulary"),
                        ({"stop_ids": ["2"]}, "stop_ids is a list of token ids"),
                        ({"sampling": Sampling(temperature=float("nan"))}, "--temperature must be finite and >= 0, got nan"),
                        ({"max_new_tokens": 0}, "--max-new-tokens must be an integer >= 1, got 0"),
                        ({"max_new_tokens": 2.5}, "--max-new-tokens must be an integer >= 1, got 2.5")):
        with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("[", r"\[")):
            gen.generate([1, 2, 3], **({"max_new_tokens": 4} | kw))
    assert gen.generate([1, 2, 3], 4, stop_ids={2}).token_ids  # a set of stop ids is fine


@pytest.mark.parametrize("prompts, message", [([], "generate_batch takes a non-empty list of prompts"),
                                              ("abc", "generate_batch takes a non-empty list of prompts"),
                                              ([[1, 2], [400]], "a prompt has token id 400")])
def test_generate_batch_refuses_an_empty_batch_and_bad_prompts(gen, prompts, message):
    with pytest.raises(UsageError, match=message):
        gen.generate_batch(prompts, 4)


@pytest.mark.parametrize("messages, message", [
    ("\ud800", "message 1's content: a lone surrogate U+D800 at character 0 is not Unicode text"),
    ([{"role": "user", "content": "fine"}, {"role": "assistant", "content": "caf\udce9"}], "message 2's content: byte 0xe9 at character 3 is not UTF-8"),
    ([{"role": "\udc80", "content": "hi"}], "message 1's role: byte 0x80 at character 0 is not UTF-8"),
    ([{"role": "user", "content": None}], "message 1's content must be a string, got None"),
    ([{"role": "user"}], "message 1's content must be a string, got None"),
    ([("user", "hi")], 'messages must be a list of {"role": ..., "content": ...} objects'),
    (5, 'messages must be a list of {"role": ..., "content": ...} objects, got 5'),
])
def test_chat_refuses_messages_that_are_not_unicode_text(gen, messages, message):
    with pytest.raises(UsageError) as e:
        gen.chat(messages, max_new_tokens=4)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_prompt_with_a_lone_surrogate_is_refused_before_loading(dirs, capsys, no_loading):
    root, _ = dirs
    assert_one_error(cli(capsys, generate.main, "--checkpoint", root / "ckpt", "--prompt", "ok", "--prompt", "\ud83d!"),
                     "--prompt: a lone surrogate U+D83D at character 0 is not Unicode text")


def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(dirs, gen, capsys):
    """top_p 1e-300 rounds to 0 in float32, where every token's mass before it reaches it: it samples what any tiny
    top_p does, the most likely token, from Python and from the command line."""
    logits = torch.randn(6, 320, generator=torch.Generator().manual_seed(0))
    for top_p in (1e-300, 1e-6):
        rule = Sampling(temperature=1.0, top_p=top_p)
        assert torch.equal(rule.probs(logits), torch.nn.functional.one_hot(logits.argmax(-1), 320).float())
        st = SpecState(None, 8, "cpu", vocab=320)  # a step reads the rule from its state's buffers
        st.set_rule(rule, sampling.key_of(0))
        for noise in (torch.zeros(6, 320, dtype=torch.float64), sampling.noise(st, torch.tensor(0), 6, 320)):
            assert torch.equal(sampling.draw(logits, rule.kind, st, noise), logits.argmax(-1))
    greedy = gen.generate([1, 2, 3], 8).token_ids
    assert gen.generate([1, 2, 3], 8, Sampling(temperature=1.0, top_p=1e-300)).token_ids == greedy
    root, _ = dirs
    answers = []
    for flags in ([], ["--temperature", "1", "--top-p", "1e-300"]):
        capsys.readouterr()
        assert generate.main(["--dtype", "float32", "--checkpoint", str(root / "ckpt"), "--no-chat", "--prompt", "Once upon a time",
                              "--max-new-tokens", "8", "--json", *flags]) == 0
        answers.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert answers[1] == answers[0] and len(answers[0]) > 1


def test_load_generator_refuses_a_dtype_it_cannot_run(dirs, no_loading):
    root, _ = dirs
    for dtype in ("int8", torch.int8, "float64"):
        with pytest.raises(UsageError, match="--dtype '(int8|float64)' is not one of float32, bfloat16, float16"):
            eaglet.load_generator(root / "ckpt", speculate="none", dtype=dtype)
    assert issubclass(UsageError, ValueError)


# ---------------------------------------------------------------- the cache directory: data from disk, never fatal

def warnings(err: str) -> list:
    return [line for line in err.splitlines() if line.startswith("warning: ")]


DAMAGED = {"not json": b"{\"cpu\": ", "not an object": b"[1, 2]", "not utf-8": b"{\"\xff\": 1}"}


@pytest.mark.parametrize("damage", [*DAMAGED, "damaged entry"])
def test_a_damaged_dtypes_json_is_named_measured_again_and_rewritten(own_cache, capsys, monkeypatch, damage):
    monkeypatch.setattr(dtypes, "native_bf16", lambda device="cpu": True)  # else the file is never read
    monkeypatch.setattr(dtypes, "measure_cpu", lambda: {"float32_ms": 2.0, "bfloat16_ms": 1.0})
    key = f"{dtypes.cpu_name()} | torch {torch.__version__}"
    own_cache.mkdir(parents=True)
    path = own_cache / dtypes.CACHE
    path.write_bytes(json.dumps({key: {"choice": "float64", "float32_ms": "x"}}).encode() if damage == "damaged entry" else DAMAGED[damage])
    assert dtypes.default_dtype("cpu", log=lambda s: None) == torch.bfloat16
    err = capsys.readouterr().err
    assert len(warnings(err)) == 1 and str(path) in warnings(err)[0] and "measured again" in warnings(err)[0], err
    assert json.loads(path.read_text())[key]["choice"] == "bfloat16"  # rewritten whole
    assert dtypes.default_dtype("cpu", log=lambda s: None) == torch.bfloat16 and capsys.readouterr().err == ""


@pytest.mark.parametrize("damage", [*DAMAGED, "damaged entry"])
def test_a_damaged_tree_sizes_json_is_named_measured_again_and_rewritten(dirs, own_cache, capsys, damage):
    root, _ = dirs
    own_cache.mkdir(parents=True)
    path = own_cache / sizing.CACHE
    if damage == "damaged entry":  # a real key, with costs that are not numbers
        eaglet.load_generator(root / "ckpt", root / "head", "eagle2", dtype="float32", log=lambda s: None)
        path.write_text(json.dumps({k: {"decode_ms": "fast", "verify": {}} for k in json.loads(path.read_text())}))
    else:
        path.write_bytes(DAMAGED[damage])
    capsys.readouterr()
    gen, _ = eaglet.load_generator(root / "ckpt", root / "head", "eagle2", dtype="float32", log=lambda s: None)
    err = capsys.readouterr().err
    assert len(warnings(err)) == 1 and str(path) in warnings(err)[0], err
    assert all(sizing.valid_costs(e) for e in json.loads(path.read_text()).values())
    assert gen.spec.num_draft_tokens >= 1


def test_a_damaged_compile_json_is_named_measured_again_and_rewritten(dirs, own_cache, capsys, monkeypatch):
    root, _ = dirs
    monkeypatch.setattr(inductor, "measure_step", lambda *a, **k: {"packed_ms": 2.0, "template_ms": 1.0})
    own_cache.mkdir(parents=True)
    path = own_cache / inductor.CACHE
    path.write_text("\x00\x00")
    target = checkpoint.load_model(root / "ckpt")
    assert inductor.choose("auto", target, log=lambda s: None) == "max"
    err = capsys.readouterr().err
    assert len(warnings(err)) == 1 and str(path) in warnings(err)[0], err
    assert [e["choice"] for e in json.loads(path.read_text()).values()] == ["max"]


def test_a_cache_directory_that_cannot_be_written_measures_without_saving(dirs, capsys, monkeypatch):
    root, _ = dirs
    read_only = Path("/sys/fs/eaglet-cache")  # sysfs refuses a new directory even to root, where chmod would not
    try:
        read_only.mkdir(parents=True)
    except OSError:
        pass
    else:
        read_only.rmdir()
        pytest.skip("needs Linux's read-only /sys")
    monkeypatch.setenv("EAGLET_CACHE", str(read_only))
    for _ in range(2):  # said once a process
        gen, _ = eaglet.load_generator(root / "ckpt", root / "head", "eagle2", dtype="float32", log=lambda s: None)
    err = capsys.readouterr().err
    assert len(warnings(err)) == 1 and warnings(err)[0].startswith(f"warning: {read_only}: cannot save measurements here ("), err
    assert warnings(err)[0].endswith("), so they are made again next run"), err
    assert gen.spec.num_draft_tokens >= 1


def test_a_full_cache_disk_measures_without_saving(dirs, own_cache, capsys, monkeypatch):
    root, _ = dirs

    def full(path, fill):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cachedir.atomic, "write", full)
    gen, _ = eaglet.load_generator(root / "ckpt", root / "head", "eagle2", dtype="float32", log=lambda s: None)
    err = capsys.readouterr().err
    assert warnings(err) == [f"warning: {own_cache}: cannot save measurements here (No space left on device), so they are made again next run"], err
    assert gen.spec.num_draft_tokens >= 1 and not (own_cache / sizing.CACHE).exists()


def test_cache_writes_leave_no_half_file(own_cache, monkeypatch):
    cachedir.store("x.json", "a", {"v": 1})

    def torn(path, text, encoding=None):
        path.write_bytes(text.encode()[:5])
        raise KeyboardInterrupt  # Ctrl-C mid-write

    monkeypatch.setattr(Path, "write_text", torn)
    with pytest.raises(KeyboardInterrupt):
        cachedir.store("x.json", "b", {"v": 2})
    monkeypatch.undo()
    assert json.loads((own_cache / "x.json").read_text()) == {"a": {"v": 1}}
    assert [p.name for p in own_cache.iterdir()] == ["x.json"]  # the temporary file went too


# ---------------------------------------------------------------- the default model's conversion on a full disk

@pytest.mark.parametrize("where", ["weights", "tokenizer"])
def test_default_model_conversion_on_a_full_disk(dirs, own_cache, capsys, monkeypatch, tmp_path, where):
    import safetensors.torch

    root, hf = dirs
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, hf, root / "hf")
    monkeypatch.setattr(checkpoint, "smollm2_gguf", lambda: gguf_path)  # the conversion path, on a tiny GGUF
    if where == "weights":  # safetensors reports ENOSPC as its own error type
        def save_file(*a, **k):
            raise safetensors.SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')
        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    else:
        def write_text(path, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr("convert_hf_checkpoint.atomic.write_text", write_text)
    status, lines = cli(capsys, generate.main, "--speculate", "none")
    assert_one_error((status, lines), f"converting the default model into {own_cache} failed: ")
    assert "No space left on device" in lines[0]
    assert list(own_cache.iterdir()) == []  # no partial checkpoint left behind
    with pytest.raises(UsageError, match="converting the default model"):
        eaglet.load_generator(speculate="none", dtype="float32")


# ---------------------------------------------------------------- an output that cannot be written

@pytest.mark.parametrize("output, flags, unbuffered", [("closed pipe", [], True), ("closed pipe", ["--json"], False),
                                                       ("/dev/full", [], False), ("/dev/full", ["--json"], True)])
def test_an_output_that_cannot_be_written_ends_without_a_traceback(dirs, output, flags, unbuffered):
    """`generate.py | head -c 1` (its reader gone) exits quietly with status 141, as a command killed by SIGPIPE does;
    `generate.py > /dev/full` says so in one line, status 1. Streamed or one JSON object, stdout buffered or not."""
    root, _ = dirs
    if output == "/dev/full" and not Path("/dev/full").exists():
        pytest.skip("needs Linux's /dev/full")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | ({"PYTHONUNBUFFERED": "1"} if unbuffered else {})
    if output == "closed pipe":
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first write: every write fails
    else:
        write = os.open("/dev/full", os.O_WRONLY)
    try:
        r = subprocess.run([sys.executable, "generate.py", "--dtype", "float32", "--checkpoint", str(root / "ckpt"), "--no-chat",
                            "--prompt", "Once upon a time", "--max-new-tokens", "8", *flags], cwd=REPO, stdout=write,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    finally:
        os.close(write)
    if output == "closed pipe":
        assert (r.returncode, shown(r.stderr)) == (141, []), r.stderr[-2000:]
    else:
        assert (r.returncode, shown(r.stderr)) == (1, ["error: cannot write the output: No space left on device"]), r.stderr[-2000:]


# ---------------------------------------------------------------- Ctrl-C: status 130, one line, no traceback

CLIS = ["generate.py", "bench/bench.py", "convert_hf_checkpoint.py", "quantize.py", "train/train_draft.py", "bench/calibration.py"]
# generate.py as its own __main__, with a decode step slowed enough to be interrupted in and a line on stderr at the
# first step: the marker to send Ctrl-C at, rather than a guess of how long loading takes.
SLOW_STEPS = """
import interrupt, runpy, sys, time
import generator
step = generator.plain_step
def slow(*args):
    if not getattr(slow, "said", False):
        slow.said = True
        print("generating", file=sys.stderr, flush=True)
    time.sleep(0.05)
    return step(*args)
generator.plain_step = slow
sys.argv = ["generate.py"] + sys.argv[1:]
runpy.run_path("generate.py", run_name="__main__")
"""


def start(argv: list, stdin=subprocess.DEVNULL) -> subprocess.Popen:
    # A process group of its own (start_new_session): Ctrl-C in a terminal reaches the whole group, children too. SIGINT
    # at its default, as a terminal's shell starts a command, even where the suite itself runs as a background job (which
    # a shell starts with SIGINT ignored, and an ignored signal stays ignored through exec).
    return subprocess.Popen([sys.executable, *map(str, argv)], cwd=REPO, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_line(proc, text: str, timeout: float = 300) -> list:
    """stderr's lines up to and including the first containing text (or the test fails at the timeout, never hangs).
    Read from the pipe a byte at a time: proc.stderr.readline() would pull later lines into its buffer, where select()
    cannot see them, and the wait would last until the process next writes (after the answer a test means to stop)."""
    lines, line, deadline, fd = [], b"", time.monotonic() + timeout, proc.stderr.fileno()
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 1.0)[0]:
            byte = os.read(fd, 1)
            if not byte:
                pytest.fail(f"the process ended before {text!r}: {''.join(lines)[-2000:]}")
            line += byte
            if byte != b"\n":
                continue
            lines.append(line.decode(errors="replace"))
            line = b""
            if text in lines[-1]:
                return lines
    proc.kill()
    pytest.fail(f"no {text!r} on stderr in {timeout} s: {''.join(lines)[-2000:]}")


def ctrl_c(proc, timeout: float = 120) -> tuple:
    """Ctrl-C to the process group -> (exit status, the rest of stderr)."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("Ctrl-C did not end the process")
    return proc.returncode, err


def assert_interrupted(status, err):
    assert status == 130 and shown(err) == ["interrupted"], (status, err[-3000:])


def test_ctrl_c_while_weights_load_is_an_interrupt_not_a_damaged_file(tmp_path):
    """safetensors makes each tensor through torch from its Rust loop; a KeyboardInterrupt raised in there came out as
    torch's ValueError, which loading reported as "model.safetensors is truncated or not a weights file" (and a user
    might delete a good file). Ctrl-C at a hundred points inside real loads: each one is a KeyboardInterrupt."""
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({f"w{i}": torch.full((4,), float(i)) for i in range(400)}, str(path))
    fastest = min(timed(weights.load_state, path) for _ in range(5))

    def load_interrupted_after(delay: float) -> str:
        outcome = "loaded"
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, delay)  # SIGALRM, relayed as a real SIGINT
                weights.load_state(path)
            except KeyboardInterrupt:
                outcome = "interrupted"
            except ValueError as e:
                outcome = str(e)
            signal.setitimer(signal.ITIMER_REAL, 0)
            time.sleep(0.01)  # a Ctrl-C that came after the load lands here
        except KeyboardInterrupt:
            pass
        return outcome

    relay = signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a command line
    try:
        outcomes = [load_interrupted_after(fastest * 0.5 * (i + 1) / 101) for i in range(100)]  # all inside a load
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, relay)
        signal.signal(signal.SIGINT, handler)
    assert not [o for o in outcomes if o not in ("loaded", "interrupted")], sorted(set(outcomes))[:3]
    assert outcomes.count("interrupted") >= 50, outcomes.count("interrupted")
    assert weights.load_state(path)["w399"][0] == 399  # and the file was good all along


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="the marker is torch's library in /proc/PID/maps")
@pytest.mark.parametrize("script", CLIS)
def test_ctrl_c_during_the_imports(script):
    proc = start([script, "--help"])
    deadline = time.monotonic() + 120
    while "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text():  # inside `import torch`, seconds before main
        assert proc.poll() is None and time.monotonic() < deadline, "torch never loaded"
        time.sleep(0.01)
    assert_interrupted(*ctrl_c(proc))


def test_ctrl_c_after_loading_at_the_interactive_prompt(dirs):
    root, _ = dirs
    proc = start(["generate.py", "--dtype", "float32", "--checkpoint", root / "ckpt", "--interactive"], stdin=subprocess.PIPE)
    wait_for_line(proc, "chat: ")  # loaded, waiting for a turn
    assert_interrupted(*ctrl_c(proc))


def test_ctrl_c_while_generating(dirs):
    root, _ = dirs
    proc = start(["-c", SLOW_STEPS, "--dtype", "float32", "--checkpoint", root / "ckpt", "--no-chat", "--prompt", "Once upon a time"])
    wait_for_line(proc, "generating")
    assert_interrupted(*ctrl_c(proc))


def test_ctrl_c_in_an_interactive_answer_stops_that_answer_only(dirs):
    root, _ = dirs
    proc = start(["-c", SLOW_STEPS, "--dtype", "float32", "--checkpoint", root / "ckpt", "--interactive"], stdin=subprocess.PIPE)
    proc.stdin.write("Tell me a long story.\n")
    proc.stdin.flush()
    wait_for_line(proc, "generating")
    os.killpg(proc.pid, signal.SIGINT)
    assert "[stopped]" in "".join(wait_for_line(proc, "[stopped]"))
    _, err = proc.communicate("/exit\n", timeout=120)  # the chat goes on, and leaves as asked
    assert proc.returncode == 0 and "Traceback" not in err, err
