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
@pytest.mark.parametrize("spec", [None, TreeSpec("eagle2", depth=3, topk=4, num_draft_tokens=8)], ids=["none", "eagle2"])
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
