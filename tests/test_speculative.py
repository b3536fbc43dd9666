import collections
import copy
import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch

import batch
import generator
import sampling
import spectree
import model
import quant
from draft import EagleHead, use_draft_vocab
from eaglet import Generator
from sampling import Sampling
from speculate import TreeSpec
from model import causal_mask

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = Sampling()


def make_generator(target, spec, head=None, draft_model=None):
    if spec.mode == "sps":
        return Generator(target, spec, draft_model=draft_model)
    if spec.mode == "lookup":
        return Generator(target, spec)
    return Generator(target, spec, head=head)


# ---- fp32 greedy: speculation reproduces vanilla decoding token for token ----

NEW_TOKENS = 60
SPECS = {
    "eagle2-6-10-16": TreeSpec("eagle2", 6, 10, 16),
    "eagle2-6-10-60": TreeSpec("eagle2", 6, 10, 60),
    "eagle2-3-4-8": TreeSpec("eagle2", 3, 4, 8),
    "eagle": TreeSpec.static(),
    "sps-random": TreeSpec.chain("sps", 4),
    "sps-self": TreeSpec.chain("sps", 4),
    "lookup": TreeSpec.chain("lookup", 4),
    "eagle2-lookup": TreeSpec("eagle2", 4, 4, 8, lookup_slots=4),
}
VARIANTS = {
    "gqa": dict(n_head=4, n_local_heads=2),
    "tied": dict(n_head=4, n_local_heads=4, tie_embeddings=True),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, single_thread, tiny_args, random_model, random_head):
    args = tiny_args(**VARIANTS[request.param])
    target = random_model(args, seed=0)
    prompt = torch.randint(0, args.vocab_size, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    small = tiny_args(dim=32, n_layer=1, n_head=2, n_local_heads=2, intermediate_size=64)
    drafts = {"sps-random": random_model(small, seed=2), "sps-self": copy.deepcopy(target)}
    head = random_head(args, seed=1)
    return SimpleNamespace(
        target=target,
        prompt=prompt,
        ref=Generator(target).generate(prompt, NEW_TOKENS, GREEDY).token_ids,
        generator=lambda name: make_generator(target, SPECS[name], head, drafts.get(name)),
        head=head,
    )


def test_vanilla_reference_is_not_degenerate(tiny):
    # equality with a constant or 2-cycle output would prove little
    assert len(tiny.ref) == NEW_TOKENS and len(set(tiny.ref)) >= 10


@pytest.mark.parametrize("name", SPECS)
def test_greedy_speculation_reproduces_vanilla(tiny, name):
    assert tiny.generator(name).generate(tiny.prompt, NEW_TOKENS, GREEDY).token_ids == tiny.ref


def test_target_as_its_own_draft_accepts_every_token(tiny):
    spec = SPECS["sps-self"]
    result = tiny.generator("sps-self").generate(tiny.prompt, NEW_TOKENS, GREEDY)
    m = result.metrics(spec)
    assert m["accept_len_hist"][spec.depth] == m["cycles"] and m["accept_rate_per_depth"] == [1.0] * spec.depth
    # tau counts only what was kept: the last cycle is cut at the token limit
    assert m["mean_accept_len"] == pytest.approx((NEW_TOKENS - 1) / m["cycles"], abs=1e-4)
    assert m["cycles"] == -(-(NEW_TOKENS - 1) // (spec.depth + 1))


def stop_position(ref):
    # The first new token at index >= 5; off the self-draft's cycle ends (indices 5, 10, ...) so that
    # a cycle commits tokens past the stop and the truncation is exercised.
    return next(i for i in range(5, len(ref)) if ref[i] not in ref[:i] and i % 5)


@pytest.mark.parametrize("name", SPECS)
def test_greedy_speculation_stops_where_vanilla_stops(tiny, name):
    i = stop_position(tiny.ref)
    stop = [tiny.ref[i]]
    want = Generator(tiny.target).generate(tiny.prompt, NEW_TOKENS, GREEDY, stop).token_ids
    assert want == tiny.ref[: i + 1]
    assert tiny.generator(name).generate(tiny.prompt, NEW_TOKENS, GREEDY, stop).token_ids == want


@pytest.mark.parametrize("n", [2, 8, 13])
def test_max_new_tokens_ending_inside_a_cycle_is_exact(tiny, n):
    result = tiny.generator("sps-self").generate(tiny.prompt, n, GREEDY)
    committed = sum((a + 1) * c for a, c in enumerate(result.accept_hist))
    assert committed > n - 1  # the last cycle really committed more than was asked for
    assert result.token_ids == tiny.ref[:n]


# ---- logit_bias and penalties: the target's logits shaped before each draw, as OpenAI's formula says ----

def shaped_reference(target, prompt: list, n: int, rule: Sampling) -> list:
    """Greedy decoding of rule's shaped logits written out plainly: a whole forward over prompt and answer a token, then
    logit + bias - frequency * count - presence * (count > 0), the counts of the answer so far."""
    model = copy.deepcopy(target)
    model.setup_caches(256)
    out = []
    for _ in range(n):
        with torch.no_grad():
            h, _ = generator.prefill(model, torch.tensor([prompt + out]), torch.tensor(0))
            logits = model.output(h[-1]).float()
        for t, b in rule.logit_bias:
            logits[t] += b
        for t, c in collections.Counter(out).items():
            logits[t] -= rule.frequency_penalty * c + rule.presence_penalty
        out.append(int(logits.argmax()))
    return out


def shaping_rule(ref: list) -> Sampling:
    return Sampling(logit_bias=((ref[0], -100.0), (ref[7], 3.0)), frequency_penalty=1.5, presence_penalty=0.5)


@pytest.fixture(scope="module")
def shaped_ref(tiny):
    want = shaped_reference(tiny.target, tiny.prompt, NEW_TOKENS, shaping_rule(tiny.ref))
    assert want != tiny.ref[:len(want)] and tiny.ref[0] not in want  # the shaping changes the answer
    return want


@pytest.mark.parametrize("name", ["none", *SPECS])
def test_logit_bias_and_penalties_shape_every_modes_draws_as_openai_says(tiny, shaped_ref, name):
    gen = Generator(tiny.target) if name == "none" else tiny.generator(name)
    assert gen.generate(tiny.prompt, NEW_TOKENS, shaping_rule(tiny.ref)).token_ids == shaped_ref
    rows = gen.generate_batch([tiny.prompt, tiny.prompt[:5]], NEW_TOKENS, shaping_rule(tiny.ref))
    assert rows[0].token_ids == shaped_ref


@pytest.mark.parametrize("tiny", ["gqa"], indirect=True)  # the variant whose trees accept enough to show each fault
@pytest.mark.parametrize("broken", ["the node's own token", "no tree tokens", "every committed row"])
def test_the_shaping_test_rejects_miscounted_answers(tiny, shaped_ref, monkeypatch, broken):
    path_counts, count = sampling.path_counts, sampling.count
    if broken == "the node's own token":
        monkeypatch.setattr(sampling, "path_counts", lambda tokens, anc, width: path_counts(tokens, anc & ~torch.eye(anc.shape[0], dtype=torch.bool), width))
    elif broken == "no tree tokens":
        monkeypatch.setattr(sampling, "path_counts", lambda tokens, anc, width: 0 * path_counts(tokens, anc, width))
    else:
        monkeypatch.setattr(sampling, "count", lambda st, tokens, weight: count(st, tokens, torch.ones_like(weight)))
    assert any(tiny.generator(name).generate(tiny.prompt, NEW_TOKENS, shaping_rule(tiny.ref)).token_ids != shaped_ref for name in SPECS)


def test_path_counts_are_each_nodes_path_below_the_root():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 9, 40):
        parents = torch.tensor([0] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)])
        tokens = torch.randint(0, 6, (n,), generator=gen)
        counts = sampling.path_counts(tokens, spectree.ancestor_mask(parents, n), 6)
        for i in range(n):
            path, j = collections.Counter(), i
            while j:
                path[int(tokens[j])] += 1
                j = int(parents[j])
            assert counts[i].tolist() == [path[t] for t in range(6)]


