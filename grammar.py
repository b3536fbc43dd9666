# Constrained answers: OpenAI's response_format (json_object, json_schema) as a grammar over the model's tokens, kept
# by llguidance. Before each draw the grammar's mask of the tokens it allows next becomes data of the row's state
# (SpecState.allowed), and sampling.shaped leaves only those: the draw is the target's own, restricted to the grammar,
# with any rule (temperature, top-k, top-p, seed, bias). A constrained row speculates as any other and its grammar then
# follows what each step drew (batch.Batch.follow): the first token it refuses is drawn again, restricted to it, and the
# rest dropped; where top-k or top-p truncate (or a chain drafts) the row takes plain steps with the mask inside instead.
import functools
import json
from typing import Optional

import numpy as np
import torch

import sampling
from errors import UsageError


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tokenizer, vocab_size: int, stops: tuple):
    """llguidance's view of the model's tokenizer (built once: a second or so), stops the tokens that end an answer.
    A tokenizer.json tokenizer only (tokenizer.HFTokenizer)."""
    import llguidance

    if not hasattr(tokenizer, "tok"):
        raise UsageError("response_format needs a checkpoint whose tokenizer is a tokenizer.json")
    return llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab_size, eos_token=list(stops))


def json_grammar(response_format: dict, tokenizer, vocab_size: int, stops: tuple) -> Optional[str]:
    """OpenAI's response_format -> an llguidance grammar (None for text); UsageError naming what is wrong. JSON is
    compact (no whitespace between tokens of the syntax), so an answer cannot run on in whitespace."""
    import llguidance

    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema" and isinstance(response_format.get("json_schema"), dict) and isinstance(response_format["json_schema"].get("schema", {}), dict):
        schema = response_format["json_schema"].get("schema", {})
    else:
        raise UsageError('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as e:
        raise UsageError(f"response_format's schema: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer, vocab_size, stops))
    if error:
        raise UsageError(f"response_format's schema: {error.splitlines()[0][:200]}")
    return grammar


class Grammar:
    """One answer's place in its grammar: allowed(out) writes the mask of the tokens it allows next, consume(tokens)
    moves past the tokens drawn."""

    def __init__(self, grammar: str, tokenizer, vocab_size: int, stops: tuple):
        import llguidance

        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab_size, stops), grammar)
        self.stops = list(stops)

    def allowed(self, out: torch.Tensor):
        """out [V] bool: the tokens the grammar allows next (the stop tokens once it is complete)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[: out.shape[0]]
        mask = torch.from_numpy(bits.astype(bool))
        if not mask.any():  # nothing can follow (the answer is done): the stop tokens
            mask[self.stops] = True
        out.copy_(mask)

    def valid(self, tokens: list) -> int:
        """How many of tokens, in order, the grammar allows (all of them up to and with a stop token it allows)."""
        end = next((i + 1 for i, t in enumerate(tokens) if t in self.stops), len(tokens))
        valid = self.matcher.validate_tokens(tokens[:end])
        return len(tokens) if valid == end else valid  # tokens past a stop token are no answer's

    def consume(self, tokens: list):
        for t in tokens:
            if self.matcher.is_stopped() or not self.matcher.consume_token(t):
                return  # past its end: a stop token ends the answer here


def redraw(gen, new: list, j: int, rule, grammar: Grammar) -> int:
    """gen's last step committed new, whose token j grammar refuses: the state rewound to new[:j] (the committed length,
    the root, the head's pending pairs, the counts, the history) and the token at j drawn again from the same state and
    noise, restricted to the grammar's tokens. -> that token."""
    st, drop = gen.state, len(new) - 1 - j
    dropped = torch.tensor(new[j:], device=st.L.device)
    st.L.sub_(drop)
    if rule.kind == "truncate":  # the step counted them (penalties)
        sampling.count(st, dropped, -torch.ones_like(dropped))
    grammar.allowed(st.allowed)
    noise = sampling.noise(st, st.L, 1, gen.target.args.vocab_size)
    token = sampling.draw(gen.target.output(st.out_path[j:j + 1].to(gen.target.tok_embeddings.weight.dtype)), "truncate", st, noise)
    st.allowed.fill_(True)
    sampling.count(st, token, torch.ones_like(token))
    st.root.copy_(token)
    if gen.spec is not None:
        st.n_pend.sub_(drop)
        st.pend_tok[st.n_pend - 1] = token[0]
        if hasattr(st, "history"):
            st.history[st.L] = token[0]
    return int(token)
