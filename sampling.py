# The target's sampling rule (vanilla decoding, every verifier, the data sampler): temperature, top-k, top-p, one draw per
# row. A step reads a sequence's rule as data (SpecState's temperature, top_k, top_p and key), so sequences with other
# rules share one compiled step; only the rule's kind is static (greedy, sample, truncate), since it decides what runs.
#
# Every draw at T > 0 is a Gumbel-max draw, argmax(logits + T * G), where G are Gumbels keyed by the sequence's key and
# the position of the token drawn (keyed_gumbel). The token at position q is then argmax over the kept tokens of
# log p(. | tokens before q) + G_q, whatever drafted it: a speculative cycle accepts a draft exactly when it equals that
# draw, so vanilla decoding and every tree give the same tokens for one key. What decided that a cycle stopped before
# position q read only the Gumbels of earlier positions, so G_q is still fresh when a later cycle draws there.
from dataclasses import dataclass

import torch
from torch import Tensor

import ops

KINDS = ("greedy", "sample", "truncate")  # what a step runs: argmax; + T * Gumbels; + top-k and top-p masks
MASK64 = (1 << 64) - 1


def logits_to_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The rule's distribution over each row of logits (temperature > 0): truncate's kept tokens (kept), renormalised."""
    rule = [torch.tensor(v, device=logits.device, dtype=d) for v, d in ((temperature, torch.float32), (top_k, torch.long), (top_p, torch.float64))]
    scaled = logits.float() / temperature
    if top_k or top_p < 1.0:
        scaled = scaled.masked_fill(~kept(logits, *rule), float("-inf"))
    return torch.softmax(scaled, dim=-1)


def order_keys(x: Tensor) -> Tensor:
    """float32 values -> int64 keys in the same order (their IEEE bits, the negative ones turned around)."""
    bits = x.float().view(torch.int32).long()
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)


def kth_key(keys: Tensor, k: Tensor) -> Tensor:
    """The order key of each row's k-th largest value (k >= 1): a bisection over the 2^32 keys, 32 counts of a row."""
    lo = torch.full(keys.shape[:-1], -(1 << 31), dtype=torch.long, device=keys.device)
    hi = torch.full_like(lo, (1 << 31) - 1)
    for _ in range(32):  # invariant: at least k keys are >= lo, and the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        ok = (keys >= mid.unsqueeze(-1)).sum(-1) >= k
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid - 1)
    return lo


def nucleus_key(probs: Tensor, top_p: Tensor) -> Tensor:
    """The smallest order key t of a probability whose tokens' mass strictly above t is below top_p: a token is kept when
    the mass of the tokens more probable than it is below top_p, its ties with it all kept or all dropped. A bisection
    over the 2^31 keys of non-negative floats, the masses summed in float64 (a top_p of 1e-300 keeps the top token)."""
    keys = order_keys(probs)
    p = probs.double()
    lo = torch.zeros(probs.shape[:-1], dtype=torch.long, device=probs.device)
    hi = torch.full_like(lo, (1 << 31) - 1)
    for _ in range(31):  # invariant: the mass above hi is below top_p, and the answer is in [lo, hi]
        mid = (lo + hi) // 2
        ok = torch.where(keys > mid.unsqueeze(-1), p, 0.0).sum(-1) < top_p
        lo, hi = torch.where(ok, lo, mid + 1), torch.where(ok, mid, hi)
    return lo


