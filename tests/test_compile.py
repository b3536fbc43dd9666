# torch.compile wiring: compiled steps give the eager tokens and never recompile once warm. On a GPU
# the decode step and the cycle are CUDA graphs (mode reduce-overhead); on CPU plain inductor code.
import pytest
import torch
import torch._dynamo

from generate import Generator, Sampling, TreeSpec

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


def prompts(lengths):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", [None, TreeSpec("eagle2", depth=3, topk=4, num_draft_tokens=8), TreeSpec("lookup", depth=4, topk=1, num_draft_tokens=0)],
                         ids=["none", "eagle2", "lookup"])
def test_compiled_matches_eager_without_recompiling(tiny_args, random_model, random_head, single_thread, device, spec):
    args = tiny_args()
    target, head = random_model(args, seed=0).to(device), random_head(args, seed=1).to(device)
    head = head if spec else None
    eager = Generator(target, spec, head=head)
    compiled = Generator(target, spec, head=head, compile=True)
    torch._dynamo.reset()
    first, *rest = prompts([7, 13, 29])
    assert compiled.generate(first, 24, Sampling()).token_ids == eager.generate(first, 24, Sampling()).token_ids
    # A new prompt length must reuse the dynamic prefill graph, and the decode step / cycle must
    # replay as they are: any recompilation raises here.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in rest:
            assert compiled.generate(prompt, 24, Sampling()).token_ids == eager.generate(prompt, 24, Sampling()).token_ids


def test_many_tree_shapes_in_one_process_each_get_their_own_compile_cache(tiny_args, random_model, random_head, single_thread, monkeypatch):
    # Dynamo's recompile limit is per code object; were the cycles of all Generators one code object, the
    # ninth tree shape would raise FailOnRecompileLimitHit under fullgraph. The eager backend runs Dynamo's
    # tracing, guards and caches without Inductor's codegen (test_compiled_matches_eager covers Inductor).
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **(kw | {"backend": "eager"})))
    args = tiny_args()
    target, head = random_model(args, seed=0), random_head(args, seed=1)
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)  # else Dynamo falls back to eager, silently
    shapes = [(m, d, k) for d, k in [(2, 2), (3, 2), (3, 4), (4, 3)] for m in (2, 5, 8)]
    specs = [TreeSpec("eagle2", depth=d, topk=k, num_draft_tokens=m) for m, d, k in shapes] + [TreeSpec("eagle", 5, 10, 25)]
    prompt = prompts([9])[0]
    reference = Generator(target).generate(prompt, 12, Sampling()).token_ids
    cycles = []
    for spec in specs:
        gen = Generator(target, spec, head=head, compile=True)
        assert gen.generate(prompt, 12, Sampling()).token_ids == reference
        cycles.append(gen.cycle)
    assert len(specs) >= 13
    assert len({id(c._torchdynamo_orig_callable.__code__) for c in cycles}) == len(specs)  # one cache each