@pytest.mark.parametrize("name", ["eagle2-3-4-8", "eagle"])
def test_metrics_count_what_the_cycles_committed(tiny, name):
    spec, gen = SPECS[name], tiny.generator(name)
    chunks = []
    gen.generate(tiny.prompt, NEW_TOKENS, GREEDY, on_tokens=lambda new: chunks.append(list(new)))
    cycle_chunks = chunks[1:-1]  # chunks[0] is the prefill's token; the last chunk may be cut short
    result = gen.generate(tiny.prompt, 1 + sum(map(len, cycle_chunks)), GREEDY)
    m = result.metrics(spec)
    assert m["cycles"] == len(cycle_chunks)
    assert m["accept_len_hist"] == [sum(len(c) == a + 1 for c in cycle_chunks) for a in range(spec.depth + 1)]
    assert sum(m["accept_len_hist"]) == m["cycles"]
    assert m["mean_accept_len"] == pytest.approx((len(result.token_ids) - 1) / m["cycles"], abs=1e-4)


@pytest.mark.parametrize("name", ["eagle2-3-4-8", "eagle"])
def test_a_cycle_writes_the_head_cache_once(tiny, name, monkeypatch):
    """A draft tree's levels keep their K/V rows apart from the head's cache (KVCache.update with an int: the head's
    k_tree), so the cache takes one write a cycle, the context pass's, and one for the prompt: compiled, Inductor
    copied all of a buffer written more than once in a graph for every write but the last (docs/cpu.md)."""
    writes = []
    update = model.KVCache.update
    monkeypatch.setattr(model.KVCache, "update", lambda self, pos, *a: writes.append((self, torch.is_tensor(pos))) or update(self, pos, *a))
    gen = tiny.generator(name)
    result = gen.generate(tiny.prompt, NEW_TOKENS, GREEDY)
    assert result.token_ids == tiny.ref
    for layer in gen.head.layers:
        mine = [to_cache for cache, to_cache in writes if cache is layer.attention.kv_cache]
        assert mine.count(True) == 1 + result.cycles and mine.count(False) == result.cycles * (SPECS[name].depth - 1)


