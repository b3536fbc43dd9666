# Sampling's randomness (sampling.uniform, sampling.gumbel, and the Gumbels keyed by (key, position): sampling.noise)
# and the coupled drafts' exactness in distribution, checked through speculate's real cycle on a toy Markov chain (pure
# tensors, 100k samples vmapped at once as batch.py runs rows).
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batch
from cpu import kernels
import sampling
import spectree
import speculate
from draft import DraftHead
from eaglet import Generator
from sampling import Sampling
from speculate import SpecState, TreeSpec

pytestmark = pytest.mark.usefixtures("single_thread")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


# ---- the noise: float64 uniforms of 52 random bits, eager, vmapped and compiled ----

def check_uniforms(u: torch.Tensor, chi2_pvalue):
    """u: float64, every value an odd multiple of 2^-53 in (0, 1) (a float32 above 2^-29 has at most 24 significant bits,
    so none is one: torch.rand's k/2^24, Inductor's float32 rand at any dtype), its 52 bits uniform high and low."""
    assert u.dtype == torch.float64
    k = (u * 2.0 ** 53).cpu()
    assert bool(((k > 0) & (k < 2.0 ** 53) & (k % 2 == 1)).all())
    k = ((k.long() - 1) // 2).flatten()  # the 52-bit integer
    for bits in (k >> 44, k & 255, (k >> 20) & 255):  # the top, bottom and middle bytes
        assert chi2_pvalue(torch.bincount(bits, minlength=256), torch.full((256,), 1 / 256)) > 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_uniforms_have_52_random_bits_eager_vmapped_and_compiled(device, chi2_pvalue):
    shape = (4, 50_000)
    check_uniforms(sampling.uniform(shape, device), chi2_pvalue)
    rows = torch.vmap(lambda x: sampling.uniform(shape[1:], device) + x, randomness="different")(torch.zeros(4, 1, dtype=torch.float64, device=device))
    check_uniforms(rows, chi2_pvalue)
    assert not torch.equal(rows[0], rows[1])
    torch._dynamo.reset()

    def step(logits):  # what a compiled cycle draws: uniforms, the Gumbels, a coupled draw and an inverse-CDF one
        noise = sampling.gumbel(logits.shape, logits.device)
        return sampling.uniform(shape, logits.device), noise, sampling.draw(logits, "sample", noise=noise), sampling.sample(logits.softmax(-1))

    u, noise, coupled, drawn = torch.compile(step, fullgraph=True, dynamic=False)(torch.zeros(3, 49152, device=device))
    check_uniforms(u, chi2_pvalue)
    assert noise.dtype == torch.float64 and bool(noise.isfinite().all())
    assert torch.equal(coupled, noise.argmax(-1)) and drawn.shape == (3,)


def test_the_extreme_uniforms_give_finite_gumbels_and_draws_of_tokens_with_mass(monkeypatch):
    # k = 0 and 2^52 - 1 in turn, u = 2^-53 and 1 - 2^-53: log(0) nowhere, the noise spans [-3.6, 36.7] (float32's
    # [-2.8, 16.6]), and the inverse CDF never lands on a token without mass at either end
    def extremes(low, high, shape, **kw):
        n = torch.Size(shape).numel()
        return torch.tensor([0, high - 1], device=kw.get("device")).repeat(n)[:n].view(shape)

    monkeypatch.setattr(torch, "randint", extremes)
    assert sampling.uniform((2,), "cpu").tolist() == [2.0 ** -53, 1 - 2.0 ** -53]
    noise = sampling.gumbel((2,), "cpu")
    assert noise.dtype == torch.float64 and noise.tolist() == pytest.approx([-3.6037, 36.7368], abs=1e-4)
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0], [0.0, 1 / 3, 1 / 3, 0.0]])
    assert sampling.sample(probs.repeat_interleave(2, 0)).tolist() == [1, 2, 1, 2]


def test_gumbels_follow_the_gumbel_law(chi2_pvalue):
    torch.manual_seed(0)
    noise = sampling.gumbel((200_000,), "cpu")
    edges = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 5.0, 8.0], dtype=torch.float64)
    cdf = torch.cat([torch.zeros(1, dtype=torch.float64), torch.exp(-torch.exp(-edges)), torch.ones(1, dtype=torch.float64)])
    assert chi2_pvalue(torch.bincount(torch.bucketize(noise, edges), minlength=11), cdf.diff()) > 1e-3


