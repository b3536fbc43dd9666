# Tensor parallelism on the CPU (gloo, 2 ranks): generate.py under torchrun gives the single-process
# tokens, rank 0 alone prints, unshardable models are refused, and world size 1 changes nothing.
import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file

import generate
import tp
from draft import EagleHead
from hf_fixtures import write_tokenizer
from model import ModelArgs, Transformer, causal_mask
from weights import save_head

REPO = Path(__file__).resolve().parents[1]
VOCAB = 320
TINY = dict(dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=128, vocab_size=VOCAB, block_size=256)
ARGV = ["--prompt", "The quick brown fox jumps", "--max-new-tokens", "24", "--json", "--dtype", "float32"]  # exact: fp32


def write_checkpoint(out_dir: Path, **overrides) -> Path:
    args = ModelArgs(**{**TINY, **overrides})
    out_dir.mkdir()
    args.save(out_dir / "config.json")
    torch.manual_seed(0)
    save_file({k: v.contiguous() for k, v in Transformer(args).state_dict().items()}, str(out_dir / "model.safetensors"))
    write_tokenizer(out_dir, VOCAB)
    return out_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    torch.manual_seed(1)
    save_head(EagleHead(ModelArgs(**{**TINY, "n_layer": 1})), root / "head")
    return write_checkpoint(root / "target"), root / "head"


def single_process(argv, capsys) -> dict:
    assert generate.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(argv) -> list:
    """generate.py on 2 gloo ranks with torchrun's environment, each rank's output kept apart."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        procs.append(subprocess.Popen([sys.executable, "generate.py", *argv], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return [(p, *p.communicate(timeout=120)) for p in procs]


def test_tp_greedy_matches_single_process(dirs, capsys):
    target, _ = dirs
    argv = ["--checkpoint", str(target), *ARGV]
    reference = single_process(argv, capsys)["token_ids"]
    assert len(reference) == 24
    (p0, out0, err0), (p1, out1, err1) = two_ranks(argv)
    assert p0.returncode == 0 and p1.returncode == 0, err0 + err1
    assert json.loads(out0)["token_ids"] == reference
    assert out1 == ""  # rank 1 generates too, but prints nothing


def test_tp_eagle2_under_torchrun_matches_single_process(dirs, capsys):
    target, head = dirs
    tree = ["--num-draft-tokens", "8", "--depth", "3", "--topk", "4"]
    argv = ["--checkpoint", str(target), "--speculate", "eagle2", "--draft", str(head), *tree, *ARGV]
    reference = single_process(argv, capsys)
    assert reference["cycles"] > 0
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "generate.py", *argv],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout  # one JSON object: rank 0's
    out = json.loads(lines[0])
    assert out["token_ids"] == reference["token_ids"] == single_process(["--checkpoint", str(target), *ARGV], capsys)["token_ids"]
    assert out["accept_len_hist"] == reference["accept_len_hist"]


def test_a_batch_under_torchrun_is_each_prompt_alone(dirs, capsys):
    """Two prompts in one batch on 2 ranks: each row's tokens are its prompt's single-process ones (eagle2 and
    vanilla). Before tp.batch_collectives, vmap's fallback left the all-reduces undone: wrong tokens."""
    target, head = dirs
    prompts = ["The quick brown fox jumps", "A"]
    for mode in (["--speculate", "eagle2", "--draft", str(head), "--num-draft-tokens", "8", "--depth", "3", "--topk", "4"], []):
        argv = ["--checkpoint", str(target), *mode, *ARGV[2:]]
        alone = [single_process([*argv, "--prompt", p], capsys)["token_ids"] for p in prompts]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "generate.py",
                            *argv, *(a for p in prompts for a in ("--prompt", p))], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        rows = [json.loads(line) for line in r.stdout.strip().splitlines()]  # rank 0's, one object per prompt
        assert [row["token_ids"] for row in rows] == alone, mode