# ---- a reduced draft vocabulary: drafts stay inside it, output stays exact ----

def drafted_trees(gen, prompt):
    trees = []
    gen.generate(prompt, NEW_TOKENS, GREEDY, lap=lambda name, **t: name == "accept" and trees.append(t["tokens"][1:].tolist()))
    return trees


def test_lookup_slots_with_nothing_to_follow_hold_the_drafts_next_best_nodes(tiny):
    """A text with no n-gram to follow (the prompt's tokens all differ, so the first cycle's last 2-gram is new): the
    lookup slots, verified either way, take the draft's next-best nodes, the tree of m + s draft nodes."""
    prompt = list(range(1, 11))
    with_slots = drafted_trees(Generator(tiny.target, TreeSpec("eagle2", 3, 4, 8, lookup_slots=3), head=tiny.head), prompt)
    wider = drafted_trees(Generator(tiny.target, TreeSpec("eagle2", 3, 4, 11), head=tiny.head), prompt)
    assert with_slots[0] == wider[0] and len(wider[0]) == 11


@pytest.mark.parametrize("name", ["eagle2-6-10-16", "eagle2-3-4-8", "eagle"])
def test_reduced_draft_vocabulary_is_lossless_and_drafts_inside_it(tiny, name):
    vocab = torch.randperm(tiny.target.args.vocab_size, generator=torch.Generator().manual_seed(3))[:16]
    head = copy.deepcopy(tiny.head)
    head.draft_vocab = vocab
    use_draft_vocab(head, tiny.target.output)
    gen = Generator(tiny.target, SPECS[name], head=head)
    assert gen.generate(tiny.prompt, NEW_TOKENS, GREEDY).token_ids == tiny.ref
    drafted = {t for tree_tokens in drafted_trees(gen, tiny.prompt) for t in tree_tokens}
    assert drafted and drafted <= set(vocab.tolist())


