# The EAGLE-2 paper's Figure 6 from a real run: the draft head's confidence in each drafted token (its
# probability given its parent) against how often the target accepted it, greedy, per confidence bin.
# Only nodes whose parent was accepted count: the target never tests the children of a rejected node.
import sys
from pathlib import Path

if not __package__:  # run as a script (python bench/bench.py): the project's root, not this folder, is the import root
    sys.path[0] = str(Path(__file__).resolve().parents[1])
import interrupt  # noqa: F401  first of all: Ctrl-C during the imports below exits 130 in one line too
import json

import torch

import atomic
import spectree
import tp
from eaglet import GREEDY, Generator, acceptance_metrics, load_generator
from errors import UsageError, UsageParser
from prompts import MT_BENCH, load_conversations
from tokenizer import encode_prompt


class Calibration:
    """A Generator.generate lap hook that counts, per confidence bin, the drafted nodes the target
    tested and accepted."""

    def __init__(self, bins: int, depth: int):
        self.bins, self.depth = bins, depth
        self.tested = torch.zeros(bins, dtype=torch.long)
        self.accepted = torch.zeros(bins, dtype=torch.long)
        self.confidence = torch.zeros(bins, dtype=torch.float64)  # summed over tested nodes
        self.acceptance = {}  # tau and per-depth rates of the whole run (eaglet.acceptance_metrics)

    def __call__(self, phase, tokens=None, parents=None, draws=None, scores=None):
        if phase == "accept":
            self.add(tokens, parents, draws, scores)

    def add(self, tokens, parents, draws, scores):
        """One verified tree; scores are summed draft log-probs, so a node's confidence is
        exp(score - parent's score)."""
        accepted = spectree.accepted_nodes(tokens, parents, draws, self.depth)
        tested = accepted[parents]
        confidence = (scores - scores[parents]).exp()
        tested, accepted, confidence = tested[1:].cpu(), accepted[1:].cpu(), confidence[1:].double().cpu()  # the root is no draft
        accepted, confidence = accepted[tested], confidence[tested]
        bucket = (confidence * self.bins).long().clamp(max=self.bins - 1)
        self.tested += torch.bincount(bucket, minlength=self.bins)
        self.accepted += torch.bincount(bucket[accepted], minlength=self.bins)
        self.confidence += torch.bincount(bucket, weights=confidence, minlength=self.bins)

    def report(self) -> dict:
        tested, accepted = self.tested.sum().item(), self.accepted.sum().item()
        return {
            "bin_edges": [round(i / self.bins, 4) for i in range(self.bins + 1)],
            "tested": self.tested.tolist(),
            "accepted": self.accepted.tolist(),
            "acceptance_rate": [ratio(a, t) for a, t in zip(self.accepted.tolist(), self.tested.tolist())],
            "mean_confidence": [ratio(c, t) for c, t in zip(self.confidence.tolist(), self.tested.tolist())],
            "overall": {
                "tested": tested,
                "accepted": accepted,
                "acceptance_rate": ratio(accepted, tested),
                "mean_confidence": ratio(self.confidence.sum().item(), tested),
                # expected calibration error: the tested-weighted gap between confidence and acceptance
                "calibration_error": ratio((self.accepted - self.confidence).abs().sum().item(), tested),
            },
        }


def ratio(a, b):
    return round(a / b, 4) if b else None


def calibrate(gen: Generator, prompts, max_new_tokens: int, bins: int, stop_ids=()) -> Calibration:
    """Greedy generation of every prompt (token id lists), eager, counting each cycle's tree."""
    calibration = Calibration(bins, gen.spec.depth)
    hist, cycle_tokens, cycles = [0] * (gen.spec.depth + 1), 0, 0
    for prompt in prompts:
        r = gen.generate(prompt, max_new_tokens, GREEDY, stop_ids, lap=calibration)
        hist = [x + y for x, y in zip(hist, r.accept_hist)]
        cycle_tokens, cycles = cycle_tokens + len(r.token_ids) - 1, cycles + r.cycles
    if cycles:
        calibration.acceptance = acceptance_metrics(hist, cycle_tokens, cycles)
    return calibration