def kept(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """[..., V] bool: the tokens top-k (every token at least the k-th largest logit; k = 0 keeps all) and then top-p
    (over the distribution at the temperature, renormalised to top-k's tokens; p >= 1 keeps all) leave. Sorting-free:
    a sort of a 49k vocabulary costs a CPU 3 ms a row, the two bisections a tenth of that. The top token is always kept."""
    logits = logits.float()
    keys = order_keys(logits)
    keep = (keys >= kth_key(keys, top_k.clamp(min=1)).unsqueeze(-1)) | (top_k <= 0)
    t = torch.where(temperature > 0, temperature, 1.0)  # at T = 0 the draw is the top token, which every mask keeps
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")) / t, dim=-1)
    keep = keep & ((order_keys(probs) >= nucleus_key(probs, top_p).unsqueeze(-1)) | (top_p >= 1.0))
    return keep.reshape(logits.shape)  # a rule's (1,)-shaped values broadcast one row's logits to [1, V]


def key_of(seed: int) -> int:
    """A sequence's noise key from its seed (any integer): SplitMix64 of it, so that nearby seeds key far apart."""
    z = (seed * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return z - (1 << 64) if z >= 1 << 63 else z  # as int64


def random_key(device) -> int:
    """A fresh key from torch's generator (a sequence without a seed: torch.manual_seed still fixes its draws)."""
    return int(torch.randint(-(1 << 63), (1 << 63) - 1, (), dtype=torch.long, device="cpu"))


def to_uniform(k: Tensor) -> Tensor:
    """52-bit integers -> float64 uniforms in (0, 1): (2k + 1) / 2^53, the midpoint of one of 2^52 equal cells (exact in
    float64), so never 0 or 1 (log(0)) and within 2^-53 of a true uniform's CDF everywhere."""
    return k.double().mul_(2.0 ** -52).add_(2.0 ** -53)  # each step exact: k < 2^53, a power of two, then the odd bit


def uniform(shape, device) -> Tensor:
    """float64 uniforms in (0, 1) from torch's generator (ops.random_bits): the draws no key fixes (sps's acceptance)."""
    return to_uniform(ops.random_bits(shape, device))


def gumbel_of(u: Tensor) -> Tensor:
    """Standard Gumbels of float64 uniforms: argmax(log p + noise) is a draw from p (the Gumbel-max trick). Each token's
    probability is within V 2^-53 of exact (5e-12 at V = 49152); the noise spans [-3.6, 36.7]; float32 logits plus it
    are float64, so rounding makes no ties either."""
    noise = u.log_().neg_().log_().neg_()  # in place: eager makes no temporaries
    assert noise.dtype == torch.float64  # no float32 uniform feeds a draw at T > 0 (tests/test_sampling.py)
    return noise


def gumbel(shape, device) -> Tensor:
    return gumbel_of(uniform(shape, device))


def keyed_gumbel(keys: Tensor, width: int) -> Tensor:
    """[..., width] Gumbels, each row a function of its key (ops.keyed_bits)."""
    return gumbel_of(to_uniform(ops.keyed_bits(keys, width)))


def noise(st, first: Tensor, n: int, width: int) -> Tensor:
    """[n, width] float64: the Gumbels of positions first .. first + n - 1 of st's sequence (its key), times its
    temperature (0 at T = 0: the draw is then the argmax). st: anything with key and temperature (SpecState)."""
    positions = first + torch.arange(n, device=first.device)
    return st.temperature.double() * keyed_gumbel(st.key + positions, width)


def sample(probs: Tensor) -> Tensor:
    """One draw per row of probs (unnormalised is fine), no host sync: inverse CDF, one uniform a row. u in (0, 1) times
    the total stays below it in float64, so the draw is a token with mass and never one before the first with mass."""
    cdf = probs.double().cumsum(-1)
    u = uniform(probs.shape[:-1] + (1,), probs.device) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def lm_head_draw(output, h: Tensor, kind: str, st=None, noise=None, rows=None, seen=None) -> Tensor:
    """The target's draws from its LM head over h: draw's, from a backend's screen of the LM head where one serves
    (ops.lm_head_argmax: half its bytes) and no mask is needed. noise: a row for each of h's rows, or the rows of a
    table that rows picks (a tree's nodes draw with their depth's). seen: shaped's."""
    if kind != "truncate" and (drawn := ops.lm_head_argmax(output, h, noise, rows)) is not None:
        return drawn
    return draw(output(h), kind, st, noise if noise is None or rows is None else noise[rows], seen)


def logprobs(output, states: Tensor, tokens: list, top: int) -> list:
    """The target's log-probabilities of tokens (its own distribution, whatever the rule that drew them), token i from
    the LM head over states[i], with the top alternatives of each -> [(logprob, [(token, logprob), ...]), ...]."""
    logp = torch.log_softmax(output(states[: len(tokens)]).float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    best = logp.topk(top, dim=-1) if top else None
    return [(c, list(zip(best.indices[i].tolist(), best.values[i].tolist())) if top else []) for i, c in enumerate(chosen)]


def draw(logits: Tensor, kind: str, st=None, noise=None, seen=None) -> Tensor:
    """One token per row of logits: the argmax when greedy, else argmax(logits + noise) (noise: the rows' Gumbels times the
    temperature, sampling.noise), over truncate's kept tokens (st's top_k and top_p), truncate's logits shaped first."""
    if kind == "greedy":
        return ops.argmax(logits)
    if kind == "truncate":
        logits = shaped(logits, st, seen)
    scores = logits.float() + noise
    if kind == "truncate":
        scores = scores.masked_fill(~kept(logits, st.temperature, st.top_k, st.top_p), float("-inf"))
    return ops.argmax_scores(scores)


def shaped(logits: Tensor, st, seen=None) -> Tensor:
    """logits as OpenAI's logit_bias and penalties shape them before a draw, + bias - frequency * c - presence * (c > 0) with
    c each token's count in the answer (st.counts, plus seen: a tree node's path), then only st.allowed tokens left."""
    c = st.counts if seen is None else st.counts + seen
    return (logits.float() + st.bias - st.frequency * c - st.presence * (c > 0).float()).masked_fill(~st.allowed, float("-inf"))


def path_counts(tokens: Tensor, anc: Tensor, width: int) -> Tensor:
    """[n, width]: each token's count on each tree node's path below the root, the node included (anc: ancestor mask).
    index_put, as count: compiled under torch.vmap, scatter_add fixes the number of rows (batch.py)."""
    at = (torch.arange(len(anc), device=anc.device)[:, None].expand(-1, len(anc) - 1), tokens[1:].expand(len(anc), -1))
    return torch.zeros(len(anc), width, device=anc.device).index_put(at, anc[:, 1:].float(), accumulate=True)


def count(st, tokens: Tensor, weight: Tensor):  # st.counts += each token's weight (1 if committed)
    st.counts.add_(torch.zeros_like(st.counts).index_put((tokens,), weight.float(), accumulate=True))


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0
    top_p: float = 1.0
    # OpenAI's: added to a token's logit (token, bias), and subtracted per occurrence of it in the answer / once it occurs
    logit_bias: tuple = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @property
    def kind(self) -> str:
        """What a step runs for this rule (KINDS): a rule without top-k, top-p, bias or penalties needs no mask."""
        if self.logit_bias or self.frequency_penalty or self.presence_penalty:
            return "truncate"  # shaped logits (at T = 0 too: the argmax of the shaped logits)
        return "greedy" if self.temperature == 0 else "truncate" if self.top_k or self.top_p < 1.0 else "sample"

    def probs(self, logits: Tensor) -> Tensor:
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p)


def rule_probs(logits: Tensor, st) -> Tensor:
    """logits_to_probs with the rule read from st (a step's data; T > 0): sps's drafts and verify."""
    scaled = logits.float() / st.temperature.clamp(min=1e-30)
    return torch.softmax(scaled.masked_fill(~kept(logits, st.temperature, st.top_k, st.top_p), float("-inf")), dim=-1)