@pytest.mark.parametrize("name", ["eagle2-6-10-16", "eagle"])
def test_a_permuted_full_draft_vocabulary_drafts_the_same_trees(tiny, name):
    # Every id goes through the draft-to-target map, so a wrong map changes the trees.
    head = copy.deepcopy(tiny.head)
    head.draft_vocab = torch.randperm(tiny.target.args.vocab_size, generator=torch.Generator().manual_seed(4))
    use_draft_vocab(head, tiny.target.output)
    full = drafted_trees(Generator(tiny.target, SPECS[name], head=tiny.head), tiny.prompt)
    assert drafted_trees(Generator(tiny.target, SPECS[name], head=head), tiny.prompt) == full


@pytest.mark.parametrize("mode", [None, "int8", "int4"])
def test_draft_lm_head_is_the_targets_rows(tiny_args, random_model, random_head, mode):
    target = random_model(tiny_args(), seed=0)
    if mode:
        target = quant.quantize_model(target, mode, 32 if mode == "int4" else 0)
    head = random_head(tiny_args(), seed=1)
    head.draft_vocab = torch.tensor([5, 3, 60, 0])
    use_draft_vocab(head, target.output, size=3)
    assert head.draft_vocab.tolist() == [5, 3, 60] and type(head.lm_head) is type(target.output)
    h = torch.randn(2, tiny_args().dim)
    torch.testing.assert_close(head.logits(h, target.output), target.output(h)[:, [5, 3, 60]], atol=1e-4, rtol=1e-4)
    assert head.target_ids(torch.tensor([2, 0])).tolist() == [60, 5]
    use_draft_vocab(head, target.output, size=0)
    assert head.lm_head is None and head.logits(h, target.output).shape == (2, tiny_args().vocab_size)


# ---- fp32 greedy on the real default model (SmolLM2-135M-Instruct) with a random EAGLE head ----

@pytest.fixture(scope="module")
def smollm2_eagle(smollm2):
    from tokenizer import encode_prompt

    target, tokenizer = smollm2
    args = target.args
    messages = [{"role": "user", "content": "Name three rivers in Europe and say one thing about each."}]
    prompt = encode_prompt(tokenizer, args, messages, chat=True)
    torch.manual_seed(0)
    head = EagleHead(dataclasses.replace(args, n_layer=1)).eval()
    ref = Generator(target).generate(prompt, 40, GREEDY, args.stop_tokens).token_ids
    return SimpleNamespace(target=target, head=head, prompt=prompt, ref=ref)


@pytest.mark.parametrize("spec", [TreeSpec("eagle2", 6, 10, 16), TreeSpec.static()], ids=["eagle2", "eagle"])
def test_greedy_speculation_reproduces_vanilla_on_smollm2(smollm2_eagle, spec):
    run = smollm2_eagle
    gen = Generator(run.target, spec, head=run.head)
    assert gen.generate(run.prompt, 40, GREEDY, run.target.args.stop_tokens).token_ids == run.ref


def test_lookup_reproduces_vanilla_on_smollm2_and_copies_from_the_prompt(smollm2):
    from tokenizer import encode_prompt

    target, tokenizer = smollm2
    text = "Repeat exactly: The quick brown fox jumps over the lazy dog near the quiet river bank."
    prompt = encode_prompt(tokenizer, target.args, [{"role": "user", "content": text}], chat=True)
    stops = target.args.stop_tokens
    result = Generator(target, TreeSpec.chain("lookup", 6)).generate(prompt, 40, GREEDY, stops)
    assert result.token_ids == Generator(target).generate(prompt, 40, GREEDY, stops).token_ids
    assert sum(result.accept_hist[2:]) > 0  # the answer quotes the prompt: chains of drafts are accepted


