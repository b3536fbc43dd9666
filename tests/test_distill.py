# distill.py: the batched sampler's rule, the stored features (the record contract EAGLE-1/2/3 training reads),
# resumable shards, and the benchmark hold-out.
import json

import pytest
import torch

from train import distill
import sampling
from checkpoint import load_model
from tokenizer import encode_prompt
from model import eagle3_taps
from prompts import CODE_MATH, load_conversations
from test_train_draft import write_tiny_checkpoint
from tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")


def test_nucleus_keeps_what_the_sort_rule_keeps():
    torch.manual_seed(0)
    for top_p in (0.95, 0.9, 0.5):
        logits = torch.randn(16, 4096) * torch.linspace(1, 12, 16)[:, None]  # flat to peaked rows
        want = sampling.logits_to_probs(logits, 0.8, 0, top_p)
        fits = (want > 0).sum(-1) <= distill.NUCLEUS_CANDIDATES
        assert fits.any() and not fits.all()
        probs, ids = distill.nucleus(logits, torch.full((16,), 0.8), top_p)
        kept = torch.zeros_like(want).scatter(-1, ids, probs)
        got = kept / kept.sum(-1, keepdim=True)
        torch.testing.assert_close(got[fits], want[fits])
        # Wider than the candidates: the most likely of the nucleus are kept, at their sort-rule odds.
        assert ((got > 0) <= (want > 0)).all()


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_draw_rows_samples_the_target_rule(chi2_pvalue, temperature, top_p):
    torch.manual_seed(1)
    logits = torch.randn(1, 40)
    rows = 40000
    draws = distill.draw_rows(logits.expand(rows, -1), torch.full((rows,), temperature), top_p)
    counts = torch.bincount(draws, minlength=40)
    assert chi2_pvalue(counts, sampling.logits_to_probs(logits, temperature, 0, top_p)[0]) > 1e-3
    # The test can fail: the same draws do not fit a rule without temperature and top-p.
    assert chi2_pvalue(counts, torch.softmax(logits[0], -1)) < 1e-6 or temperature == 1.0


def test_draw_rows_greedy_rows_take_the_argmax():
    logits = torch.randn(8, 100)
    temperature = torch.tensor([0.0, 1.0] * 4)
    draws = distill.draw_rows(logits, temperature, 0.9)
    assert torch.equal(draws[::2], logits[::2].argmax(-1))


def test_holdout_drops_benchmark_questions(tmp_path):
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"turns": ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences.", "Rewrite it."]}) + "\n")
    holdout = distill.Holdout(bench)
    assert "Please compose an engaging travel blog post about a recent trip to Hawaii!" in holdout
    assert "compose an ENGAGING travel-blog post, about a recent trip to hawaii" in holdout
    assert "Rewrite it" in holdout  # short requests match a whole question
    assert "Write an engaging travel blog post about a trip to Paris." not in holdout
    assert "Rewrite this sentence" not in holdout
    assert "x" not in distill.Holdout(None)
    code_math = load_conversations(CODE_MATH)[0][0]  # the project's other benchmark is kept out beside any file
    assert code_math in holdout and code_math not in distill.Holdout(None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(ckpt)
    return ckpt


def test_write_requests_skips_holdout(tiny, tmp_path, monkeypatch):
    target, tok = load_model(tiny), load_tokenizer(tiny)
    cfg = distill.DataConfig(out=tmp_path, max_request_tokens=24, gen_batch=4, compile=False)
    requests = distill.write_requests(cfg, target, tok, 4, float("inf"))
    assert len(requests) == 4
    # The same run again with its second request held out: that request never comes back.
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"turns": [requests[1]]}) + "\n")
    (tmp_path / "requests.jsonl").unlink()
    again = distill.write_requests(distill.DataConfig(**{**cfg.__dict__, "holdout": bench}), target, tok, 4, float("inf"))
    assert requests[1] not in again and again[0] == requests[0] and again[1] == requests[2]


def test_one_writer_per_data_dir(tiny, tmp_path):
    import fcntl

    from errors import UsageError

    with open(tmp_path / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UsageError, match="another process"):
            distill.build(distill.DataConfig(out=tmp_path, compile=False), load_model(tiny), load_tokenizer(tiny), float("inf"))


