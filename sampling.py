# The target's sampling rule (vanilla decoding, every verifier, the data sampler): temperature, top-k, top-p, one draw per row.
from dataclasses import dataclass

import torch
from torch import Tensor

import ops


def logits_to_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def uniform(shape, device) -> Tensor:
    """float64 uniforms in (0, 1), for every draw at T > 0: (2k + 1) / 2^53 for k uniform in [0, 2^52), the midpoint of
    one of 2^52 equal cells (exact in float64), so never 0 or 1 (log(0)) and within 2^-53 of a true uniform's CDF
    everywhere. Built from random integers because torch.rand is not float64 compiled: Inductor's rand (C++ and Triton)
    is a float32 draw at any dtype (k/2^24 near 1), where its randint is 64 random bits (modulo 2^52: unbiased). k comes
    from ops.random_bits (on a CPU with the kernels, large tables from kernels.cpp's counter-based generator)."""
    k = ops.random_bits(shape, device)
    return k.double().mul_(2.0 ** -52).add_(2.0 ** -53)  # each step exact: k < 2^53, a power of two, then the odd bit


def gumbel(shape, device) -> Tensor:
    """Standard Gumbel noise, float64: argmax(log p + noise) is a draw from p (the Gumbel-max trick). Each token's
    probability is within V 2^-53 of exact (5e-12 at V = 49152): a Gumbel is a monotone map of its uniform, so its CDF F
    is within 2^-53 of the true one's; P(draw = i) = E[prod_{j != i} F(l_i - l_j + G_i)] moves at most 2^-53 a factor,
    and the product is monotone in G_i, so its mean moves at most 2^-53 more. From float32 uniforms the noise lay in
    [-2.8, 16.6] and a token below 3.6e-9 of the top one's probability was never drawn; here it spans [-3.6, 36.7].
    Float32 log-probs plus this noise are float64, so rounding makes no ties either."""
    noise = uniform(shape, device).log_().neg_().log_().neg_()  # in place: eager makes no temporaries
    assert noise.dtype == torch.float64  # no float32 uniform feeds a draw at T > 0 (tests/test_sampling.py)
    return noise


def sample(probs: Tensor) -> Tensor:
    """One draw per row of probs (unnormalised is fine), no host sync: inverse CDF, one uniform a row (far cheaper than
    an exponential race). u in (0, 1) times the total stays below it in float64, so the draw is a token with
    mass (the clamp is never needed) and never one before the first with mass."""
    cdf = probs.double().cumsum(-1)
    u = uniform(probs.shape[:-1] + (1,), probs.device) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def draw(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, noise=None) -> Tensor:
    """One token per row of logits: argmax at temperature 0, else a sample of the processed distribution; with noise
    (Gumbels, a row each), the sample those make, argmax(log p + noise), which drafts coupled to it can foresee."""
    if temperature == 0:
        return ops.argmax(logits)
    if noise is not None:  # a row's log-normaliser does not move its argmax; -inf where top-k or top-p drop a token
        scaled = logits_to_probs(logits, temperature, top_k, top_p).log() if top_k or top_p < 1.0 else logits.float() / temperature
        return ops.argmax(scaled + noise)
    return sample(logits_to_probs(logits, temperature, top_k, top_p))


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0
    top_p: float = 1.0

    def draw(self, logits: Tensor, noise=None) -> Tensor:
        return draw(logits, self.temperature, self.top_k, self.top_p, noise)

    def probs(self, logits: Tensor) -> Tensor:
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p)

    def draft_logprobs(self, logits: Tensor) -> Tensor:
        """A draft's log-probs at the temperature up to a row's constant, which coupled ranks cancel; untruncated: top-k
        and top-p cut the target's distribution, and a head's own nucleus is not the target's (at T=0.7, top-p 0.9,
        cutting the head's too took a test's τ to 1.12)."""
        return logits.float() / self.temperature