# ---- sampling: the first three tokens follow the target's own distribution ----
#
# Tiny vocabulary (V = 8), so P(t1, t2, t3) is computed exactly from the target over all V^2 prefixes,
# and compared with SAMPLES speculative runs by a chi-square test (cells with expected count < 5
# pooled; pass at p > 1e-3). With SAMPLES = 1000 the broken rules below are rejected at p < 1e-20.

V = 8
PROMPT = [1, 5, 2]
SAMPLES = 1000
SAMPLING_SPECS = {
    # eagle2: 4 of 8 tokens per node, so draws both hit and miss the tree
    "eagle2": TreeSpec("eagle2", 3, 4, 10),
    "eagle": TreeSpec.static(),
    "sps": TreeSpec.chain("sps", 2),
    "lookup": TreeSpec.chain("lookup", 2),
    "eagle2-lookup": TreeSpec("eagle2", 3, 4, 10, lookup_slots=3),
}
T1 = Sampling(1.0)
# Every pair of tokens once (a de Bruijn sequence): whatever the first token, the text's last 2-gram has occurred,
# so the lookup slots are filled at every cycle and often double a tree node's token (graft_chain must not).
DE_BRUIJN = [0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 1, 1, 2, 1, 3, 1, 4, 1, 5, 1, 6, 1, 7, 2, 2, 3, 2, 4, 2, 5, 2, 6, 2, 7,
             3, 3, 4, 3, 5, 3, 6, 3, 7, 4, 4, 5, 4, 6, 4, 7, 5, 5, 6, 5, 7, 6, 6, 7, 7, 0]
PROMPTS = {"eagle2-lookup": DE_BRUIJN}


@pytest.fixture(scope="module")
def small_vocab(single_thread, tiny_args, random_model, random_head):
    args = tiny_args(dim=32, n_head=4, n_local_heads=2, intermediate_size=64, vocab_size=V, block_size=128)
    target = random_model(args, seed=0)
    # An over-confident copy of the target (logits x2): high acceptance, and a residual
    # norm(max(0, p - q)) far from p, so a wrong residual shows up strongly.
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.output.weight.mul_(2.0)
    # A head of std 0.5 drafts with some confidence: a near-uniform one's coupled trees are chosen by the noise alone, and
    # a fresh bonus draw (below) moved the eagle2 counts only to p = 2e-3.
    head = random_head(args, seed=1, std=0.5)
    # A head of std 0.1 drafts within a few nats: the Gumbels reorder its candidates, so its coupled trees follow the
    # noise (std 0.5's never did: its draft logits span far more than the noise), and they accept 2 and 3 deep often.
    noisy_head = random_head(args, seed=1, std=0.1)
    return SimpleNamespace(target=target, generator=lambda mode: make_generator(target, SAMPLING_SPECS[mode], head, draft),
                           noisy_generator=lambda mode: make_generator(target, SAMPLING_SPECS[mode], noisy_head, draft))


def exact_distribution(model, sampling, prompt, n=3):
    """P(first n generated tokens) as a [V] * n tensor, from the target's conditionals after every
    prefix of n-1 tokens, in one batched forward."""
    prefixes = torch.tensor(list(itertools.product(range(V), repeat=n - 1)))
    x = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], dim=1)
    model = copy.deepcopy(model)
    model.setup_caches(x.shape[1], batch=len(x))
    pos = torch.arange(x.shape[1])
    with torch.inference_mode():
        logits, _ = model(x, pos, pos, causal_mask(pos, x.shape[1]))
    probs = sampling.probs(logits[:, len(prompt) - 1 :])  # [prefix, i, V]: token i given prefix[:i]
    joint = torch.ones(())
    for i in range(n):
        cond = probs[:, i].reshape([V] * n)[(slice(None),) * i + (0,) * (n - 1 - i)]
        joint = joint.unsqueeze(-1) * cond
    return joint


