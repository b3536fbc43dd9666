# EAGLE-3 heads: an official-format head converts and matches a reference written here from the description
# (reference-notes 2.10-2.11), misfits are refused in one line, and with an EAGLE-3 head speculation stays
# lossless: fp32 greedy equals vanilla, sampling follows the target's distribution, the compiled cycle runs. So does an
# EAGLE-1/2 head that reads the same fused states beside the post-norm one (draft.EagleHead's taps).
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import convert_hf_checkpoint as convert
import draft
import weights
import generate
from checkpoint import load_model
from tokenizer import encode_prompt
from eaglet import Generator
from sampling import Sampling
from speculate import TreeSpec
from hf_fixtures import write_hf_llama, write_official_eagle3_head
from model import causal_mask, eagle3_taps

ROOT = Path(__file__).resolve().parents[1]
GREEDY = Sampling()

# ---------------------------------------------------------------- conversion and parity


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    """(HF model, our converted target dir) of a 4-layer GQA model."""
    tmp = tmp_path_factory.mktemp("eagle3-target")
    model = write_hf_llama(tmp / "hf", n_layer=4, n_head=4, n_kv=2, tied=True, seed=0)
    convert.convert_hf(tmp / "hf", tmp / "ours")
    return model.float(), tmp / "ours"


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half_rope(x, pos, theta):
    """HF RoPE on x [T, H, D]: dims i and i + D/2 rotate together."""
    d = x.shape[-1]
    angles = pos[:, None].double() * (1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    cos, sin = (torch.cat([f(angles)] * 2, -1).float()[:, None] for f in (torch.cos, torch.sin))
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def reference_layer(w: dict, cfg: dict, emb, h, pos):
    """The official midlayer on rows [T, dim], each attending to itself and the rows before it."""
    eps, n_head, n_kv = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // n_head
    x = torch.cat([rms(emb, w["midlayer.input_layernorm.weight"], eps), rms(h, w["midlayer.hidden_norm.weight"], eps)], -1)
    q, k, v = (x @ w[f"midlayer.self_attn.{c}_proj.weight"].T for c in "qkv")
    q = rotate_half_rope(q.view(len(x), n_head, d), pos, cfg["rope_theta"])
    k = rotate_half_rope(k.view(len(x), n_kv, d), pos, cfg["rope_theta"]).repeat_interleave(n_head // n_kv, 1)
    v = v.view(len(x), n_kv, d).repeat_interleave(n_head // n_kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(len(x), len(x), dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(len(x), -1)
    h = h + attn @ w["midlayer.self_attn.o_proj.weight"].T
    y = rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
    return h + (F.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T


@torch.no_grad()
def test_official_eagle3_head_matches_reference(hf_target, tmp_path):
    hf_model, target_dir = hf_target
    w = write_official_eagle3_head(tmp_path / "official", hf_model, seed=5)
    cfg = json.loads((tmp_path / "official" / "config.json").read_text())
    assert convert.main(["--checkpoint-dir", str(tmp_path / "official"), "--eagle", "--target", str(target_dir), "--out", str(tmp_path / "head")]) == 0
    target = load_model(target_dir)
    head = weights.load_head(tmp_path / "head", target.args)
    assert head.kind == "eagle3" and head.taps == eagle3_taps(4) == (2, 2, 1)
    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert saved["kind"] == "eagle3" and saved["draft_vocab_size"] == 96 and saved["taps"] == [2, 2, 1]

    T, g = 11, torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 320, (T + 1,), generator=g)
    emb = target.tok_embeddings(tokens)
    fused = torch.randn(T, 3 * 64, generator=g)
    pos = torch.arange(T + 1)
    # Context rows read fc(fused); one more draft level reads the layer's own output at the last row.
    ref_ctx = reference_layer(w, cfg, emb[:T], fused @ w["fc.weight"].T, pos[:T])
    ref_all = reference_layer(w, cfg, emb, torch.cat([fused @ w["fc.weight"].T, ref_ctx[-1:]]), pos)
    ref_logits = rms(ref_all, w["norm.weight"], cfg["rms_norm_eps"]) @ w["lm_head.weight"].T
    ref_ids = ref_logits.argmax(-1) + w["d2t"][ref_logits.argmax(-1)]

    head.setup_caches(64)
    ours_ctx = head(tokens[None, :T], target.tok_embeddings.weight, fused[None], pos[:T], pos[:T], causal_mask(pos[:T], 64))[0]
    last = pos[T:]
    ours_next = head(tokens[None, T:], target.tok_embeddings.weight, ours_ctx[None, -1:], last, last, causal_mask(last, 64))[0]
    ours = torch.cat([ours_ctx, ours_next])
    assert (ours - ref_all).abs().max().item() < 1e-5
    logits = head.logits(ours, target.output)
    assert (logits - ref_logits).abs().max().item() < 1e-5
    assert torch.equal(head.target_ids(logits.argmax(-1)), ref_ids)
    assert bool(w["t2d"][ref_ids].all())


@pytest.mark.parametrize("override, message", [({"hidden_size": 96}, "hidden size 96"), ({"vocab_size": 321}, "vocabulary 321")])
def test_misfit_eagle3_head_is_refused_in_one_line(hf_target, tmp_path, capsys, override, message):
    hf_model, target_dir = hf_target
    write_official_eagle3_head(tmp_path / "official", hf_model, **override)
    argv = ["--checkpoint-dir", str(tmp_path / "official"), "--eagle", "--out", str(tmp_path / "head")]
    assert convert.main([*argv, "--target", str(target_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert convert.main(argv) == 0  # without a target nothing is checked; generate.py refuses it then
    capsys.readouterr()
    # --dtype: a first run on a fresh machine would also report its dtype measurement on stderr
    gen = ["--dtype", "float32", "--checkpoint", str(target_dir), "--draft", str(tmp_path / "head"), "--speculate", "eagle2", "--max-new-tokens", "4",
           "--depth", "2", "--topk", "2", "--num-draft-tokens", "2"]
    result = subprocess.run([sys.executable, "generate.py", *gen], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


def test_eagle3_head_keeps_its_vocabulary(hf_target, tmp_path, capsys):
    hf_model, target_dir = hf_target
    write_official_eagle3_head(tmp_path / "official", hf_model)
    convert.convert_eagle(tmp_path / "official", tmp_path / "head", target_dir)
    argv = ["--dtype", "float32", "--checkpoint", str(target_dir), "--draft", str(tmp_path / "head"), "--speculate", "eagle2",
            "--max-new-tokens", "4", "--depth", "2", "--topk", "2", "--num-draft-tokens", "2"]
    assert generate.main([*argv, "--draft-vocab", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "own vocabulary of 96" in err, err
    assert generate.main([*argv, "--json"]) == 0


def test_broken_d2t_is_refused(hf_target, tmp_path):
    hf_model, target_dir = hf_target
    w = write_official_eagle3_head(tmp_path / "official", hf_model)
    w["d2t"][3] = w["d2t"][2] + 1  # draft ids 2 and 3 now map to one target id
    torch.save(w, tmp_path / "official" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="onto one id twice"):
        convert.convert_eagle(tmp_path / "official", tmp_path / "head", target_dir)


# ---------------------------------------------------------------- fp32 greedy: lossless with an EAGLE-3 head

NEW_TOKENS = 60
SPECS = {
    "eagle2-6-10-16": TreeSpec("eagle2", 6, 10, 16),
    "eagle2-3-4-8": TreeSpec("eagle2", 3, 4, 8),
    "eagle": TreeSpec.static(),
}


@pytest.fixture(scope="module", params=["gqa", "tied"])
def tiny(request, single_thread, tiny_args, random_model, random_eagle3_head):
    kw = dict(n_head=4, n_local_heads=2) if request.param == "gqa" else dict(n_head=4, n_local_heads=4, tie_embeddings=True)
    args = tiny_args(n_layer=4, **kw)
    target = random_model(args, seed=0)
    prompt = torch.randint(0, args.vocab_size, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    # a draft vocabulary of 48 of the 64 ids, so some target argmaxes cannot be drafted
    head = random_eagle3_head(args, seed=1, draft_vocab=torch.randperm(64, generator=torch.Generator().manual_seed(2))[:48])
    return SimpleNamespace(target=target, prompt=prompt, head=head, ref=Generator(target).generate(prompt, NEW_TOKENS, GREEDY).token_ids)


@pytest.mark.parametrize("name", SPECS)
def test_greedy_with_eagle3_head_reproduces_vanilla(tiny, name):
    assert len(set(tiny.ref)) >= 10
    result = Generator(tiny.target, SPECS[name], head=tiny.head).generate(tiny.prompt, NEW_TOKENS, GREEDY)
    assert result.token_ids == tiny.ref
    assert sum(result.accept_hist[1:]) > 0  # some drafts were accepted, so the tree path was exercised


@pytest.mark.parametrize("name", SPECS)
def test_greedy_with_eagle3_head_stops_where_vanilla_stops(tiny, name):
    i = next(i for i in range(5, len(tiny.ref)) if tiny.ref[i] not in tiny.ref[:i])
    stop = [tiny.ref[i]]
    assert Generator(tiny.target, SPECS[name], head=tiny.head).generate(tiny.prompt, NEW_TOKENS, GREEDY, stop).token_ids == tiny.ref[: i + 1]


def test_max_new_tokens_inside_an_eagle3_cycle_is_exact(tiny):
    gen, cut = Generator(tiny.target, SPECS["eagle2-6-10-16"], head=tiny.head), 0
    for n in range(2, 24):
        result = gen.generate(tiny.prompt, n, GREEDY)
        assert result.token_ids == tiny.ref[:n]
        cut += sum((a + 1) * c for a, c in enumerate(result.accept_hist)) > n - 1
    assert cut  # at least one run's last cycle committed more than was asked for


def test_eagle1_head_after_an_eagle3_head_on_one_target(tiny, random_head):
    # the Generator sets target.taps for its head; an EAGLE-1/2 head sharing the target must get post-norm states back
    Generator(tiny.target, SPECS["eagle2-3-4-8"], head=tiny.head)
    gen = Generator(tiny.target, SPECS["eagle2-3-4-8"], head=random_head(tiny.target.args, seed=1))
    assert tiny.target.taps == () and gen.generate(tiny.prompt, NEW_TOKENS, GREEDY).token_ids == tiny.ref


def test_compiled_eagle3_cycle_matches_eager(tiny, tiny_args):
    import torch._dynamo

    spec = TreeSpec("eagle2", 3, 4, 8)
    eager = Generator(tiny.target, spec, head=tiny.head).generate(tiny.prompt, 24, GREEDY).token_ids
    torch._dynamo.reset()
    compiled = Generator(tiny.target, spec, head=tiny.head, compile=True)
    assert compiled.generate(tiny.prompt, 24, GREEDY).token_ids == eager == tiny.ref[:24]
    with torch._dynamo.config.patch(error_on_recompile=True):
        other = tiny.prompt[:7]
        assert compiled.generate(other, 24, GREEDY).token_ids == Generator(tiny.target).generate(other, 24, GREEDY).token_ids


# ---------------------------------------------------------------- an EAGLE-1/2 head that reads the fused states too

def random_fused_head(args, seed: int) -> draft.EagleHead:
    """An EAGLE-1/2 head that also reads the states entering the official EAGLE-3 layers at the first draft level."""
    head = draft.EagleHead(dataclasses.replace(args, n_layer=1), taps=(args.n_layer, *eagle3_taps(args.n_layer)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))  # norms near 1
    return head.eval()


@pytest.mark.parametrize("name", SPECS)
def test_greedy_with_fused_input_head_reproduces_vanilla(tiny, name):
    head = random_fused_head(tiny.target.args, seed=3)
    result = Generator(tiny.target, SPECS[name], head=head).generate(tiny.prompt, NEW_TOKENS, GREEDY)
    assert result.token_ids == tiny.ref and sum(result.accept_hist[1:]) > 0
    assert tiny.target.taps == (4, 2, 2, 1)  # the verify handed over the post-norm and the fused states


def test_compiled_fused_input_cycle_matches_eager(tiny):
    import torch._dynamo

    head, spec = random_fused_head(tiny.target.args, seed=3), TreeSpec("eagle2", 3, 4, 8)
    eager = Generator(tiny.target, spec, head=head).generate(tiny.prompt, 24, GREEDY)
    torch._dynamo.reset()
    compiled = Generator(tiny.target, spec, head=head, compile=True).generate(tiny.prompt, 24, GREEDY)
    assert compiled.token_ids == eager.token_ids == tiny.ref[:24] and compiled.accept_hist == eager.accept_hist


def test_fused_input_head_saves_loads_and_must_fit(tiny, tmp_path):
    head = random_fused_head(tiny.target.args, seed=3)
    weights.save_head(head, tmp_path / "head")
    loaded = weights.load_head(tmp_path / "head", tiny.target.args)
    assert loaded.kind == "eagle" and loaded.taps == (4, 2, 2, 1)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps(cfg | {"taps": [3, 2, 2, 1]}))  # not the post-norm state first
    with pytest.raises(ValueError, match=r"taps \[3, 2, 2, 1\] do not fit the target's 4 layers"):
        weights.load_head(tmp_path / "head", tiny.target.args)


def test_greedy_with_random_eagle3_head_reproduces_vanilla_on_smollm2(smollm2, random_eagle3_head):
    target, tok = smollm2
    args = target.args
    prompt = encode_prompt(tok, args, [{"role": "user", "content": "Name three rivers in Europe and say one thing about each."}], chat=True)
    ref = Generator(target).generate(prompt, 40, GREEDY, args.stop_tokens).token_ids
    head = random_eagle3_head(args, seed=0, draft_vocab=torch.arange(16384), std=0.02)
    result = Generator(target, TreeSpec("eagle2", 6, 10, 16), head=head).generate(prompt, 40, GREEDY, args.stop_tokens)
    assert result.token_ids == ref


# ---------------------------------------------------------------- sampling follows the target's distribution

from test_speculative import PROMPT, V, exact_distribution, fresh_bonus, sample_first_tokens  # noqa: E402,F401

T1 = Sampling(1.0)


@pytest.fixture(scope="module")
def small_vocab(single_thread, tiny_args, random_model, random_eagle3_head):
    args = tiny_args(dim=32, n_layer=4, n_head=4, n_local_heads=2, intermediate_size=64, vocab_size=V, block_size=64)
    target = random_model(args, seed=0)
    head = random_eagle3_head(args, seed=1)
    return SimpleNamespace(target=target, generator=lambda: Generator(target, TreeSpec("eagle2", 3, 4, 10), head=head))


@pytest.mark.parametrize("sampling", [T1, Sampling(0.7, top_p=0.9)], ids=["T1", "T0.7-top-p0.9"])
def test_eagle3_sampling_follows_the_target_distribution(small_vocab, chi2_pvalue, sampling):
    counts, hist = sample_first_tokens(small_vocab.generator(), sampling)
    tau = (hist * torch.arange(1, len(hist) + 1)).sum() / hist.sum()
    assert tau > 1.2 and hist[0] > 0  # cycles both accept and reject drafts, so the test means something
    assert chi2_pvalue(counts, exact_distribution(small_vocab.target, sampling, PROMPT)) > 1e-3


def test_eagle3_sampling_test_rejects_a_fresh_bonus_draw(small_vocab, chi2_pvalue, fresh_bonus):
    counts, _ = sample_first_tokens(small_vocab.generator(), T1)
    assert chi2_pvalue(counts, exact_distribution(small_vocab.target, T1, PROMPT)) < 1e-3


def test_eagle3_head_taps_must_fit_the_target(hf_target, tmp_path):
    hf_model, target_dir = hf_target
    write_official_eagle3_head(tmp_path / "official", hf_model)
    convert.convert_eagle(tmp_path / "official", tmp_path / "head", target_dir)  # taps [2, 2, 1] of 4 layers
    args = load_model(target_dir).args
    with pytest.raises(ValueError, match=r"taps \[2, 2, 1\] do not fit the target's 2 layers"):
        weights.load_head(tmp_path / "head", dataclasses.replace(args, n_layer=2))
    convert.convert_eagle(tmp_path / "official", tmp_path / "untapped")  # no target: the target's official layers at load
    assert "taps" not in json.loads((tmp_path / "untapped" / "config.json").read_text())
    assert weights.load_head(tmp_path / "untapped", dataclasses.replace(args, n_layer=30)).taps == (2, 15, 27)
