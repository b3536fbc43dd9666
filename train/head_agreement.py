# A head's agreement with the target along the target's own greedy answers, in minutes instead of a τ run's quarter
# hour (one thread: about 2.5 minutes for the answers, half a minute a head): the target answers N MT-bench first
# turns greedily (batched, its states kept), then each head is unrolled over them as training unrolls it (step 0
# reads the target's feature, an EAGLE-3 head its fused states; step i its own step i-1 output) and scored at every
# answer position: how often the target's argmax is the head's top-1 and lies in its top-10 at each step, and how
# often it lies outside the head's draft vocabulary (a token no tree can hold). Step 0's top-10 bounds the first tree
# level's acceptance.
# Teacher-forced: a proxy for τ, not τ (bench.py measures that).
#
#   python train/head_agreement.py heads/SmolLM2-135M-Instruct OTHER_HEAD --num-prompts 40
#   python train/head_agreement.py heads/SmolLM2-135M-Instruct:0    # :N drafts over an EAGLE-1/2 head's first N tokens (0: all)
#   python train/head_agreement.py heads/SmolLM2-135M-Instruct --sampled --steps 2   # T=1: top-k mass against coupled guesses
import sys
from pathlib import Path

if not __package__:  # run as a script (python bench/bench.py): the project's root, not this folder, is the import root
    sys.path[0] = str(Path(__file__).resolve().parents[1])
import os

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from checkpoint import default_checkpoint, load_model  # noqa: E402
from errors import UsageError, UsageParser  # noqa: E402
from train.distill import sample_batch  # noqa: E402
from draft import use_draft_vocab  # noqa: E402
from prompts import load_conversations  # noqa: E402
from sampling import draw as sampling_draw, gumbel  # noqa: E402
from tokenizer import encode_prompt, load_tokenizer  # noqa: E402
from train.train_draft import target_argmax, unrolled_steps  # noqa: E402
from weights import load_head  # noqa: E402


@torch.no_grad()
def agreement(head, target, answers: list, steps: int, k: int = 10) -> dict:
    """answers: (tokens, prompt_len, hidden, fused) per turn; a head with taps reads the target's states at them at step 0."""
    lm = target.output.weight.float()
    vocab = head.draft_vocab if len(head.draft_vocab) else torch.arange(len(lm))
    in_vocab = torch.zeros(len(lm), dtype=torch.bool).index_fill_(0, vocab, True)
    top1, topk, count, outside, positions = [0] * steps, [0] * steps, [0] * steps, 0, 0
    embed = target.tok_embeddings.weight.float()
    for tokens, prompt_len, hidden, fused in answers:
        T = len(tokens) - 1
        want_all = target_argmax(hidden.float()[None, 1:], lm)[0]  # [j]: the target's token after position j + 1
        padded = F.pad(tokens[None], (0, steps))
        feature = (fused if head.taps else hidden).float()[None, :T]
        for i, h in enumerate(unrolled_steps(head, embed, padded, feature, steps)):
            slots = torch.arange(max(0, prompt_len - 1 - i), T - i)  # step i at slot j drafts the token after j + 1 + i
            want = want_all[slots + i]
            drafted = head.target_ids(head.logits(h[0, slots], target.output).topk(k, -1).indices)
            top1[i] += int((drafted[:, 0] == want).sum())
            topk[i] += int((drafted == want[:, None]).any(-1).sum())
            count[i] += len(slots)
        outside += int((~in_vocab[want_all[prompt_len - 1:]]).sum())
        positions += len(want_all) - prompt_len + 1
    return {"top1": [a / n for a, n in zip(top1, count)], f"top{k}": [a / n for a, n in zip(topk, count)],
            "outside_vocab": outside / positions}