def sample_first_tokens(gen, sampling, prompt=PROMPT, n=3, first_trees=None):
    """Counts of the first n tokens over SAMPLES runs, and the summed accept-length histogram. first_trees: a list
    that gets each run's (first token, first cycle's tree tokens)."""
    # Any seed serves. Seed 0 drew a p = 6e-5 outlier in the EAGLE-3 T=1 test once sampling.sample became an inverse
    # CDF (RNG consumed differently); 10x the samples gave p 0.38, 0.18, 0.48 on seeds 0-2: chance, not a bias.
    torch.manual_seed(1)
    counts, hist = torch.zeros([V] * n), 0
    for _ in range(SAMPLES):
        trees = []
        lap = (lambda name, **t: name == "accept" and trees.append(tuple(t["tokens"].tolist()))) if first_trees is not None else None
        result = gen.generate(prompt, n, sampling, stop_ids=[], lap=lap)
        counts[tuple(result.token_ids)] += 1
        hist = hist + torch.tensor(result.accept_hist or [0])
        if first_trees is not None and trees:
            first_trees.append((result.token_ids[0], trees[0]))
    return counts, hist


def test_exact_distribution_matches_vanilla_sampling(small_vocab, chi2_pvalue):
    # checks the test's own reference: vanilla decoding samples from it
    sampling = Sampling(0.7, top_p=0.9)
    counts, _ = sample_first_tokens(Generator(small_vocab.target), sampling)
    assert chi2_pvalue(counts, exact_distribution(small_vocab.target, sampling, PROMPT)) > 1e-3


@pytest.mark.parametrize("sampling", [T1, Sampling(0.7, top_p=0.9)], ids=["T1", "T0.7-top-p0.9"])
@pytest.mark.parametrize("mode", SAMPLING_SPECS)
def test_speculative_sampling_follows_the_target_distribution(small_vocab, chi2_pvalue, mode, sampling):
    prompt = PROMPTS.get(mode, PROMPT)
    counts, hist = sample_first_tokens(small_vocab.generator(mode), sampling, prompt)
    tau = (hist * torch.arange(1, len(hist) + 1)).sum() / hist.sum()
    assert tau > 1.2 and hist[0] > 0  # cycles both accept and reject drafts, so the test means something
    assert chi2_pvalue(counts, exact_distribution(small_vocab.target, sampling, prompt)) > 1e-3


@pytest.fixture
def fresh_bonus(monkeypatch):
    """Breaks tree verification: the bonus becomes a new draw from the processed target distribution at the deepest
    accepted node (sampling.sample: a uniform of torch's generator, keyed by no position), instead of the draw there
    that missed every child."""
    real_draw, real_accept = sampling.lm_head_draw, spectree.accept
    last = {}

    def draw(output, h, kind, st=None, noise=None, rows=None, seen=None):  # every target draw, whichever way the backend makes it
        last["probs"] = sampling.rule_probs(output(h), st)
        return real_draw(output, h, kind, st, noise, rows, seen)

    def accept(tokens, parents, depths, draws, depth):
        accept_len, path, _ = real_accept(tokens, parents, depths, draws, depth)
        return accept_len, path, sampling.sample(last["probs"][path[-1]])

    monkeypatch.setattr(sampling, "lm_head_draw", draw)
    monkeypatch.setattr(spectree, "accept", accept)


@pytest.mark.parametrize("mode", ["eagle2", "eagle", "lookup", "eagle2-lookup"])
def test_sampling_test_rejects_a_fresh_bonus_draw(small_vocab, chi2_pvalue, fresh_bonus, mode):
    prompt = PROMPTS.get(mode, PROMPT)
    counts, _ = sample_first_tokens(small_vocab.generator(mode), T1, prompt)
    assert chi2_pvalue(counts, exact_distribution(small_vocab.target, T1, prompt)) < 1e-3


