# EAGLE-3 training (train_draft.py --arch eagle3): the unrolled training-time test computes what the draft
# computes at inference, training-time test beats 1-step training on deep draft levels, and the CLI trains a
# head that loads, resumes and stays lossless.
import json
import math

import pytest
import torch

import dtypes
from train import train_draft
from draft import Eagle3Head
from checkpoint import load_model
from eaglet import Generator, acceptance_metrics
from sampling import Sampling
from speculate import TreeSpec
from tokenizer import encode_prompt
from model import causal_mask, eagle3_taps
from test_train_draft import TRAIN_ARGS, write_tiny_checkpoint
from tokenizer import load_tokenizer
from weights import load_head

pytestmark = pytest.mark.usefixtures("single_thread")


@torch.no_grad()
def records(target, tokens, prompt_len: int) -> list:
    """Training records {tokens, prompt_len, hidden, fused}, the contract with the data side (distill.py),
    from one forward of the target with its EAGLE-3 taps set."""
    target.taps = eagle3_taps(target.args.n_layer)
    target.setup_caches(tokens.shape[1], batch=len(tokens))
    pos = torch.arange(tokens.shape[1])
    hidden, fused = target.hidden(tokens, pos, pos, causal_mask(pos, tokens.shape[1]))
    return [{"tokens": t, "prompt_len": prompt_len, "hidden": h, "fused": f} for t, h, f in zip(tokens, hidden, fused)]


@torch.no_grad()
@pytest.mark.parametrize("arch", ["eagle3", "eagle"])
def test_unrolled_steps_are_what_the_draft_computes(tiny_args, random_model, random_eagle3_head, random_head, arch):
    # Step i at slot j is a draft node at depth i+1 whose context is slots 0..j: computed here with the
    # inference head (KV cache, scratch slots, explicit mask) one node at a time.
    args = tiny_args(n_layer=4)
    target = random_model(args, seed=0)
    head = random_eagle3_head(args, seed=1) if arch == "eagle3" else random_head(args, seed=1)
    T, steps, g = 12, 3, torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 64, (1, T + 1 + steps), generator=g)
    fused = torch.randn(1, T, (3 if arch == "eagle3" else 1) * args.dim, generator=g)  # what step 0 reads
    embed = target.tok_embeddings.weight
    head.setup_caches(64)
    unrolled = list(train_draft.unrolled_steps(head, embed, tokens, fused, steps))
    head.layers[0].attention.kv_cache.k_cache.zero_()
    pos = torch.arange(T)
    context = head(tokens[:, 1:T + 1], embed, fused, pos, pos, causal_mask(pos, 64))
    assert torch.allclose(context, unrolled[0], atol=1e-5)
    for j in (0, 5, T - 1):
        h = context[:, j:j + 1]
        for i in range(1, steps):
            slot = torch.tensor([32 + i])  # scratch, past the context
            mask = torch.zeros(1, 64, dtype=torch.bool)
            mask[0, : j + 1] = True  # the context up to slot j (later context rows are not its past)
            mask[0, 33: 33 + i] = True  # its ancestors and itself
            h = head(tokens[:, j + 1 + i:j + 2 + i], embed, h, torch.tensor([j + i]), slot, mask)
            assert torch.allclose(h[0, 0], unrolled[i][0, j], atol=1e-5), (i, j)


