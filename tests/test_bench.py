# bench.py end to end on a tiny converted checkpoint: every mode on the same prompts, one report.
import json

import pytest

from bench import bench
from bench import peers
from convert_hf_checkpoint import convert_hf
from draft import EagleHead
from hf_fixtures import write_hf_llama
from weights import save_head


@pytest.fixture(scope="module")
def setup_dirs(tmp_path_factory, single_thread):
    root = tmp_path_factory.mktemp("bench")
    write_hf_llama(root / "hf", vocab=320, seed=0)
    args = convert_hf(root / "hf", root / "ckpt")
    save_head(EagleHead(args), root / "head")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Say something about {w}.", "And more?"]}) + "\n" for w in ("cats", "rain", "code")))
    return root, prompts


def test_bench_reports_every_mode_on_the_same_prompts(setup_dirs, capsys):
    root, prompts = setup_dirs
    out = root / "report.json"
    argv = ["--checkpoint", str(root / "ckpt"), "--draft", str(root / "head"), "--draft-checkpoint", str(root / "ckpt"),
            "--modes", "none,eagle2,eagle,sps", "--prompts", str(prompts), "--max-new-tokens", "12",
            "--num-draft-tokens", "8", "--depth", "3", "--topk", "4", "--speculate-k", "3", "--multi-turn", "--split", "--dtype", "float32", "--json-out", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert list(modes) == ["none", "eagle2", "eagle", "sps", "none, no reuse"]
    assert all(m["turns"] == 6 for m in modes.values())  # 3 conversations x 2 turns
    # --multi-turn reuses the conversation's caches: a second turn prefills far less than its prompt, which the
    # no-reuse row prefills whole; fp32, so the answers are the same either way
    reused, whole = modes["none"]["prefilled_tokens_per_turn"][1], modes["none, no reuse"]["prefilled_tokens_per_turn"][1]
    assert whole == modes["none"]["prompt_tokens_per_turn"][1] and reused < whole / 2
    assert modes["none, no reuse"]["greedy_agreement"]["identical_share"] == 1.0
    assert modes["none"]["speedup"] == 1.0
    # sps drafts with the target itself: every draft token is accepted at every depth
    assert modes["sps"]["accept_rate_per_depth"] == [1.0] * 3 and modes["sps"]["mean_accept_len"] > 3
    for m in ("eagle2", "eagle"):
        assert set(modes[m]["split_ms"]) == {"draft", "tree", "verify", "accept"}
        assert modes[m]["mean_accept_len"] >= 1
    assert "eagle2" in capsys.readouterr().out


def test_compiled_split_puts_each_kernel_in_its_part_with_the_bytes_it_moves(setup_dirs, capsys):
    """--split with --compile (bench/cycle_split.py): a decode step's and a cycle's parts, each with the bytes its kernels
    move. The target's linears read every packed target weight once a step and once a cycle (the verify), the head's
    only in the cycle. A kernel put in the wrong part, or its weight's bytes misread from its shapes, fails here (the
    times themselves are the benchmark's to report, not a test's to assert)."""
    import torch

    from bench import cycle_split
    from eaglet import load_target

    root, prompts = setup_dirs
    out = root / "split.json"
    argv = ["--checkpoint", str(root / "ckpt"), "--draft", str(root / "head"), "--modes", "none,eagle2", "--prompts", str(prompts),
            "--max-new-tokens", "12", "--num-draft-tokens", "8", "--depth", "3", "--topk", "4", "--lookup-slots", "0",
            "--compile", "--split", "--dtype", "float32", "--json-out", str(out)]
    assert bench.main(argv) == 0
    modes = json.loads(out.read_text())["modes"]
    target = load_target(root / "ckpt", dtype=torch.float32)
    weights = sum(m.weight.numel() * 4 for m in target.modules() if isinstance(m, torch.nn.Linear)) / 1e6
    for mode, head in (("none", False), ("eagle2", True)):
        split = modes[mode]["split"]
        parts = split["parts"]
        assert list(parts) == list(cycle_split.PARTS) and split["per"] == ("cycle" if head else "decode step")
        assert parts["target linears"]["MB"] == pytest.approx(weights, abs=0.02) and parts["target linears"]["ms"] > 0
        assert (parts["head linears"]["MB"] > 0) == head and parts["target linears"]["floor_ms"] > 0
    assert "where a cycle goes" in capsys.readouterr().out


def test_bench_batch_sizes_time_each_mode_at_each_size(setup_dirs):
    root, prompts = setup_dirs
    out = root / "batches.json"
    argv = ["--checkpoint", str(root / "ckpt"), "--draft", str(root / "head"), "--modes", "none,eagle2", "--batch-sizes", "1,2",
            "--prompts", str(prompts), "--max-new-tokens", "12", "--num-draft-tokens", "8", "--depth", "3", "--topk", "4",
            "--dtype", "float32", "--json-out", str(out)]
    assert bench.main(argv) == 0
    modes = json.loads(out.read_text())["modes"]
    assert list(modes) == ["none B=1", "none B=2", "eagle2 B=1", "eagle2 B=2"]
    assert [m["turns"] for m in modes.values()] == [3, 3, 3, 3]  # B=2: the row done first takes the third conversation
    assert modes["none B=2"]["speedup"] == 1.0 and modes["eagle2 B=2"]["batch_size"] == 2
    assert modes["eagle2 B=2"]["speedup"] == round(modes["eagle2 B=2"]["tokens_per_s"] / modes["none B=2"]["tokens_per_s"], 3)
    assert modes["eagle2 B=1"]["greedy_agreement"]["identical_share"] == modes["eagle2 B=2"]["greedy_agreement"]["identical_share"] == 1.0
    assert bench.main(argv[:-2] + ["--batch-sizes", "0"]) == 2


def test_bench_missing_prompts_is_one_line_error(tmp_path, capsys):
    assert bench.main(["--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert capsys.readouterr().err.strip().startswith("error: prompts file")


def test_rounds_time_every_row_slice_by_slice(setup_dirs, monkeypatch):
    """--rounds 3 on three conversations: after the warm-ups, vanilla and eagle2 take turns conversation by
    conversation, and each row still sums all three (fp32: eagle2's answers are vanilla's)."""
    root, prompts = setup_dirs
    out, calls, run_mode = root / "rounds.json", [], bench.run_mode

    def spy(gen, tokenizer, margs, conversations, a, sampling, progress=True, name=None, **kw):
        calls.append((name, [turns[0] for turns in conversations]))
        return run_mode(gen, tokenizer, margs, conversations, a, sampling, progress=progress, name=name, **kw)

    monkeypatch.setattr(bench, "run_mode", spy)
    argv = ["--checkpoint", str(root / "ckpt"), "--draft", str(root / "head"), "--modes", "none,eagle2", "--prompts", str(prompts),
            "--max-new-tokens", "12", "--num-draft-tokens", "8", "--depth", "3", "--topk", "4", "--dtype", "float32"]
    assert bench.main(argv + ["--rounds", "3", "--json-out", str(out)]) == 0
    firsts = [f"Say something about {w}." for w in ("cats", "rain", "code")]
    assert [c for c in calls if c[0] is not None] == [(mode, [first]) for first in firsts for mode in ("none", "eagle2")]
    modes = json.loads(out.read_text())["modes"]
    assert [m["turns"] for m in modes.values()] == [3, 3]
    assert modes["eagle2"]["greedy_agreement"]["identical_share"] == 1.0
    for bad in (["--rounds", "4"], ["--rounds", "0"], ["--rounds", "2", "--batch-sizes", "2"]):  # a slice must hold a batch
        assert bench.main(argv + bad) == 2


def test_sweep_measures_trees_and_records_the_fastest(setup_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path))
    root, prompts = setup_dirs
    out = tmp_path / "sweep.json"
    argv = ["--checkpoint", str(root / "ckpt"), "--draft", str(root / "head"), "--prompts", str(prompts), "--num-prompts", "2",
            "--max-new-tokens", "8", "--sweep", "3", "--json-out", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    rows = list(report["modes"].values())
    assert rows[0]["mode"] == "none" and len(rows) == 4 and all(r["spec"]["mode"] == "eagle2" for r in rows[1:])
    fastest = max(rows[1:], key=lambda r: r["tokens_per_s"])["spec"]
    assert report["best"] == fastest
    cache = json.loads((tmp_path / "tree_sizes.json").read_text())
    (entry,) = cache.values()
    (swept,) = [v for k, v in entry.items() if k.startswith("swept ")]  # named by the head's digest
    assert swept == [fastest["num_draft_tokens"], fastest["depth"], fastest["topk"]]


def test_random_shape_times_a_cycle_against_a_decode_step(tmp_path, capsys):
    out = tmp_path / "shape.json"
    assert bench.main(["--random-shape", "tiny", "--device", "cpu", "--max-new-tokens", "16", "--num-draft-tokens", "8",
                       "--depth", "3", "--topk", "4", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    none, eagle2 = result["modes"]["none"], result["modes"]["eagle2"]
    assert eagle2["cycle_over_decode_step"] == pytest.approx(eagle2["step_ms"] / none["step_ms"], rel=1e-2)
    assert eagle2["implied_tokens_per_s"] == pytest.approx(4.7 * 1000 / eagle2["step_ms"], rel=1e-2)
    assert set(result["costs"]["verify"]) == {"3", "5", "7", "9", "13", "17", "25", "33", "49", "61"}
    assert "decode step" in capsys.readouterr().out


def test_quantized_rows_peers_and_greedy_agreement(setup_dirs, tmp_path, capsys):
    """--quantize adds vanilla rows on quantised copies, --peers runs HF transformers on the same prompt ids,
    and every row says how far its greedy answers follow vanilla's."""
    pytest.importorskip("transformers")
    root, prompts = setup_dirs
    out = tmp_path / "report.json"
    argv = ["--checkpoint", str(root / "ckpt"), "--modes", "none", "--prompts", str(prompts), "--max-new-tokens", "12",
            "--dtype", "float32", "--quantize", "int8,int4", "--peers", "transformers,llama.cpp", "--json-out", str(out)]
    assert bench.main(argv) == 0
    modes = json.loads(out.read_text())["modes"]
    assert {"none", "none int8", "none int4", "hf float32", "hf float32 lookup10"} <= set(modes)
    assert all(m["turns"] == 3 and m["new_tokens"] > 0 for m in modes.values())
    # fp32 HF on our weights (q/k rows put back in rotate-half order) decodes exactly what we decode
    assert modes["hf float32"]["greedy_agreement"] == {"identical_share": 1.0, "first_divergence": [None] * 3}
    assert modes["hf float32 lookup10"]["greedy_agreement"]["identical_share"] == 1.0
    assert len(modes["none int4"]["greedy_agreement"]["first_divergence"]) == 3
    int8, int4 = modes["none int8"]["logit_error"], modes["none int4"]["logit_error"]
    assert 0 < int8["relative_rms"] < int4["relative_rms"] < 0.5 and int8["max_abs"] > 0  # int4 strays further than int8
    assert "note: skipping llama.cpp" in capsys.readouterr().err  # a test checkpoint has no GGUF tokenizer metadata


def test_unknown_peer_or_quantization_is_one_line_error(capsys):
    for argv in (["--peers", "vllm"], ["--quantize", "int3"]):
        assert bench.main(argv) == 2
        assert capsys.readouterr().err.strip().startswith("error: unknown --")


def test_llama_cpp_needs_the_default_models_gguf_metadata(tmp_path):
    """A checkpoint other than the default model has no GGUF tokenizer metadata to copy: the peer is skipped with
    a reason, whether or not llama-cpp-python is installed (this path runs before llama_cpp is imported)."""
    with pytest.raises(peers.PeerUnavailable, match="GGUF tokenizer metadata"):
        peers.gguf_source(tmp_path / "other-model")


def test_llama_cpp_leaves_no_gguf_behind(tmp_path, monkeypatch):
    """The GGUF written for llama.cpp goes with its temporary directory once the model is loaded, and the model still
    decodes from the mapped file: a bench run with llama.cpp peers leaves nothing in the temporary directory."""
    pytest.importorskip("llama_cpp")
    from checkpoint import default_checkpoint

    try:
        checkpoint = default_checkpoint()
        peers.gguf_source(checkpoint)
    except (FileNotFoundError, peers.PeerUnavailable) as e:
        pytest.skip(str(e))
    monkeypatch.setattr(peers.tempfile, "tempdir", str(tmp_path))
    llm = peers.llama_cpp_model(checkpoint, "q8_0", n_ctx=64, threads=1)
    assert list(tmp_path.iterdir()) == []
    ids, _ = peers.llama_cpp_generate(llm, [1, 2, 3], 4, stop_ids=())
    assert len(ids) == 4