@pytest.mark.parametrize("mode", ["eagle2", "eagle"])
def test_sampling_test_rejects_one_noise_for_every_depth(small_vocab, chi2_pvalue, monkeypatch, mode):
    # The drafts and the verify's draws share one Gumbel row a depth, keyed by its position; the first position's row
    # at every depth ties a cycle's tokens to each other (the target would draw its argmax again wherever it stays as
    # likely).
    real = sampling.noise
    monkeypatch.setattr(sampling, "noise", lambda st, first, n, width: real(st, first, 1, width).expand(n, -1))
    counts, _ = sample_first_tokens(small_vocab.generator(mode), T1)
    assert chi2_pvalue(counts, exact_distribution(small_vocab.target, T1, PROMPT)) < 1e-3


def off_their_prefixs_usual_tree(first_trees) -> float:
    """The share of runs whose first tree is not the one most often drafted after the same first token."""
    by_first = {}
    for first, tree in first_trees:
        by_first.setdefault(first, []).append(tree)
    return sum(len(t) - max(t.count(x) for x in set(t)) for t in by_first.values()) / len(first_trees)


@pytest.mark.parametrize("mode", ["eagle2", "eagle"])
def test_sampling_follows_the_target_where_the_noise_shapes_the_trees(small_vocab, chi2_pvalue, mode):
    # Four tokens: the fourth is often a cycle's draw at depth 2 (noise row 2) or the KV after a 2-token acceptance.
    # (A thousand runs see a wrong coupling only where it is gross; tests/test_sampling.py's 100k Markov runs see them.)
    trees = []
    counts, hist = sample_first_tokens(small_vocab.noisy_generator(mode), T1, n=4, first_trees=trees)
    assert off_their_prefixs_usual_tree(trees) > 0.5  # the noise changes most trees
    assert hist[2:].sum() > 0.15 * hist.sum() and hist[0] > 0
    joint = exact_distribution(small_vocab.target, T1, PROMPT, n=4)
    assert chi2_pvalue(counts.sum(-1), joint.sum(-1)) > 1e-3 and chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3


T06 = Sampling(0.6)  # no top-k or top-p: the draws add the Gumbels times T and mask nothing


@pytest.mark.parametrize("mode", ["none", "lookup"])
def test_sampling_at_a_temperature_below_1_follows_the_target(small_vocab, chi2_pvalue, mode):
    # T = 0.6 against 1/0.6: Gumbels scaled by 1/T where T is wanted fail this (below), T = 1 cannot tell
    gen = Generator(small_vocab.target) if mode == "none" else small_vocab.generator(mode)
    counts, _ = sample_first_tokens(gen, T06)
    assert chi2_pvalue(counts, exact_distribution(small_vocab.target, T06, PROMPT)) > 1e-3


def test_the_temperature_test_rejects_noise_at_the_inverse_temperature(small_vocab, chi2_pvalue, monkeypatch):
    # argmax(logits + G / T) = argmax(T logits + G): a draw at temperature 1/T
    real = sampling.noise

    def noise(st, first, n, width):
        return real(st, first, n, width) / st.temperature.double() ** 2  # T G -> G / T

    monkeypatch.setattr(sampling, "noise", noise)
    counts, _ = sample_first_tokens(Generator(small_vocab.target), T06)
    assert chi2_pvalue(counts, exact_distribution(small_vocab.target, T06, PROMPT)) < 1e-3


TOP_K = Sampling(0.8, top_k=3)


@pytest.mark.parametrize("mode", ["none", "eagle2", "sps"])
def test_top_k_sampling_follows_the_target_distribution(small_vocab, chi2_pvalue, mode):
    gen = Generator(small_vocab.target) if mode == "none" else small_vocab.noisy_generator(mode)
    counts, hist = sample_first_tokens(gen, TOP_K)
    if mode != "none":
        assert hist[0] > 0 and hist[1:].sum() > 0
    expected = exact_distribution(small_vocab.target, TOP_K, PROMPT)
    assert int((expected > 0).sum()) == 27 and chi2_pvalue(counts, expected) > 1e-3  # 3 tokens a step, no more


