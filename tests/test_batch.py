# Batches (Generator.generate_batch, batch.py): every row of a batch is exactly what its prompt gives alone.
import copy
from types import SimpleNamespace

import pytest
import torch

import batch
import quant
import sampling
import spectree
from eaglet import Generator
from sampling import Sampling
from speculate import TreeSpec
from test_speculative import PROMPT, SAMPLING_SPECS, T1, V, exact_distribution, fresh_bonus, make_generator  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = Sampling()
NEW_TOKENS = 40
SPECS = {
    "none": None,
    "eagle2": TreeSpec("eagle2", 4, 4, 10),
    "eagle": TreeSpec.static(),
    "eagle2-lookup": TreeSpec("eagle2", 4, 4, 8, lookup_slots=4),
    "lookup": TreeSpec.chain("lookup", 4),
    "sps-self": TreeSpec.chain("sps", 4),  # the target drafts for itself: every cycle commits 5, so limits fall mid-cycle
}


@pytest.fixture(scope="module")
def tiny(single_thread, tiny_args, random_model, random_head, random_eagle3_head):
    args = tiny_args()
    target = random_model(args, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in (10, 3, 17, 6)]
    alone = [Generator(target).generate(p, NEW_TOKENS, GREEDY).token_ids for p in prompts]
    others = {t for i, r in enumerate(alone) if i != 1 for t in r}
    stop = [next(t for t in alone[1][4:] if t not in others)]  # ends row 1 early; the others go to the token limit
    refs = [Generator(target).generate(p, NEW_TOKENS, GREEDY, stop).token_ids for p in prompts]
    heads = {"eagle": random_head(args, seed=1), "eagle3": random_eagle3_head(args, seed=1)}
    return SimpleNamespace(target=target, prompts=prompts, refs=refs, stop=stop, heads=heads)


def generator(tiny, name, head="eagle", compile=False):
    spec = SPECS[name]
    if spec is None:
        return Generator(tiny.target, compile=compile)
    return Generator(tiny.target, spec, head=tiny.heads[head] if spec.mode in ("eagle", "eagle2") else None,
                     draft_model=tiny.target if spec.mode == "sps" else None, compile=compile)


def test_the_batch_has_an_early_stop_and_rows_at_the_token_limit(tiny):
    lengths = [len(r) for r in tiny.refs]
    assert lengths[1] < NEW_TOKENS and tiny.refs[1][-1] in tiny.stop
    assert lengths.count(NEW_TOKENS) >= 2 and all(len(set(r)) >= 8 for r in tiny.refs if len(r) == NEW_TOKENS)


@pytest.mark.parametrize("B", [2, 3, 4])
@pytest.mark.parametrize("name", SPECS)
def test_every_row_equals_its_prompt_alone(tiny, name, B):
    results = generator(tiny, name).generate_batch(tiny.prompts[:B], NEW_TOKENS, GREEDY, tiny.stop)
    assert [r.token_ids for r in results] == tiny.refs[:B]
    if name == "sps-self":  # the limit fell inside a cycle: it committed more than was kept
        assert all(sum((a + 1) * c for a, c in enumerate(r.accept_hist)) + 1 > len(r.token_ids) for r, ref in zip(results, tiny.refs) if len(ref) == NEW_TOKENS)


@pytest.mark.parametrize("name", ["none", "eagle2", "eagle2-lookup", "lookup", "sps-self"])
def test_two_rows_answer_four_prompts_each_as_alone(tiny, name):
    """A row that is done takes the next waiting prompt: prompt 1 stops early, so prompt 2 enters its row while
    prompt 0 is still being answered beside it, and prompt 3 takes whichever row is done next."""
    gen = generator(tiny, name)
    results = gen.generate_batch(tiny.prompts, NEW_TOKENS, GREEDY, tiny.stop, batch_size=2)
    assert gen.rows.count == 2 and [r.token_ids for r in results] == tiny.refs
    if name not in ("none", "lookup"):  # each answer counts its own cycles' tokens, not its row's (a batch's lookup always drafts)
        assert all(0 < sum((a + 1) * c for a, c in enumerate(r.accept_hist)) <= len(r.token_ids) for r in results)