def test_features_are_the_targets_states_and_resume(tiny, tmp_path):
    target, tok = load_model(tiny), load_tokenizer(tiny)
    cfg = distill.DataConfig(out=tmp_path, prompts=None, num_prompts=5, max_request_tokens=24, max_answer_tokens=20,
                             gen_batch=4, shard_convs=2, feature_tokens=64, greedy_fraction=1.0, compile=False)
    convs, complete = distill.build(cfg, target, tok, float("inf"), round_convs=3)
    assert complete and len(convs) == 5
    assert len(distill.shard_paths(tmp_path)) == 3  # round 1 (3 conversations): a shard of 2; round 2: the rest, 2 + 1
    assert distill.write_features(cfg, target, convs, float("inf")) == 0  # a rerun finds everything done
    records = distill.load_records(tmp_path)
    assert sorted(tuple(r["tokens"].tolist()) for r in records) == sorted(tuple(c["tokens"]) for c in convs)
    taps = eagle3_taps(target.args.n_layer)
    for r in records:
        T, dim = len(r["tokens"]), target.args.dim
        assert set(r) == {"tokens", "prompt_len", "hidden", "fused"}
        assert r["tokens"].dtype == torch.long and isinstance(r["prompt_len"], int)
        assert r["hidden"].shape == (T, dim) and r["fused"].shape == (T, 3 * dim) and r["hidden"].dtype == torch.bfloat16
        # One sequence alone through the target: the stored states are its states (bf16 rounding).
        target.setup_caches(T)
        target.taps = taps
        pos = torch.arange(T)
        with torch.inference_mode():
            h, fused = target.hidden(r["tokens"][None], pos, pos, torch.tril(torch.ones(T, T, dtype=torch.bool)))
        target.taps = ()
        torch.testing.assert_close(r["hidden"].float(), h[0], atol=0.02 * h.abs().max().item(), rtol=0.02)
        torch.testing.assert_close(r["fused"].float(), fused[0], atol=0.02 * fused.abs().max().item(), rtol=0.02)
        # Greedy answers: the LM head over the stored hidden state picks the next token.
        answer = slice(r["prompt_len"] - 1, T - 1)
        with torch.inference_mode():
            predicted = target.output(h[0, answer]).argmax(-1)
        assert torch.equal(predicted, r["tokens"][r["prompt_len"]:])
    # The states came from the answering passes; a lost shard is rebuilt by a feature pass, to the same values.
    last = distill.shard_paths(tmp_path)[-1]
    before = distill.read_safetensors_mmap(last)
    before = {k: v.clone() for k, v in before.items()}
    last.unlink()
    assert distill.write_features(cfg, target, convs, float("inf")) == 1
    after = distill.read_safetensors_mmap(distill.shard_paths(tmp_path)[-1])
    assert torch.equal(after["ids"], before["ids"]) and torch.equal(after["tokens"], before["tokens"])
    for key in ("hidden", "fused"):
        torch.testing.assert_close(after[key].float(), before[key].float(), atol=0.02 * before[key].float().abs().max().item(), rtol=0.02)


def test_a_packed_corpus_unpacks_to_a_data_set_that_featurises_the_same_and_goes_on(tiny, tmp_path, capsys):
    """train/corpus.py: a data set's conversations packed (requests and token ids, no features) and unpacked on
    another machine are the same conversations; a data job there writes their features (the same records, to bf16
    rounding) without answering anything again, then writes new conversations after them. A damaged file or a
    non-empty target directory is one error line, exit 2."""
    from train import corpus

    target, tok = load_model(tiny), load_tokenizer(tiny)
    cfg = distill.DataConfig(out=tmp_path / "a", prompts=None, num_prompts=5, max_request_tokens=24, max_answer_tokens=20,
                             gen_batch=4, shard_convs=2, feature_tokens=64, greedy_fraction=0.5, compile=False)
    convs, complete = distill.build(cfg, target, tok, float("inf"))
    assert complete and len(convs) == 5
    packed = tmp_path / "corpus.jsonl.xz"
    assert corpus.main(["pack", str(cfg.out), str(packed)]) == 0
    assert corpus.main(["unpack", str(packed), str(tmp_path / "b")]) == 0
    moved = distill.DataConfig(**{**cfg.__dict__, "out": tmp_path / "b"})
    again, complete = distill.build(moved, target, tok, float("inf"))
    assert complete and [c["tokens"] for c in again] == [c["tokens"] for c in sorted(convs, key=lambda c: c["id"])]
    before = {tuple(r["tokens"].tolist()): r for r in distill.load_records(cfg.out)}
    after = distill.load_records(moved.out)
    assert len(after) == 5 and len(distill.read_jsonl(moved.out / "conversations.jsonl")) == 5  # nothing answered again
    for r in after:
        b = before[tuple(r["tokens"].tolist())]
        assert r["prompt_len"] == b["prompt_len"]
        torch.testing.assert_close(r["hidden"].float(), b["hidden"].float(), atol=0.02 * b["hidden"].float().abs().max().item(), rtol=0.02)
    more, complete = distill.build(distill.DataConfig(**{**moved.__dict__, "num_prompts": 7}), target, tok, float("inf"))
    assert complete and len(more) == 7 and [c["id"] for c in more][5:] == [5, 6]
    capsys.readouterr()
    assert corpus.main(["unpack", str(packed), str(tmp_path / "b")]) == 2
    (tmp_path / "bad.jsonl.xz").write_bytes(b"not xz")
    assert corpus.main(["unpack", str(tmp_path / "bad.jsonl.xz"), str(tmp_path / "c")]) == 2
    assert corpus.main(["pack", str(tmp_path / "nowhere"), str(tmp_path / "x.jsonl.xz")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(e.startswith("error: ") for e in errors), errors


def test_compiled_feature_pass_matches_eager_with_one_graph_for_every_batch_shape(tiny):
    """The feature pass compiles one layer graph (dynamic shapes, no KV cache) that every layer and every batch of
    two or more rows reuses; its states are the eager pass's up to bf16 rounding."""
    from torch._dynamo.utils import counters

    target = load_model(tiny)
    torch.manual_seed(0)
    vocab = target.args.vocab_size
    convs = [{"id": i, "tokens": torch.randint(vocab, (n,)).tolist()} for i, n in enumerate((5, 6, 9, 11, 17, 18, 30, 31, 33))]
    eager = distill.featurize(target, convs, 40)
    compiled = distill.featurize(target, convs[:4], 24, compile=True)  # two batches of 2 rows
    graphs = counters["stats"]["unique_graphs"]
    compiled |= distill.featurize(target, convs[4:], 100, compile=True)  # 3 rows, then 2, longer
    assert counters["stats"]["unique_graphs"] == graphs
    assert set(compiled) == set(eager)
    for i, (h, f) in eager.items():
        assert compiled[i][0].shape == h.shape and compiled[i][1].shape == f.shape
        torch.testing.assert_close(compiled[i][0].float(), h.float(), atol=0.02 * h.float().abs().max().item(), rtol=0.02)
        torch.testing.assert_close(compiled[i][1].float(), f.float(), atol=0.02 * f.float().abs().max().item(), rtol=0.02)