def identical_answers(small_vocab, rows: int) -> tuple:
    """generate_batch over rows copies of PROMPT at T=1 (eagle2, noise-shaped trees): among pairs of rows that drew the
    same first token, the share whose next three tokens are identical too, and that share if the rows are independent."""
    torch.manual_seed(0)
    answers = [tuple(r.token_ids) for r in small_vocab.noisy_generator("eagle2").generate_batch([PROMPT] * rows, 4, T1, stop_ids=[])]
    same = [a[1:] == b[1:] for a, b in itertools.combinations(answers, 2) if a[0] == b[0]]
    joint = exact_distribution(small_vocab.target, T1, PROMPT, n=4).flatten(1)
    first = joint.sum(-1)
    independent = (joint ** 2).sum() / (first ** 2).sum()  # P(rest equal | first equal) for independent rows
    return sum(same) / len(same), independent.item()


def test_two_rows_with_one_prompt_answer_independently(small_vocab):
    observed, independent = identical_answers(small_vocab, 120)
    assert abs(observed - independent) < 0.1, (observed, independent)


def test_the_independence_test_rejects_rows_sharing_their_noise(small_vocab, monkeypatch):
    # the rows' per-row buffers without the key (batch.written): every row's steps read the one key SpecState holds,
    # the one the last row to begin set, so rows with one prompt and one first token give one answer
    real = batch.written

    def written(target, drafter, state):
        caches, drafts, st = real(target, drafter, state)
        return caches, drafts, {name: b for name, b in st.items() if name != "key"}

    monkeypatch.setattr(batch, "written", written)
    observed, independent = identical_answers(small_vocab, 120)
    assert abs(observed - independent) > 0.1, (observed, independent)


def test_a_draft_vocabulary_narrower_than_a_level_is_served_when_sampling(tiny):
    # Sampling's levels take widths[level] nodes, up to twice topk: 10 and 15 here, over a draft vocabulary of 8
    spec = TreeSpec("eagle2", 4, 8, 40)
    assert max(spec.widths) > 8
    vocab = torch.randperm(tiny.target.args.vocab_size, generator=torch.Generator().manual_seed(3))[:8]
    head = copy.deepcopy(tiny.head)
    head.draft_vocab = vocab
    use_draft_vocab(head, tiny.target.output)
    gen, trees = Generator(tiny.target, spec, head=head), []
    torch.manual_seed(0)
    lap = lambda name, **t: name == "accept" and trees.append(t["tokens"][1:].tolist())  # noqa: E731
    assert len(gen.generate(tiny.prompt, 30, T1, stop_ids=[], lap=lap).token_ids) == 30
    assert trees and all(len(t) == spec.num_draft_tokens and set(t) <= set(vocab.tolist()) for t in trees)
    assert gen.generate(tiny.prompt, NEW_TOKENS, GREEDY).token_ids == tiny.ref


def test_sampling_test_rejects_a_replacement_drawn_from_p(small_vocab, chi2_pvalue, monkeypatch, accept_chain_replacing_from_p):
    monkeypatch.setattr(spectree, "accept_chain", accept_chain_replacing_from_p)
    counts, _ = sample_first_tokens(small_vocab.generator("sps"), T1)
    assert chi2_pvalue(counts, exact_distribution(small_vocab.target, T1, PROMPT)) < 1e-3


@pytest.mark.parametrize("vocab,message", [([5, 3, 5, 0], "repeats token ids"), ([5, 64, 0], "outside the target's vocabulary"),
                                           ([5, -1, 0], "outside the target's vocabulary")])
def test_a_draft_vocabulary_is_a_set_of_target_ids(tiny_args, random_model, random_head, vocab, message):
    target, head = random_model(tiny_args(), seed=0), random_head(tiny_args(), seed=1)
    head.draft_vocab = torch.tensor(vocab)
    with pytest.raises(ValueError, match=message):
        use_draft_vocab(head, target.output)
    head.draft_vocab = torch.tensor([5, 3, 60, 0])
    with pytest.raises(ValueError, match="--draft-vocab 5 exceeds the head's draft vocabulary of 4"):
        use_draft_vocab(head, target.output, size=5)