@pytest.mark.parametrize("name", ["eagle2", "eagle"])
def test_rows_with_an_eagle3_head_equal_their_prompts_alone(tiny, name):
    results = generator(tiny, name, head="eagle3").generate_batch(tiny.prompts[:3], NEW_TOKENS, GREEDY, tiny.stop)
    assert [r.token_ids for r in results] == tiny.refs[:3]


def test_a_batch_row_counts_its_own_cycles(tiny):
    gen = generator(tiny, "sps-self")
    alone = gen.generate(tiny.prompts[0], NEW_TOKENS, GREEDY)
    row = gen.generate_batch(tiny.prompts[:2], NEW_TOKENS, GREEDY)[0]
    assert (row.token_ids, row.cycles, row.accept_hist) == (alone.token_ids, alone.cycles, alone.accept_hist)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_rows_of_a_quantised_target_equal_their_prompts_alone(tiny, random_head, mode):
    target = quant.quantize_model(copy.deepcopy(tiny.target), mode, 32 if mode == "int4" else 0)
    refs = [Generator(target).generate(p, NEW_TOKENS, GREEDY).token_ids for p in tiny.prompts[:2]]
    gen = Generator(target, SPECS["eagle2"], head=tiny.heads["eagle"])
    assert [r.token_ids for r in gen.generate_batch(tiny.prompts[:2], NEW_TOKENS, GREEDY)] == refs


def test_compiled_rows_of_a_quantised_target_equal_their_prompts_alone(tiny):
    """Compiled in fp32 on a CPU, an int8 layer runs quant.int8_rows_mm: plain tensor code, which vmap batches (the
    eager pack kernel has no vmap rule and runs once per row)."""
    target = quant.quantize_model(copy.deepcopy(tiny.target), "int8")
    assert target.output.words is not None
    refs = [Generator(target).generate(p, NEW_TOKENS, GREEDY).token_ids for p in tiny.prompts[:2]]
    gen = Generator(target, compile=True)  # vanilla: one row a layer, the rows kernel's case
    assert [r.token_ids for r in gen.generate_batch(tiny.prompts[:2], NEW_TOKENS, GREEDY)] == refs


def test_compiled_batches_equal_their_prompts_alone_without_recompiling(tiny):
    from torch._dynamo.utils import counters

    gen = generator(tiny, "eagle2", compile=True)
    first = gen.generate_batch(tiny.prompts[:2], NEW_TOKENS, GREEDY, tiny.stop)
    graphs = counters["stats"]["unique_graphs"]
    second = gen.generate_batch(tiny.prompts[2:4], NEW_TOKENS, GREEDY, tiny.stop)  # another conversation, same B
    queued = gen.generate_batch(tiny.prompts, NEW_TOKENS, GREEDY, tiny.stop, batch_size=2)  # rows taking waiting prompts
    assert counters["stats"]["unique_graphs"] == graphs
    assert [r.token_ids for r in first + second] == tiny.refs == [r.token_ids for r in queued]
    three = gen.generate_batch(tiny.prompts[:3], NEW_TOKENS, GREEDY, tiny.stop)  # the rows' dim is dynamic: one graph for every count
    assert counters["stats"]["unique_graphs"] == graphs and [r.token_ids for r in three] == tiny.refs[:3]


def test_a_compiled_shaped_row_alone_then_beside_others_answers_as_alone(tiny):
    """serve.py's warm-up order: a lone row of a truncating rule (top-p, a penalty) takes the batched plain step beside a
    second row, in rows made for more; the step compiled then serves every count of rows (scatter_add under vmap fixed
    the rows' dim at the first count, and the server failed to start). Each row draws as eager decoding alone."""
    rule = Sampling(1.0, top_p=0.9, frequency_penalty=0.5, logit_bias=((3, 2.0),))
    want = [generator(tiny, "eagle2-lookup").generate(p, 8, rule, tiny.stop, seed=i).token_ids for i, p in enumerate(tiny.prompts[:3])]
    gen = generator(tiny, "eagle2-lookup", compile=True)
    gen.reserve(64)  # as the engine does: caches for every request, before the rows
    rows = batch.Batch(gen, 4, 4)
    for n in (1, 3):
        got = [[] for _ in range(n)]
        for i in range(n):
            rows.add(batch.Seq(tiny.prompts[i], rule, sampling.key_of(i), lambda new, _, out=got[i]: out.extend(new) or (
                len(out) < 8 and out[-1] not in tiny.stop)))
        while rows.live:
            rows.step()
        assert [g[:8] for g in got] == want[:n]