def print_table(report: dict):
    edges = report["bin_edges"]
    print(f"{'confidence':11} {'tested':>8} {'accepted':>8} {'rate':>6} {'mean conf':>9}")
    for i, (t, a, rate, conf) in enumerate(zip(report["tested"], report["accepted"], report["acceptance_rate"], report["mean_confidence"])):
        print(f"{f'{edges[i]:.2f}-{edges[i + 1]:.2f}':11} {t:8} {a:8} {fmt(rate):>6} {fmt(conf):>9}")
    o = report["overall"]
    print(f"{'all':11} {o['tested']:8} {o['accepted']:8} {fmt(o['acceptance_rate']):>6} {fmt(o['mean_confidence']):>9}"
          f"  calibration error {fmt(o['calibration_error'])}")


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def plot(report: dict, path: Path, title: str):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("plotting needs matplotlib, a dev requirement: pip install -r requirements-dev.txt") from None
    edges = report["bin_edges"]
    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    rates = [r or 0.0 for r in report["acceptance_rate"]]
    bars = ax.bar(edges[:-1], rates, width=edges[1] - edges[0], align="edge", edgecolor="black", label="acceptance rate")
    ax.bar_label(bars, labels=[f"n={t}" if t else "" for t in report["tested"]], fontsize=6, rotation=90, padding=2)
    ax.plot([0, 1], [0, 1], "r--", label="perfect calibration")
    ax.set(xlim=(0, 1), ylim=(0, 1.1), xlabel="draft confidence", ylabel="acceptance rate", title=title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    atomic.write(path, lambda tmp: fig.savefig(tmp, dpi=150))


def build_parser():
    p = UsageParser(description="Draft confidence against acceptance rate (EAGLE-2 Figure 6), greedy.")
    p.add_argument("--checkpoint", type=Path, default=None, help="converted checkpoint dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", type=Path, default=None, help="EAGLE head dir (default: the shipped head of the default model)")
    p.add_argument("--prompts", type=Path, default=MT_BENCH, help="MT-bench-format jsonl, first turns (default: data/mt_bench.jsonl)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--topk", type=int, default=10)
    p.add_argument("--num-draft-tokens", type=int, default=60)
    p.add_argument("--bins", type=int, default=20, help="equal confidence bins (20: the paper's 0.05 wide)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", type=Path, default=Path("docs/calibration.png"))
    p.add_argument("--json", type=Path, default=Path("calibration.json"))
    return p


def main(argv=None) -> int:
    try:
        opts = build_parser().parse_args(argv)
        if opts.bins < 1:
            raise UsageError(f"--bins must be >= 1, got {opts.bins}")
        if not opts.prompts.exists():
            raise UsageError(f"prompts file {opts.prompts} does not exist")
        gen, tokenizer = load_generator(opts.checkpoint, opts.draft, "eagle2", device=opts.device, dtype=opts.dtype, depth=opts.depth, topk=opts.topk,
                                        num_draft_tokens=opts.num_draft_tokens, lookup_slots=0)  # the chain has no draft confidence
        margs = gen.target.args
        from tqdm import tqdm

        conversations = load_conversations(opts.prompts, opts.num_prompts)
        prompts = [encode_prompt(tokenizer, margs, [{"role": "user", "content": turns[0]}], chat=True) for turns in conversations]
        calibration = calibrate(gen, tqdm(prompts, file=sys.stderr, leave=False), opts.max_new_tokens, opts.bins, margs.stop_tokens)
        report = {"checkpoint": str(opts.checkpoint or "default"), "draft": str(opts.draft or "default"), "prompts": str(opts.prompts),
                  "num_prompts": len(prompts), "max_new_tokens": opts.max_new_tokens, "spec": gen.spec.__dict__, **calibration.acceptance, **calibration.report()}
        print_table(report)
        atomic.write_text(opts.json, json.dumps(report, indent=2) + "\n")
        plot(report, opts.out, f"{Path(report['checkpoint']).name}, T=0: {report['overall']['tested']} tested drafts")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    tp.exit_with(main)