@pytest.fixture
def no_torch_rand(monkeypatch):
    """torch.rand and torch.rand_like raise: every draw at T > 0 takes sampling.uniform's float64 uniforms instead."""
    def refuse(*args, **kwargs):
        raise AssertionError("a draw at T > 0 read torch.rand (float32 when compiled)")

    for name in ("rand", "rand_like"):
        monkeypatch.setattr(torch, name, refuse)


# kernels: the draws' ops through kernels.cpp where they serve (argmax, top-k, random bits), or torch's throughout
@pytest.mark.parametrize("cpp", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("mode", ["none", "eagle2", "eagle", "sps", "lookup", "eagle2-lookup"])
def test_no_draw_at_t_above_0_reads_torch_rand(tiny_args, random_model, random_head, no_torch_rand, monkeypatch, mode, cpp):
    if cpp and not kernels.build():
        pytest.skip("the C++ kernels do not run here")
    monkeypatch.setattr(kernels, "BUILT", cpp and kernels.BUILT)
    args = tiny_args()
    target = random_model(args, seed=0)
    spec = {"none": None, "eagle2": TreeSpec("eagle2", 3, 4, 8), "eagle": TreeSpec.static(), "sps": TreeSpec.chain("sps", 3),
            "lookup": TreeSpec.chain("lookup", 3), "eagle2-lookup": TreeSpec("eagle2", 3, 4, 8, lookup_slots=3)}[mode]
    gen = Generator(target, spec, head=random_head(args, seed=1) if spec and spec.mode.startswith("eagle") else None,
                    draft_model=random_model(args, seed=2) if mode == "sps" else None)
    for s in (Sampling(1.0), Sampling(0.7, top_k=5), Sampling(0.8, top_p=0.9)):
        assert len(gen.generate([1, 2, 3, 1, 2], 12, s, stop_ids=[]).token_ids) == 12


# ---- the coupling, exact in distribution: a Markov chain target and head through speculate.tree_cycle ----
#
# The target's next-token logits after a token are a fixed row (a Markov chain over V tokens), the head's are another
# chain's, close to it but not equal, over a draft vocabulary of V - 1 tokens in another order (noise[:, draft_vocab]).
# Both are modules speculate calls as it calls real ones (no KV: nothing depends on more than the last token). SAMPLES
# runs of the real cycle from one root, vmapped at once by batch.batched (the code generate_batch runs), each a sequence
# with a key of its own (SpecState.key, as a batch's rows hold theirs), commit their first 4 tokens, whose law is
# P(t1..t4) = p(root, t1) p(t1, t2) p(t2, t3) p(t3, t4): V^4 cells for a chi-square test. Four tokens take the trees to
# depth >= 3 and the noise rows >= 2 (one cycle can commit all four), and later cycles to positions an earlier cycle's
# noise rows already covered. The couplings broken below in the draws' noise must fail it, the real code pass; broken in
# the drafts, they change no token at all (test_a_key_commits_vanilla_decodings_tokens_whatever_the_drafts).

V = 6
ROOT = 2
SAMPLES = 100_000


class MarkovTarget(nn.Module):
    """speculate's target interface: (what its LM head reads, features) of a pass, the row of each token; its LM head
    the identity, so the first is the logits; no KV to keep."""

    def __init__(self, logits: torch.Tensor, max_seq_length: int):
        super().__init__()
        self.args = SimpleNamespace(vocab_size=logits.shape[0])
        self.max_seq_length = max_seq_length
        self.tok_embeddings = nn.Embedding(1, 1)  # read by the cycle, used by no head here
        self.output = nn.Identity()
        self.register_buffer("table", logits)

    def hidden(self, tokens, input_pos, cache_pos, mask):
        return self.table[tokens], F.one_hot(tokens, self.table.shape[0]).float()

    def keep_kv(self, rows, dst):
        pass


class MarkovHead(DraftHead):
    """A DraftHead whose feature is its token (one-hot) and whose draft logits over draft_vocab are that token's row."""

    def __init__(self, logits: torch.Tensor, draft_vocab: torch.Tensor, max_seq_length: int):
        super().__init__(SimpleNamespace(), len(draft_vocab))
        self.draft_vocab.copy_(draft_vocab)
        self.lm_head = nn.Identity()  # drafts over draft_vocab: target_ids maps through it
        self.max_seq_length = max_seq_length
        self.register_buffer("table", logits[:, draft_vocab])

    def forward(self, tokens, embedding, feature, input_pos, cache_pos, mask):
        return F.one_hot(tokens, self.table.shape[0]).float()

    def logits(self, h, target_output):
        return h @ self.table


def markov_chain():
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(1.5 * torch.randn(V, V, generator=g), -1)
    logq = torch.log_softmax(logp + 0.5 * torch.randn(V, V, generator=g), -1)  # q near p: the noise decides the trees
    return logp, logq, torch.randperm(V, generator=g)[: V - 1]


def de_bruijn(n: int) -> list:
    """Every pair of n tokens once, then the first again: the text's last 2-gram has always occurred (lookup slots)."""
    a, out = [0] * 3 * n, []

    def db(t, p):
        if t > 2:
            out.extend(a[1:p + 1] if 2 % p == 0 else [])
            return
        a[t] = a[t - p]
        db(t + 1, p)
        for j in range(a[t - p] + 1, n):
            a[t] = j
            db(t + 1, t)

    db(1, 1)
    return out + out[:1]


def prompt_of(spec: TreeSpec) -> list:
    return de_bruijn(V) if spec.lookup_slots else [0, 1]


def random_keys(n: int) -> torch.Tensor:
    """n keys from torch's generator, as sampling.random_key draws one for a sequence without a seed."""
    return torch.randint(-(1 << 63), (1 << 63) - 1, (n,), dtype=torch.long)


def run_cycles(spec: TreeSpec, samp: Sampling, n: int, pairs: bool = False, chain=None, cycles: int = 4, keys=None):
    """The first 4 tokens that n runs of speculate.tree_cycle from ROOT commit, [n, 4], and the cycles' accept-length
    histogram. Every run is a row of batch.batched with its rule and key (keys [n], random_keys' by default); pairs:
    rows 2i and 2i+1 two rows with one prompt, which run their cycles together (one answer done, its row still steps).
    chain: (log p, log q, draft vocabulary), markov_chain()'s by default. Each cycle commits a token at least; only the
    rows still short of 4 run again, up to cycles."""
    logp, logq, draft_vocab = chain or markov_chain()
    prompt = prompt_of(spec)
    length = len(prompt) + (cycles + 1) * (spec.depth + 1) + 2
    target, head = MarkovTarget(logp, length), MarkovHead(logq, draft_vocab, length)
    st = SpecState(spec, V, "cpu", vocab=V)
    if spec.history:
        st.register_buffer("history", torch.zeros(length, dtype=torch.long))
        st.history[: len(prompt) + 1] = torch.tensor(prompt + [ROOT])
    st.L.fill_(len(prompt))
    st.root.fill_(ROOT)
    st.n_pend.fill_(1)
    st.pend_tok[0] = ROOT
    st.set_rule(samp, 0)
    group = 2 if pairs else 1
    rows = {name: b.expand(n // group, group, *b.shape).clone() for name, b in st.named_buffers()}
    rows["key"].copy_((random_keys(n) if keys is None else keys).view(n // group, group, 1))
    cycle = batch.batched(speculate.tree_cycle)

    def step(sub: dict) -> torch.Tensor:  # -> [batches, group, depth + 2], sub's rows updated in place (through views)
        out = cycle(target, head, st, ({}, {}, {name: v.flatten(0, 1) for name, v in sub.items()}), spec, samp.kind)
        return out.view(-1, group, out.shape[-1])

    toks = torch.zeros(n // group, group, 5, dtype=torch.long)  # column 4 takes the tokens past the 4th
    count = torch.zeros(n // group, group, dtype=torch.long)
    hist = torch.zeros(spec.depth + 1, dtype=torch.long)
    j = torch.arange(spec.depth + 1)
    for _ in range(cycles):
        need = (count < 4).any(-1).nonzero().flatten()
        if not len(need):
            break
        sub = {name: v[need] for name, v in rows.items()}
        out = step(sub)
        for name, v in rows.items():
            v[need] = sub[name]
        accept = out[..., 0]
        hist += torch.bincount(accept.flatten(), minlength=spec.depth + 1)
        pos = torch.where(j <= accept[..., None], (count[need][..., None] + j).clamp(max=4), 4)
        toks[need] = toks[need].scatter(-1, pos, out[..., 1:])
        count[need] += accept + 1
    return toks[..., :4].reshape(n, 4), hist


def plain_tokens(samp: Sampling, keys: torch.Tensor, L: int) -> torch.Tensor:
    """The 4 tokens vanilla decoding (speculate.plain_step, batch.batched over a row a key) draws from ROOT at position
    L for each of keys, [n, 4]."""
    st = SpecState(None, V, "cpu", vocab=V)
    st.set_rule(samp, 0)
    st.L.fill_(L)
    st.root.fill_(ROOT)
    rows = {name: b.expand(len(keys), *b.shape).clone() for name, b in st.named_buffers()}
    rows["key"].copy_(keys[:, None])
    step, target = batch.batched(speculate.plain_step), MarkovTarget(markov_chain()[0], L + 6)
    return torch.stack([step(target, None, st, ({}, {}, rows), None, samp.kind)[:, 1] for _ in range(4)], -1)


def exact_law(samp: Sampling) -> torch.Tensor:
    """P(t1, t2, t3, t4) from ROOT, [V] * 4."""
    p = samp.probs(markov_chain()[0]).double()
    return p[ROOT][:, None, None, None] * p[:, :, None, None] * p[None, :, :, None] * p[None, None, :, :]


def law_pvalue(toks: torch.Tensor, samp: Sampling, chi2_pvalue) -> float:
    cells = ((toks[:, 0] * V + toks[:, 1]) * V + toks[:, 2]) * V + toks[:, 3]
    return chi2_pvalue(torch.bincount(cells, minlength=V ** 4), exact_law(samp))


T1 = Sampling(1.0)
COUPLED = {  # eagle2 widths (3, 3, 3, 1): 4 levels; the static tree 5
    "eagle2": (TreeSpec("eagle2", 4, 4, 10), T1),
    "eagle": (TreeSpec.static(), T1),
    "eagle2-lookup": (TreeSpec("eagle2", 4, 4, 10, lookup_slots=3), T1),
    "eagle2-T0.7-top-k4": (TreeSpec("eagle2", 4, 4, 10), Sampling(0.7, top_k=4)),
    # widths (3, 6, 4, 1): level 2 wider than the draft vocabulary of V - 1 = 5 (--draft-vocab below a level's width)
    "eagle2-wider-than-the-draft-vocabulary": (TreeSpec("eagle2", 4, 4, 14), T1),
    # depth 3, shallower than the 4 tokens counted: the token after a path accepted to full depth (the deepest nodes'
    # draw, noise row 3) is the 4th; in the trees above it is a 5th, never counted
    "eagle2-depth-3": (TreeSpec("eagle2", 3, 4, 10), T1),
}
PVALUES = {}  # case -> p-value, for a report of the figures


@pytest.mark.parametrize("mode", COUPLED)
def test_coupled_cycles_commit_the_targets_law(mode, chi2_pvalue):
    spec, samp = COUPLED[mode]
    torch.manual_seed(0)
    toks, hist = run_cycles(spec, samp, SAMPLES)
    # the trees hang on the noise: cycles reject at the root, and accept 3 or more deep, both often
    assert hist[0] > 0.005 * hist.sum() and hist[3:].sum() > 0.2 * hist.sum()
    PVALUES[mode] = p = law_pvalue(toks, samp, chi2_pvalue)
    assert p > 1e-3


def pair_pvalues(toks: torch.Tensor, chi2_pvalue) -> tuple:
    """Both rows' 4-token law (n samples), and the two rows' first 2 tokens against the product of their laws."""
    two = exact_law(T1).sum((2, 3)).flatten()  # P(t1, t2)
    a, b = toks[0::2, :2], toks[1::2, :2]
    joint = torch.bincount((a[:, 0] * V + a[:, 1]) * V * V + b[:, 0] * V + b[:, 1], minlength=V ** 4)
    return law_pvalue(toks, T1, chi2_pvalue), chi2_pvalue(joint, two[:, None] * two[None, :])


def test_two_rows_of_a_batch_with_one_prompt_sample_independently(chi2_pvalue):
    torch.manual_seed(0)
    toks, _ = run_cycles(COUPLED["eagle2"][0], T1, SAMPLES, pairs=True)
    PVALUES["batch-of-2"], PVALUES["batch-of-2-joint"] = law, joint = pair_pvalues(toks, chi2_pvalue)
    assert law > 1e-3 and joint > 1e-3


@pytest.mark.parametrize("samp", [T1, Sampling(0.7)], ids=["T1", "T0.7"])
@pytest.mark.parametrize("mode", ["eagle2", "eagle", "eagle2-lookup"])
def test_a_draft_equal_to_the_target_foresees_every_draw(mode, samp, monkeypatch):
    # With q = p, a level's best ranked node (log q + the noise row its parent's draw reads) is the token the target
    # draws there, so every cycle accepts the whole depth: the rows draft_coupled and draft_static slice line up with
    # the verify's (and with the draft vocabulary's columns: a permutation of every token here). A row off loses it.
    logp = markov_chain()[0]
    chain = (logp, logp, torch.randperm(V, generator=torch.Generator().manual_seed(1)))
    spec = COUPLED[mode][0]
    torch.manual_seed(0)
    _, hist = run_cycles(spec, samp, 2000, chain=chain, cycles=1)
    assert hist[spec.depth] == 2000, hist
    for module, name, fn in BROKEN["noise-row-d-ranks-depth-d"]():
        monkeypatch.setattr(module, name, fn)
    _, hist = run_cycles(spec, samp, 2000, chain=chain, cycles=1)
    assert hist[spec.depth] < 1000, hist


@pytest.mark.parametrize("mode", ["eagle2", "eagle"])
def test_sampled_drafts_rank_in_fp32(mode, monkeypatch):
    # The drafts rank by log q plus the verify's fp64 Gumbels rounded to fp32 (a rounding of the rows a level may rank
    # by), so a CPU ranks on eaglet::topk's fp32 rows, not torch's fp64 top-k; ranked in fp64 as the draws are, it would not.
    seen, topk = [], speculate.ops.topk
    monkeypatch.setattr(speculate.ops, "topk", lambda x, k: (seen.append(x.dtype), topk(x, k))[1])
    run_cycles(COUPLED[mode][0], T1, 4, cycles=1)
    assert seen and set(seen) == {torch.float32}, seen


# ---- couplings broken on purpose: in the drafts they cost acceptance, never a token; in the draws' noise the law test
# must fail them (and batch rows sharing their key) ----

def pool_rerank(target, head, st, spec, h_root, noise):
    """Broken: EAGLE-2's expansion and pool rerank (speculate.draft_dynamic) over its summed log-probs plus the verify's
    Gumbels: a shallow node's place in the tree hangs on deeper noise rows, which its own draws read."""
    noise = noise[:, head.draft_vocab] if len(head.draft_vocab) else noise
    k, ctx = spec.topk, speculate.ops.live_width(st.L - 1, head.max_seq_length)
    feat, anc = h_root.expand(k, -1), torch.zeros_like(st.scratch_eye[:k])

    def step(level, tok, parent):
        nonlocal feat, anc
        anc = anc[parent] | st.scratch_eye[(level - 1) * k:level * k]
        feat, logits = speculate.head_step(target, head, head.target_ids(tok), feat[parent], (st.L - 1 + level).expand(k),
                                           (level - 1) * k, speculate.scratch_mask(st, ctx, anc))
        return F.log_softmax(logits.float(), -1) + noise[level]

    root = F.log_softmax(head.logits(h_root, target.output).float(), -1) + noise[0]
    sel, pool_tok, pool_parent, pool_score = spectree.grow(root, step, k, spec.depth, spec.num_draft_tokens)
    tokens, parents = spectree.tree_from_pool(sel, head.target_ids(pool_tok), pool_parent, st.root)
    return tokens, parents, F.pad(pool_score[sel], (1, 0))


def noise_a_row_deeper(draft):
    """Broken: depth-d nodes ranked by noise row d, the row their own draws read (not d - 1, their parents')."""
    return lambda *args: draft(*args[:-1], args[-1][1:])


def rows_copying_row_1(noise):
    """Broken: the Gumbels of positions L + 3 and later are those of L + 2 again, so a cycle's draws below depth 1 are
    tied to each other."""
    def copied(st, first, n, width):
        g = noise(st, first, n, width)
        return torch.cat([g[:2], g[1:2].expand(n - 2, -1)])
    return copied


def parents_row(draw):
    """Broken: a depth-d node's draw reads noise row d - 1, its parent's (the root's, row 0, at depth 1), so a token
    drawn below an accepted draft shares the Gumbels of the token before it."""
    def drawn(output, h, kind, st=None, noise=None, rows=None, seen=None):
        return draw(output, h, kind, st, noise, None if rows is None else (rows - 1).clamp(min=0), seen)
    return drawn


def deepest_read_the_row_above(draw):
    """Broken: the deepest nodes' draws (the token after a path accepted to full depth) read the noise row of the depth
    above, the one their parents' draws read: that token is drawn with the Gumbels of the token before it."""
    def drawn(output, h, kind, st=None, noise=None, rows=None, seen=None):
        return draw(output, h, kind, st, noise, None if rows is None else rows.clamp(max=len(noise) - 2), seen)
    return drawn


BROKEN = {  # -> [(module, name, replacement)]
    "pool-rerank": lambda: [(speculate, "draft_coupled", pool_rerank)],
    "noise-row-d-ranks-depth-d": lambda: [(speculate, "draft_coupled", noise_a_row_deeper(speculate.draft_coupled)),
                                          (speculate, "draft_static", noise_a_row_deeper(speculate.draft_static))],
    "rows-copying-row-1": lambda: [(sampling, "noise", rows_copying_row_1(sampling.noise))],
    "draws-read-their-parents-row": lambda: [(sampling, "lm_head_draw", parents_row(sampling.lm_head_draw))],
    "deepest-draw-reads-the-row-above": lambda: [(sampling, "lm_head_draw", deepest_read_the_row_above(sampling.lm_head_draw))],
}
IN_THE_DRAFTS = ("pool-rerank", "noise-row-d-ranks-depth-d")
IN_THE_NOISE = ("rows-copying-row-1", "draws-read-their-parents-row", "deepest-draw-reads-the-row-above")


def counted(broken: str, spec: TreeSpec) -> bool:
    """Whether the 4 tokens counted can show broken: the deepest nodes' draw is the 4th only in a tree of depth 3 or less."""
    return broken != "deepest-draw-reads-the-row-above" or spec.depth < 4


@pytest.mark.parametrize("mode", ["eagle2", "eagle", "eagle2-lookup", "eagle2-T0.7-top-k4", "eagle2-depth-3"])
def test_a_key_commits_vanilla_decodings_tokens_whatever_the_drafts(mode, monkeypatch):
    # The token at a position is argmax(log p + T G) over the kept tokens, G keyed by (key, position), whatever drafted
    # it: the drafts decide how many tokens a cycle commits, never which. So a coupling broken in the drafts (a pool
    # rerank over deeper noise rows, ranks a noise row off) leaves every token as vanilla decoding's; one broken in the
    # draws' noise does not (and the law test below fails it).
    spec, samp = COUPLED[mode]
    torch.manual_seed(0)
    keys = random_keys(2000)
    want = plain_tokens(samp, keys, len(prompt_of(spec)))
    assert torch.equal(run_cycles(spec, samp, 2000, keys=keys)[0], want)
    for broken in IN_THE_DRAFTS + IN_THE_NOISE:
        if broken == "pool-rerank" and spec.mode != "eagle2" or not counted(broken, spec):
            continue  # it replaces draft_coupled, which only eagle2 runs; its token is past the 4 counted
        with monkeypatch.context() as m:
            for module, name, fn in BROKEN[broken]():
                m.setattr(module, name, fn)
            assert torch.equal(run_cycles(spec, samp, 2000, keys=keys)[0], want) == (broken in IN_THE_DRAFTS), broken


@pytest.mark.parametrize("broken,mode", [(b, m) for b in IN_THE_NOISE for m in ("eagle2", "eagle", "eagle2-depth-3")
                                         if counted(b, COUPLED[m][0])])
def test_the_law_test_rejects_a_broken_coupling(broken, mode, chi2_pvalue, monkeypatch):
    for module, name, fn in BROKEN[broken]():
        monkeypatch.setattr(module, name, fn)
    spec, samp = COUPLED[mode]
    torch.manual_seed(0)
    toks, _ = run_cycles(spec, samp, SAMPLES)
    PVALUES[f"{broken}-{mode}"] = p = law_pvalue(toks, samp, chi2_pvalue)
    assert p < 1e-3


def test_the_batch_test_rejects_rows_sharing_their_noise(chi2_pvalue):
    # the two rows of a batch given one key (as if a batch keyed its rows by their prompt): they give one answer
    torch.manual_seed(0)
    keys = random_keys(SAMPLES // 2).repeat_interleave(2)
    toks, _ = run_cycles(COUPLED["eagle2"][0], T1, SAMPLES, pairs=True, keys=keys)
    PVALUES["batch-of-2-one-key"], PVALUES["batch-of-2-one-key-joint"] = law, joint = pair_pvalues(toks, chi2_pvalue)
    assert joint < 1e-3 and bool((toks[0::2] == toks[1::2]).all())