@pytest.mark.parametrize("rank", [0, 1])
def test_unshardable_model_is_one_line_exit_2(tmp_path, capsys, rank):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    target = write_checkpoint(tmp_path / "mqa", n_local_heads=1)
    # A fake 2-rank group in this process: the refusal comes before any collective.
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        assert generate.main(["--checkpoint", str(target), *ARGV]) == 2
    finally:
        dist.destroy_process_group()
    out, err = capsys.readouterr()
    expected = "error: tensor parallelism over 2 ranks needs n_local_heads divisible by 2, got 1\n"
    assert (out, err) == ("", expected if rank == 0 else "")


class Int8Linear(torch.nn.Module):
    """The int8 layout tp.py shards: an int8 weight [out, in] and one scale per output channel."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        scales = w.abs().amax(1) / 127
        self.register_buffer("weight", torch.round(w / scales[:, None]).to(torch.int8))
        self.register_buffer("scales", scales)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype)) * self.scales


def quantize_layers(model: Transformer, linear_type):
    for layer in model.layers:
        for module, names in ((layer.attention, ["wqkv", "wo"]), (layer.feed_forward, ["w13", "w2"])):
            for name in names:
                setattr(module, name, linear_type(getattr(module, name)))


@torch.no_grad()
@pytest.mark.parametrize("linear_type", [None, Int8Linear])
def test_shards_sum_to_the_whole_layer(linear_type):
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**TINY))
    if linear_type:
        quantize_layers(model, linear_type)
    shards = [tp.shard_model(copy.deepcopy(model), rank, 2) for rank in range(2)]
    x, pos = torch.randn(1, 5, TINY["dim"]), torch.arange(5)
    mask = causal_mask(pos, 16)
    for m in [model, *shards]:
        m.setup_caches(16)
    rope = model.rope[pos][None]
    attn, ffn = [sum(m.layers[0].attention(x, rope, pos, mask) for m in shards), sum(m.layers[0].feed_forward(x) for m in shards)]
    assert shards[0].layers[0].attention.kv_cache.k_cache.shape[1] == TINY["n_local_heads"] // 2
    torch.testing.assert_close(attn, model.layers[0].attention(x, rope, pos, mask))
    torch.testing.assert_close(ffn, model.layers[0].feed_forward(x))


def test_packed_int4_is_refused():
    class Int4Linear(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.register_buffer("weight", torch.zeros(linear.weight.shape[0] // 8, 32, dtype=torch.int32))

    model = Transformer(ModelArgs(**TINY))
    quantize_layers(model, Int4Linear)
    with pytest.raises(ValueError, match="supports float and int8 .* not Int4Linear"):
        tp.check_shardable(model, 2)


def test_world_size_one_leaves_model_untouched(tmp_path):
    model = Transformer(ModelArgs(**TINY))
    modules, tensors = list(model.modules()), list(model.parameters())
    assert tp.apply_tp(model) is model  # no process group
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert tp.maybe_init_dist() is None
        assert tp.apply_tp(model) is model
    finally:
        dist.destroy_process_group()
    assert list(model.modules()) == modules
    assert all(a is b for a, b in zip(model.parameters(), tensors, strict=True))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert model.layers[0].attention.n_head == TINY["n_head"]


def test_tp_sizes_one_tree_for_all_ranks(dirs, capsys, tmp_path, monkeypatch):
    # Each rank times its own forwards; rank 0's choice is broadcast, or the ranks would verify
    # different trees and their collectives would disagree.
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path))
    target, head = dirs
    argv = ["--checkpoint", str(target), "--speculate", "eagle2", "--draft", str(head), *ARGV]
    (p0, out0, err0), (p1, out1, err1) = two_ranks(argv)
    assert p0.returncode == 0 and p1.returncode == 0, err0 + err1
    assert json.loads(out0)["token_ids"] == single_process(["--checkpoint", str(target), *ARGV], capsys)["token_ids"]
    assert "sizing the draft tree" in err0 and "sizing" not in err1
    (entry,) = json.loads((tmp_path / "tree_sizes.json").read_text()).values()
    assert set(entry) == {"decode_ms", "verify", "level"}