@torch.no_grad()
def sampled_tokens(target, n: int, prompt_len: int, length: int, seed: int):
    """n random prompts continued by sampling from the target at T=1 -> [n, prompt_len + length]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, target.args.vocab_size, (n, prompt_len), generator=g)
    target.setup_caches(prompt_len + length, batch=n)
    for _ in range(length):
        pos = torch.arange(x.shape[1])
        logits, _ = target(x, pos, pos, causal_mask(pos, target.max_seq_length))
        x = torch.cat([x, torch.multinomial(torch.softmax(logits[:, -1], -1), 1, generator=g)], 1)
    return x


@pytest.fixture(scope="module")
def learnable_target(tiny_args, random_model, single_thread):
    # Weak residual branches and a sharp LM head: the next token depends mostly, not only, on the current
    # one (a bigram table predicts about 65% of greedy choices), so a small head can learn to draft deep.
    target = random_model(tiny_args(n_layer=4, block_size=256), seed=0).requires_grad_(False)
    with torch.no_grad():
        for layer in target.layers:
            layer.attention.wo.weight.mul_(0.02)
            layer.feed_forward.w2.weight.mul_(0.02)
        target.output.weight.mul_(4)
    return target


def train_head(target, data, tmp_path, ttt_steps: int):
    cfg = train_draft.TrainConfig(out=tmp_path / f"ttt{ttt_steps}", arch="eagle3", ttt_steps=ttt_steps, epochs=20, batch_size=8,
                                  lr=3e-3, warmup_steps=20, save_every=10**6, seed=0, autocast="off")  # fp32: the same numbers on any CPU
    cfg.out.mkdir()
    assert train_draft.train(cfg, target, data, torch.zeros(0, dtype=torch.long), math.inf) == 20 * 16  # 128 rows, 8 a step
    return load_head(cfg.out / "head", target.args).eval()


def test_training_time_test_raises_deep_acceptance(learnable_target, tmp_path):
    target = learnable_target
    data = records(target, sampled_tokens(target, 128, 4, 60, seed=1), prompt_len=4)
    g = torch.Generator().manual_seed(3)
    held_out = [torch.randint(0, 64, (6,), generator=g).tolist() for _ in range(32)]
    spec = TreeSpec("eagle2", depth=4, topk=1, num_draft_tokens=4)  # a chain: per-depth acceptance is plain
    rates = {}
    for steps in (1, 3):  # equal optimizer steps, data and seed
        head, hist = train_head(target, data, tmp_path, steps), [0] * 5
        vanilla = Generator(target)
        for prompt in held_out:
            result = Generator(target, spec, head=head).generate(prompt, 32, Sampling())
            assert result.token_ids == vanilla.generate(prompt, 32, Sampling()).token_ids
            hist = [a + b for a, b in zip(hist, result.accept_hist)]
        rates[steps] = acceptance_metrics(hist, 0, sum(hist))["accept_rate_per_depth"]
        assert sum(hist[2:]) >= 20, (steps, hist)  # enough cycles reach depth 2 for a rate there
    # measured (fp32, this CPU): depth 2: 0.08 -> 0.63, depth 3: 0.32 -> 0.58 (depth 1: 0.55 -> 0.54)
    assert rates[3][1] > rates[1][1] + 0.3 and rates[3][2] > rates[1][2] + 0.15, rates


@pytest.fixture(scope="module")
def trained_eagle3(tmp_path_factory):
    ckpt, out = tmp_path_factory.mktemp("tiny3"), tmp_path_factory.mktemp("run3")
    write_tiny_checkpoint(ckpt)
    common = ["--checkpoint", str(ckpt), "--out", str(out), *TRAIN_ARGS, "--arch", "eagle3", "--ttt-steps", "3", "--draft-vocab", "200"]
    assert train_draft.main([*common, "--epochs", "4"]) == 0
    assert train_draft.main([*common, "--epochs", "8", "--resume"]) == 0
    return ckpt, out, [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_cli_trains_a_lossless_eagle3_head(trained_eagle3):
    ckpt, out, log = trained_eagle3
    assert [r["step"] for r in log] == list(range(1, 8 * 3 + 1)) and all(len(r["acc_steps"]) == 3 for r in log)
    assert sum(r["loss"] for r in log[-3:]) < 0.8 * sum(r["loss"] for r in log[:3])
    config = json.loads((out / "head" / "config.json").read_text())
    assert config["kind"] == "eagle3" and config["draft_vocab_size"] == 200 and config["taps"] == [1, 1, 0]
    target, tok = load_model(ckpt), load_tokenizer(ckpt)
    head = load_head(out / "head", target.args)
    assert isinstance(head, Eagle3Head)
    prompt = encode_prompt(tok, target.args, [{"role": "user", "content": "Explain"}], chat=True)
    spec = TreeSpec("eagle2", depth=4, topk=4, num_draft_tokens=12)
    assert Generator(target, spec, head=head).generate(prompt, 32, Sampling()).token_ids == Generator(target).generate(prompt, 32, Sampling()).token_ids


def test_init_from_an_eagle3_head_keeps_its_draft_vocabulary(trained_eagle3, tmp_path):
    # The same head with its draft vocabulary (and LM head rows) in another order is the same drafter: fine-tuning
    # from either starts at the same loss. Pairing its rows with a vocabulary counted afresh would not.
    ckpt, out, _ = trained_eagle3
    from safetensors.torch import load_file, save_file

    state = load_file(str(out / "head" / "model.safetensors"))
    order = torch.randperm(len(state["draft_vocab"]), generator=torch.Generator().manual_seed(0))
    state["draft_vocab"], state["lm_head.weight"] = state["draft_vocab"][order], state["lm_head.weight"][order]
    (tmp_path / "perm").mkdir()
    save_file(state, str(tmp_path / "perm" / "model.safetensors"))
    (tmp_path / "perm" / "config.json").write_text((out / "head" / "config.json").read_text())
    first_loss = {}
    for name, init in (("same", out / "head"), ("permuted", tmp_path / "perm")):
        argv = ["--checkpoint", str(ckpt), "--data-dir", str(out), "--out", str(tmp_path / name), *TRAIN_ARGS, "--arch", "eagle3",
                "--ttt-steps", "3", "--draft-vocab", "200", "--train-only", "--epochs", "1", "--init", str(init)]
        assert train_draft.main(argv) == 0
        first_loss[name] = json.loads((tmp_path / name / "train_log.jsonl").read_text().splitlines()[0])["loss"]
    assert first_loss["permuted"] == pytest.approx(first_loss["same"], rel=1e-4)


def test_bf16_autocast_follows_the_cpu():
    flags = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    assert dtypes.native_bf16(torch.device("cpu")) == (" avx512_bf16" in flags or " amx_tile" in flags)


def test_the_served_head_folds_the_input_scale_into_fc(tiny_args, random_model, random_eagle3_head, tmp_path):
    # Training reads fused * scale (the target's massive residual dimensions made comparable); the head written for
    # serving must compute the same fc output from the raw fused states, in the official format.
    args = tiny_args(n_layer=6)
    head = random_eagle3_head(args, seed=0)
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(2, 5, 3 * args.dim, generator=g) * torch.logspace(0, 3, 3 * args.dim)  # dims 1 to 1000 apart
    scale = train_draft.fused_scale([{"fused": f} for f in fused])
    assert torch.allclose((fused * scale).pow(2).mean((0, 1)), torch.ones(3 * args.dim), rtol=1e-4)
    opt = torch.optim.AdamW(head.parameters())
    train_draft.save_state(tmp_path, head, opt, 0, scale)
    served = load_head(tmp_path / "head", args)
    assert torch.allclose(served.fc(fused), head.fc(fused * scale), rtol=1e-4, atol=1e-3)
    state = torch.load(tmp_path / "train_state.pt", weights_only=True)
    assert torch.equal(state["fc_scale"], scale) and torch.equal(state["head"]["fc.weight"], head.fc.weight)
