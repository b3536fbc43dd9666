# train_draft.py end to end on a tiny random chatml target: self-written data, loss going down, --resume,
# and a head that loads, stays lossless under eagle2 and beats an untrained head on acceptance.
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from train import distill
from train import train_draft
from draft import EagleHead
from checkpoint import load_model
from eaglet import Generator
from sampling import Sampling
from speculate import TreeSpec
from tokenizer import encode_prompt
from model import ModelArgs, Transformer
from tokenizer import load_tokenizer
from weights import load_head, save_head

TRAIN_ARGS = ["--num-prompts", "6", "--max-request-tokens", "24", "--max-answer-tokens", "48", "--gen-batch", "4",
              "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "3", "--save-every", "5", "--device", "cpu",
              "--dtype", "float32"]  # the same data on every CPU, whichever dtype it would choose
STEPS_PER_EPOCH = 3  # 6 conversations, 2 per step
SPEC = TreeSpec("eagle2", depth=4, topk=4, num_draft_tokens=12)
pytestmark = pytest.mark.usefixtures("single_thread")


def write_tiny_checkpoint(out: Path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(distill.SEEDS * 4, trainers.BpeTrainer(vocab_size=384, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    args = ModelArgs(dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=128, vocab_size=tok.get_vocab_size(),
                     block_size=1024, chat_template="chatml", stop_tokens=[tok.token_to_id("<|im_end|>")])
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.output.weight.mul_(8)  # a confident target: a near-uniform one leaves the head nothing to learn
    save_file(model.state_dict(), str(out / "model.safetensors"))
    args.save(out / "config.json")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    ckpt, out = tmp_path_factory.mktemp("tiny"), tmp_path_factory.mktemp("run")
    write_tiny_checkpoint(ckpt)
    common = ["--checkpoint", str(ckpt), "--out", str(out), *TRAIN_ARGS]
    assert train_draft.main([*common, "--epochs", "5"]) == 0
    first_state = torch.load(out / "train_state.pt", weights_only=True)
    assert train_draft.main([*common, "--epochs", "10", "--resume"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return ckpt, out, first_state, log


def test_loss_goes_down(trained):
    *_, log = trained
    losses = [r["loss"] for r in log]
    assert len(losses) == 10 * STEPS_PER_EPOCH
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_resume_continues_from_saved_step(trained):
    ckpt, out, first_state, log = trained
    assert first_state["step"] == 5 * STEPS_PER_EPOCH
    assert [r["step"] for r in log] == list(range(1, 10 * STEPS_PER_EPOCH + 1))
    assert torch.load(out / "train_state.pt", weights_only=True)["step"] == 10 * STEPS_PER_EPOCH
    assert len((out / "conversations.jsonl").read_text().splitlines()) == 6  # the data cache was reused
    resumed = log[5 * STEPS_PER_EPOCH]["loss"]
    assert resumed < sum(r["loss"] for r in log[:3]) / 3  # the trained weights came back, not a fresh head


def test_resume_from_a_state_of_another_layout_is_one_line_exit_2(trained, tmp_path, capsys):
    # a state saved before the head's projections were fused (w1 and w3 apart) no longer fits the head or its optimizer
    ckpt, out, first_state, _ = trained
    state = dict(first_state)
    state["head"] = {}
    for k, v in first_state["head"].items():  # the head alone still loads: the fusing hook stacks w1 and w3 again
        state["head"] |= dict(zip([k.replace("w13", "w1"), k.replace("w13", "w3")], v.chunk(2))) if "w13" in k else {k: v}
    groups = state["optimizer"]["param_groups"]
    state["optimizer"] = {**state["optimizer"], "param_groups": [{**g, "params": g["params"] + [len(g["params"])]} for g in groups]}
    torch.save(state, tmp_path / "train_state.pt")
    argv = ["--checkpoint", str(ckpt), "--data-dir", str(out), "--out", str(tmp_path), *TRAIN_ARGS, "--epochs", "6", "--train-only", "--resume"]
    assert train_draft.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --resume:") and "--init" in err[0], err


def test_train_only_uses_the_featurised_data_and_writes_none(trained, tmp_path):
    ckpt, out, *_ = trained
    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.suffix in (".jsonl", ".safetensors") and "head" not in p.parts}
    argv = ["--checkpoint", str(ckpt), "--data-dir", str(out), "--out", str(tmp_path), *TRAIN_ARGS, "--epochs", "1"]
    assert train_draft.main([*argv, "--num-prompts", "50", "--train-only"]) == 0  # 50 wanted, 6 there: trains on the 6
    after = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.suffix in (".jsonl", ".safetensors") and "head" not in p.parts}
    assert after == before and len((out / "conversations.jsonl").read_text().splitlines()) == 6
    assert len((tmp_path / "train_log.jsonl").read_text().splitlines()) == STEPS_PER_EPOCH
    assert train_draft.main([*argv, "--train-only", "--data-only"]) == 2


def test_a_fraction_of_an_epoch_trains_that_share_with_the_rate_decaying_over_it(trained, tmp_path, capsys):
    ckpt, out, *_ = trained
    argv = ["--checkpoint", str(ckpt), "--data-dir", str(out), "--out", str(tmp_path), *TRAIN_ARGS, "--train-only", "--warmup-steps", "1"]
    assert train_draft.main([*argv, "--epochs", "2.5"]) == 0
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert len(lrs) == 8  # ceil(2.5 x 3 steps)
    assert lrs[-1] == pytest.approx(3e-3 / 7)  # the linear decay ends at the shortened run's last step
    for bad in ("0", "inf", "nan"):
        capsys.readouterr()
        assert train_draft.main([*argv, "--epochs", bad]) == 2
        assert capsys.readouterr().err.strip() == "error: --epochs must be a finite number > 0"


def test_train_only_reads_every_data_dir_listed(trained, tmp_path, capsys):
    # two data jobs side by side each write their own directory; training reads both, joined as PATH is
    ckpt, out, *_ = trained
    other = tmp_path / "other"
    shutil.copytree(out / "features", other / "features")
    shutil.copy(out / "conversations.jsonl", other)
    argv = ["--checkpoint", str(ckpt), "--out", str(tmp_path / "run"), *TRAIN_ARGS, "--epochs", "1"]
    assert train_draft.main([*argv, "--data-dir", f"{out}{os.pathsep}{other}", "--train-only"]) == 0
    assert len((tmp_path / "run" / "train_log.jsonl").read_text().splitlines()) == 2 * STEPS_PER_EPOCH
    capsys.readouterr()
    for data_dir, flags in [(f"{out}{os.pathsep}{other}", []), (f"{out}{os.pathsep}{tmp_path / 'none'}", ["--train-only"])]:
        assert train_draft.main([*argv, "--data-dir", data_dir, *flags]) == 2  # one writer a directory; no such directory
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --data-dir"), err


def test_head_is_lossless_and_accepts(trained):
    ckpt, out, _, _ = trained
    target, tok = load_model(ckpt), load_tokenizer(ckpt)
    head = load_head(out / "head", target.args)
    torch.manual_seed(1)
    fresh = EagleHead(head.args)
    requests = [json.loads(line)["request"] for line in (out / "requests.jsonl").read_text().splitlines()]
    generators = {"vanilla": Generator(target), "trained": Generator(target, SPEC, head=head), "fresh": Generator(target, SPEC, head=fresh)}
    tau = {"trained": [], "fresh": []}
    for request in requests[:2]:
        prompt = encode_prompt(tok, target.args, [{"role": "user", "content": request}], chat=True)
        vanilla = generators["vanilla"].generate(prompt, 32, Sampling())
        for name in tau:
            result = generators[name].generate(prompt, 32, Sampling())
            assert result.token_ids == vanilla.token_ids
            tau[name].append(result.metrics(SPEC)["mean_accept_len"])
    # A head trained with the draft's pairs shifted by one slot accepts nothing here (tau about 1.0).
    assert sum(tau["trained"]) / 2 > 1.3 > sum(tau["fresh"]) / 2


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_batched_sampling_matches_single_rows(tmp_path, monkeypatch, compile):
    write_tiny_checkpoint(tmp_path)
    target, tok = load_model(tmp_path), load_tokenizer(tmp_path)
    texts = ["Explain", "Write a short poem about the sea", "How do I", "Describe a train leaving a station at night"]
    prompts = [encode_prompt(tok, target.args, [{"role": "user", "content": t}], chat=True) for t in texts]
    assert len({len(p) for p in prompts}) > 1  # so rows are left-padded
    monkeypatch.setattr(distill, "SLOT_ROUND", 8)  # steps attend to 8, 16, ... slots as the answers grow
    # Rows of 3: the second call holds one prompt and two dummy rows; all greedy except a sampled row whose
    # draws must not disturb the greedy rows beside it.
    temperature = torch.tensor([0.0, 0.0, 1.0, 0.0])
    with distill.tapped(target):
        batched = distill.sample_batch(target, prompts, 16, temperature, 1.0, target.args.stop_tokens, batch=3, compile=compile,
                                       states=True)
    for prompt, (row, hidden, fused), t in zip(prompts, batched, temperature.tolist()):
        if t == 0:
            assert row == Generator(target).generate(prompt, 16, Sampling(), target.args.stop_tokens).token_ids
        # The states come with every row: the target's own over prompt and answer, one sequence alone (bf16).
        tokens = torch.tensor(prompt + row)
        T = len(tokens)
        target.setup_caches(T)
        pos = torch.arange(T)
        with distill.tapped(target), torch.inference_mode():
            h, f = target.hidden(tokens[None], pos, pos, torch.ones(T, T, dtype=torch.bool).tril())
        for got, want in ((hidden, h[0]), (fused, f[0])):
            torch.testing.assert_close(got.float(), want, atol=0.02 * want.abs().max().item(), rtol=0.02)


def test_prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Name a color."}\n{"turns": ["Hi there.", "And again?"]}\n')
    assert distill.file_requests(path) == ["Name a color.", "Hi there."]
    path.write_text('{"question": "x"}\n')
    with pytest.raises(train_draft.UsageError):
        distill.file_requests(path)


def test_count_draft_vocab_ranks_answer_tokens_then_fills_by_id():
    convs = [{"prompt_len": 2, "tokens": [9, 9, 7, 5, 7, 7]}, {"prompt_len": 1, "tokens": [8, 5, 3]}]
    assert train_draft.count_draft_vocab(convs, 3, 10).tolist() == [7, 5, 3]  # counts 3, 2, then ties by id
    assert train_draft.count_draft_vocab(convs, 6, 10).tolist() == [7, 5, 3, 0, 1, 2]  # prompt tokens 9, 8 not counted


def test_reduced_draft_vocabulary_head(trained, tmp_path):
    ckpt, out, _, _ = trained
    for name in ("requests.jsonl", "conversations.jsonl"):  # the same data, no regeneration
        (tmp_path / name).write_text((out / name).read_text())
    argv = ["--checkpoint", str(ckpt), "--out", str(tmp_path), *TRAIN_ARGS, "--epochs", "2", "--draft-vocab", "48",
            "--init", str(out / "head"), "--lr", "1e-5"]
    assert train_draft.main(argv) == 0
    first_loss = json.loads((tmp_path / "train_log.jsonl").read_text().splitlines()[0])["loss"]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert first_loss < log[0]["loss"] * 0.8  # --init started from the trained weights, not a fresh head
    target, tok = load_model(ckpt), load_tokenizer(ckpt)
    head = load_head(tmp_path / "head", target.args)
    convs = [json.loads(line) for line in (tmp_path / "conversations.jsonl").read_text().splitlines()]
    assert head.draft_vocab.tolist() == train_draft.count_draft_vocab(convs, 48, target.args.vocab_size).tolist()
    assert json.loads((tmp_path / "head" / "config.json").read_text())["draft_vocab_size"] == 48
    prompt = encode_prompt(tok, target.args, [{"role": "user", "content": "Explain"}], chat=True)
    gen, trees = Generator(target, SPEC, head=head), []
    result = gen.generate(prompt, 32, Sampling(), lap=lambda name, **t: name == "accept" and trees.append(t["tokens"][1:]))
    assert result.token_ids == Generator(target).generate(prompt, 32, Sampling()).token_ids
    assert set(torch.cat(trees).tolist()) <= set(head.draft_vocab.tolist())


def test_grown_head_starts_as_its_init_and_trains_only_the_new_layer(trained, tmp_path):
    ckpt, out, _, _ = trained
    target = load_model(ckpt)
    trained_head = load_head(out / "head", target.args)
    init = EagleHead(trained_head.args, draft_vocab_size=48)
    init.load_state_dict(trained_head.state_dict(), strict=False)
    init.draft_vocab.copy_(torch.randperm(target.args.vocab_size, generator=torch.Generator().manual_seed(3))[:48])
    save_head(init, tmp_path / "init")  # a vocabulary no count of this data gives
    common = ["--checkpoint", str(ckpt), "--data-dir", str(out), "--train-only", *TRAIN_ARGS, "--epochs", "1",
              "--init", str(tmp_path / "init"), "--init-vocab", "--lr", "1e-3"]
    assert train_draft.main([*common, "--out", str(tmp_path / "same")]) == 0
    assert train_draft.main([*common, "--out", str(tmp_path / "grown"), "--head-layers", "2", "--freeze-init"]) == 0
    first = [json.loads((tmp_path / run / "train_log.jsonl").read_text().splitlines()[0]) for run in ("same", "grown")]
    assert first[1]["loss"] == pytest.approx(first[0]["loss"], rel=1e-5)  # the added layer starts as the identity
    grown = load_head(tmp_path / "grown" / "head", target.args)
    assert len(grown.layers) == 2 and grown.draft_vocab.tolist() == init.draft_vocab.tolist()
    before, after = init.state_dict(), grown.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # --freeze-init: the init's weights as they were
    assert grown.layers[1].attention.wo.weight.abs().sum() > 0 and grown.layers[1].feed_forward.w2.weight.abs().sum() > 0
    tok = load_tokenizer(ckpt)
    prompt = encode_prompt(tok, target.args, [{"role": "user", "content": "Explain"}], chat=True)
    assert Generator(target, SPEC, head=grown).generate(prompt, 32, Sampling()).token_ids == Generator(target).generate(prompt, 32, Sampling()).token_ids


def test_token_table_starts_as_its_init_learns_and_drafts(trained, tmp_path):
    ckpt, out, _, _ = trained
    common = ["--checkpoint", str(ckpt), "--data-dir", str(out), "--train-only", *TRAIN_ARGS, "--epochs", "1",
              "--init", str(out / "head"), "--lr", "1e-3"]
    assert train_draft.main([*common, "--out", str(tmp_path / "same")]) == 0
    assert train_draft.main([*common, "--out", str(tmp_path / "table"), "--token-table"]) == 0
    first = [json.loads((tmp_path / run / "train_log.jsonl").read_text().splitlines()[0]) for run in ("same", "table")]
    assert first[1]["loss"] == pytest.approx(first[0]["loss"], rel=1e-5)  # the table starts at zero
    smaller = [*common, "--init", str(tmp_path / "table" / "head"), "--token-table", "--draft-vocab", "48", "--out", str(tmp_path / "small")]
    assert train_draft.main(smaller) == 0  # an init table of another size starts afresh, its row map with it
    target, tok = load_model(ckpt), load_tokenizer(ckpt)
    head = load_head(tmp_path / "table" / "head", target.args)
    convs = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    vocab = set(head.draft_vocab.tolist()) or set(range(target.args.vocab_size))
    seen = {t for c in convs for t in c["tokens"][c["prompt_len"]:-1] if t in vocab}  # each read by a counted slot
    rows = head.token_row[torch.tensor(sorted(seen))].long()
    assert head.token_table[rows].abs().sum(-1).min() > 0  # every draft token of the answers has learned a row
    with_table = drafted_trees(target, tok, head)
    with torch.no_grad():
        head.token_table.mul_(1000)  # the cycle reads the table: scaled, it drafts other trees
    assert not torch.equal(drafted_trees(target, tok, head), with_table)


def drafted_trees(target, tok, head) -> torch.Tensor:
    """The trees a head drafts answering one prompt greedily, the answer checked against vanilla's."""
    prompt = encode_prompt(tok, target.args, [{"role": "user", "content": "Explain"}], chat=True)
    trees = []
    result = Generator(target, SPEC, head=head).generate(prompt, 32, Sampling(), lap=lambda name, **t: name == "accept" and trees.append(t["tokens"]))
    assert result.token_ids == Generator(target).generate(prompt, 32, Sampling()).token_ids
    return torch.stack(trees)


def test_fused_input_starts_as_its_init_learns_and_serves_as_trained(trained, tmp_path):
    ckpt, out, _, _ = trained
    common = ["--checkpoint", str(ckpt), "--data-dir", str(out), "--train-only", *TRAIN_ARGS, "--epochs", "1", "--lr", "1e-3"]
    assert train_draft.main([*common, "--init", str(out / "head"), "--out", str(tmp_path / "same")]) == 0
    assert train_draft.main([*common, "--init", str(out / "head"), "--out", str(tmp_path / "fused"), "--fused-input"]) == 0
    first = [json.loads((tmp_path / run / "train_log.jsonl").read_text().splitlines()[0]) for run in ("same", "fused")]
    assert first[1]["loss"] == pytest.approx(first[0]["loss"], rel=1e-5)  # fuse starts at zero
    target, tok = load_model(ckpt), load_tokenizer(ckpt)
    head = load_head(tmp_path / "fused" / "head", target.args)
    assert head.taps == (2, 1, 1, 0) and head.fuse.weight.abs().sum() > 0
    # the served head reads the target's states as they come: fused_scale is folded into fuse
    state = torch.load(tmp_path / "fused" / "train_state.pt", weights_only=True)
    trainee = EagleHead(head.args, draft_vocab_size=len(head.draft_vocab), taps=head.taps)
    trainee.load_state_dict(state["head"])
    target.taps = head.taps
    target.setup_caches(32)
    tokens = torch.tensor([json.loads((out / "conversations.jsonl").read_text().splitlines()[0])["tokens"][:20]])
    pos = torch.arange(20)
    _, states = target(tokens, pos, pos, torch.ones(20, 20, dtype=torch.bool).tril())
    scaled = torch.cat([states[..., :64], states[..., 64:] * state["fc_scale"]], -1)
    for h in (head, trainee):
        h.setup_caches(32)
        for layer in h.layers:
            layer.attention.kv_cache = None
    emb = target.tok_embeddings.weight
    torch.testing.assert_close(head(tokens, emb, states, pos, None, None), trainee(tokens, emb, scaled, pos, None, None), atol=1e-4, rtol=1e-4)
    # a fused head as --init: the folded scale is taken out again, so a run that learns nothing serves the same head
    assert train_draft.main([*common, "--init", str(tmp_path / "fused" / "head"), "--init-vocab", "--fused-input", "--lr", "1e-12",
                             "--out", str(tmp_path / "again")]) == 0
    again = load_head(tmp_path / "again" / "head", target.args)
    torch.testing.assert_close(again.fuse.weight, head.fuse.weight, atol=1e-6, rtol=1e-4)
    with_fuse = drafted_trees(target, tok, head)
    with torch.no_grad():
        head.fuse.weight.mul_(1000)  # the cycle reads the fused states: scaled, it drafts other trees
    assert not torch.equal(drafted_trees(target, tok, head), with_fuse)


@pytest.mark.parametrize("flags", [["--freeze-init"], ["--init-vocab"], ["--head-layers", "2", "--arch", "eagle3"], ["--head-layers", "0"],
                                   ["--token-table", "--arch", "eagle3"], ["--fused-input", "--arch", "eagle3"]])
def test_misused_head_flags_are_one_line_exit_2(trained, tmp_path, capsys, flags):
    ckpt, out, _, _ = trained
    argv = ["--checkpoint", str(ckpt), "--data-dir", str(out), "--out", str(tmp_path), "--train-only", *TRAIN_ARGS, *flags]
    assert train_draft.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err


def test_fused_soft_cross_entropy_is_the_cross_entropy():
    """train_draft.soft_ce_fused (compiled, any row count): per row the cross-entropy against the gathered target
    distribution, as F.cross_entropy with probability targets computes it, and its gradient; and whether the row's
    argmax is the target's."""
    torch.manual_seed(0)
    target_all = torch.softmax(torch.randn(12, 50) * 3, -1)
    best = target_all.argmax(-1)
    for n in (7, 19):  # two row counts: the compiled graph is dynamic in them
        rows = torch.randint(0, 12, (n,))
        logits = (torch.randn(n, 50) * 3).requires_grad_()
        ref = logits.detach().clone().requires_grad_()
        ce, agree = train_draft.soft_ce_fused(logits, target_all, rows, best)
        expect = torch.nn.functional.cross_entropy(ref, target_all[rows], reduction="none")
        torch.testing.assert_close(ce, expect)
        assert torch.equal(agree, ref.argmax(-1) == best[rows])
        ce.sum().backward(), expect.sum().backward()
        torch.testing.assert_close(logits.grad, ref.grad)
    logits = target_all[rows].log().clone()  # the target's own logits agree everywhere
    assert train_draft.soft_ce_fused(logits, target_all, rows, best)[1].all()
