# The target's forward hands a draft head its features from the pass it already runs.
import torch

from model import causal_mask, eagle3_taps


def test_taps_return_the_states_entering_those_layers(tiny_args, random_model):
    model = random_model(tiny_args(n_layer=6), seed=0)
    model.setup_caches(32)
    idx = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9)
    logits, h = model(idx, pos, pos, causal_mask(pos, 32))
    assert model.taps == () and torch.equal(h, model.hidden(idx, pos, pos, causal_mask(pos, 32))[0])

    model.taps = eagle3_taps(6)
    assert model.taps == (2, 3, 3)
    tapped_logits, fused = model(idx, pos, pos, causal_mask(pos, 32))
    entering, x = [], model.tok_embeddings(idx)  # an independent walk over the layers
    rope = model.rope[pos][None]
    for layer in model.layers:
        entering.append(x)
        x = layer(x, rope, pos, causal_mask(pos, 32))
    assert torch.equal(tapped_logits, logits)
    assert torch.allclose(fused, torch.cat([entering[2], entering[3], entering[3]], -1), atol=1e-6)
    assert eagle3_taps(30) == (2, 15, 27)