@torch.no_grad()
def sampled_agreement(head, target, answers: list, steps: int, ks=(1, 4, 10), draws: int = 8) -> dict:
    """Along sampled answers (T=1), how often the target's draw lies in the head's k candidates at each unrolled step: the
    head's k most probable tokens (the chance is their target mass, which sample-and-match accepts) against its k best by
    log q + Gumbel noise shared with the draw, argmax(log p + noise) (spectree.grow_coupled; draws noise rows a position)."""
    lm, embed = target.output.weight.float(), target.tok_embeddings.weight.float()
    ids = head.draft_vocab if len(head.draft_vocab) else torch.arange(len(lm))
    top, coupled, count = torch.zeros(steps, len(ks)), torch.zeros(steps, len(ks)), torch.zeros(steps)
    for tokens, prompt_len, hidden, fused in answers:
        T = len(tokens) - 1
        logp_all = torch.log_softmax(hidden.float()[1:] @ lm.T, -1)  # [j]: the target after position j + 1
        padded = F.pad(tokens[None], (0, steps))
        feature = (fused if head.taps else hidden).float()[None, :T]
        for i, h in enumerate(unrolled_steps(head, embed, padded, feature, steps)):
            slots = torch.arange(max(0, prompt_len - 1 - i), T - i)
            logp, logq = logp_all[slots + i], torch.log_softmax(head.logits(h[0, slots], target.output).float(), -1)
            mass = logp.exp().gather(-1, ids[logq.topk(max(ks), -1).indices]).cumsum(-1)
            top[i] += torch.stack([mass[:, k - 1].sum() for k in ks])
            for _ in range(draws):
                noise = gumbel(logp.shape, logp.device)
                draw = sampling_draw(logp, "sample", noise=noise)
                hit = (ids[(logq + noise[:, ids]).topk(max(ks), -1).indices] == draw[:, None]).cumsum(-1)
                coupled[i] += torch.stack([hit[:, k - 1].sum() for k in ks]) / draws
            count[i] += len(slots)
    return {f"top{k}": (top[:, j] / count).tolist() for j, k in enumerate(ks)} | \
           {f"coupled{k}": (coupled[:, j] / count).tolist() for j, k in enumerate(ks)}


def load_heads(specs: list, target) -> dict:
    """Every head, loaded before the answers' minutes are spent; sets target.taps to the layers the tapped ones read."""
    heads = {}
    for spec in specs:
        path, _, size = spec.partition(":")
        try:
            heads[spec] = use_draft_vocab(load_head(path, target.args), target.output, int(size) if size else None)
        except (ValueError, OSError) as e:  # e.g. :N on an EAGLE-3 head, which drafts over its own vocabulary
            raise UsageError(f"{spec}: {e}") from None
    taps = {head.taps for head in heads.values() if head.taps}  # from a head's config (an EAGLE-3 head's: or the official ones)
    if len(taps) > 1:
        raise UsageError(f"the heads read different target layers ({sorted(taps)}): compare them in separate runs")
    target.taps = taps.pop() if taps else ()  # the fused states are kept only when a head reads them
    return heads


def main() -> int:
    p = UsageParser()
    p.add_argument("heads", nargs="+", help="head directories, each optionally :N (draft over its first N tokens; 0: all)")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=6, help="unrolled steps: the tree's depth")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sampled", action="store_true", help="sampled answers (T=1): the draw in the head's k most probable "
                   "tokens against its k best coupled guesses (sampled_agreement)")
    try:
        opts = p.parse_args()
        torch.set_num_threads(opts.threads)
        checkpoint = default_checkpoint()
        target, tok = load_model(checkpoint, "cpu", torch.float32), load_tokenizer(checkpoint)
        heads = load_heads(opts.heads, target)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = [encode_prompt(tok, target.args, [{"role": "user", "content": c[0]}], True) for c in load_conversations(limit=opts.num_prompts)]
    torch.manual_seed(0)
    temperature = torch.full((len(prompts),), float(opts.sampled))
    rows = sample_batch(target, prompts, opts.max_new_tokens, temperature, 1.0, target.args.stop_tokens, batch=16, states=True)
    answers = [(torch.tensor(p + new), len(p), hidden, fused) for p, (new, hidden, fused) in zip(prompts, rows)]
    kind = "sampled (T=1)" if opts.sampled else "greedy"
    print(f"{opts.num_prompts} MT-bench first turns, {sum(len(r[0]) for r in rows)} {kind} answer tokens, fp32 target")
    for spec, head in heads.items():
        head.setup_caches(opts.max_new_tokens + max(map(len, prompts)) + opts.steps)
        for layer in head.layers:
            layer.attention.kv_cache = None  # unrolled_steps attends within the answer, as training does
        if opts.sampled:
            r = sampled_agreement(head, target, answers, opts.steps)
            print(f"{spec}: " + "  ".join(f"{name} {' '.join(f'{x:.3f}' for x in v)}" for name, v in r.items()), flush=True)
            continue
        r = agreement(head, target, answers, opts.steps)
        print(f"{spec}: outside vocab {r['outside_vocab']:.3f}  top1 {' '.join(f'{x:.3f}' for x in r['top1'])}  "
              f"top10 {' '.join(f'{x:.3f}' for x in r['top10'])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