def test_compiled_generators_sharing_a_target_take_turns_without_recompiling(tiny):
    """bench.py warms every row up, then times them in turns: here eagle2 with two tree sizes and vanilla, compiled, on
    one target. The tree verify's K/V rows are sized per tree, so a vanilla batch must not carry them in its rows."""
    from torch._dynamo.utils import counters

    gens = [generator(tiny, "eagle2", compile=True), generator(tiny, "none", compile=True),
            Generator(tiny.target, TreeSpec("eagle2", 2, 4, 4), head=tiny.heads["eagle"], compile=True)]
    for gen in gens:
        gen.reserve(64)  # as bench.py does, outside inference mode: the buffers a later reserve makes inside must match
        gen.generate_batch(tiny.prompts[:2], NEW_TOKENS, GREEDY, tiny.stop)  # every step the turns reach: a lone row's too
    graphs = counters["stats"]["unique_graphs"]
    for gen in gens[::-1]:  # vanilla now follows the other tree size than at its warm-up
        assert [r.token_ids for r in gen.generate_batch(tiny.prompts[:2], NEW_TOKENS, GREEDY, tiny.stop)] == tiny.refs[:2]
    assert counters["stats"]["unique_graphs"] == graphs


# ---- sampling: each row of a B = 2 batch draws its first three tokens from the target's distribution ----

SAMPLES = 1000
ROW_PROMPTS = [PROMPT, [3, 0, 6, 6, 1]]


@pytest.fixture(scope="module")
def small_vocab(single_thread, tiny_args, random_model, random_head):
    args = tiny_args(dim=32, n_head=4, n_local_heads=2, intermediate_size=64, vocab_size=V, block_size=128)
    target = random_model(args, seed=0)
    head = random_head(args, seed=1)
    return SimpleNamespace(target=target, generator=lambda mode: make_generator(target, SAMPLING_SPECS[mode], head))


def sample_rows(gen, sampling):
    torch.manual_seed(0)
    counts, hist = torch.zeros(len(ROW_PROMPTS), *[V] * 3), 0
    for _ in range(SAMPLES):
        for b, r in enumerate(gen.generate_batch(ROW_PROMPTS, 3, sampling)):
            counts[b][tuple(r.token_ids)] += 1
            hist = hist + torch.tensor(r.accept_hist)
    return counts, hist


@pytest.mark.parametrize("mode", ["eagle2", "eagle"])
def test_each_rows_sampling_follows_the_target_distribution(small_vocab, chi2_pvalue, mode):
    counts, hist = sample_rows(small_vocab.generator(mode), T1)
    assert hist[1:].sum() > 0 and hist[0] > 0  # drafts were both accepted and rejected
    for b, prompt in enumerate(ROW_PROMPTS):
        assert chi2_pvalue(counts[b], exact_distribution(small_vocab.target, T1, prompt)) > 1e-3


def test_the_row_sampling_test_rejects_a_fresh_bonus_draw(small_vocab, chi2_pvalue, fresh_bonus):
    counts, _ = sample_rows(small_vocab.generator("eagle2"), T1)
    assert all(chi2_pvalue(counts[b], exact_distribution(small_vocab.target, T1, p)) < 1e-3 for b, p in enumerate(ROW_PROMPTS))


# ---- the default model (SmolLM2-135M-Instruct, fp32) with a random EAGLE head ----

def test_rows_on_smollm2_equal_their_prompts_alone(smollm2):
    import dataclasses

    from draft import EagleHead
    from tokenizer import encode_prompt

    target, tokenizer = smollm2
    args = target.args
    questions = ["Name three rivers in Europe.", "Write a haiku about autumn leaves falling on a quiet pond.", "What is 2+2?"]
    prompts = [encode_prompt(tokenizer, args, [{"role": "user", "content": q}], chat=True) for q in questions]
    refs = [Generator(target).generate(p, 24, GREEDY, args.stop_tokens).token_ids for p in prompts]
    torch.manual_seed(0)
    head = EagleHead(dataclasses.replace(args, n_layer=1)).eval()
    for spec in (None, TreeSpec("eagle2", 4, 6, 16)):
        gen = Generator(target, spec, head=head if spec else None)
        assert [r.token_ids for r in gen.generate_batch(prompts, 24, GREEDY, args.stop_tokens)] == refs
