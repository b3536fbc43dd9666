"""An OpenAI-compatible HTTP server: POST /v1/chat/completions and /v1/completions (streamed as server-sent events, one
chunk per committed burst of tokens, or whole), GET /v1/models, GET /health and GET /metrics (Prometheus), on FastAPI
and uvicorn. Every request field is honoured or refused (READ, INERT, OFF below). The model,
head, mode and compile flags are generate.py's; docs/serving.md shows how to call it. The requests are answered by
engine.py's loop: each a row of one batch, every live row one step at a time, a lone request at the command line's speed.

Sampling is per request (temperature, top_k, top_p and seed are data of its row), so requests of any rules share steps;
a request's answer is the one Generator.generate gives it alone, token for token at T = 0 (fp32), and with a seed at
T > 0 the same tokens whatever else the server is doing (sampling.py: its draws are keyed by the seed and position).
"""
import interrupt  # noqa: F401  first of all: Ctrl-C during the imports below exits 130 in one line too
import argparse
import asyncio
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Optional

import torch

import tp
from checkpoint import DEFAULT_NAME, check_prompts
from eaglet import add_model_flags, check_sampling, load_generator
from engine import Engine, Job
from errors import UsageError, UsageParser
from grammar import json_grammar
from tokenizer import check_text, encode_prompt

# Every field of OpenAI's chat and completions requests is one of three kinds (docs/serving.md lists them):
# READ: parse_request answers by it. INERT: changes no answer, accepted (type-checked all the same). OFF: not
# implemented, accepted only at a value that means "not used" (a client library's default), any other value a 400 naming
# it. Any other field is a 400 too: nothing a client asks for is silently dropped.
READ = {"messages", "prompt", "max_tokens", "max_completion_tokens", "n", "stop", "temperature", "top_k", "top_p", "seed",
        "stream", "stream_options", "logprobs", "top_logprobs", "logit_bias", "frequency_penalty", "presence_penalty",
        "response_format"}
INERT = {"model": str, "user": str, "metadata": dict, "store": bool, "service_tier": str, "parallel_tool_calls": bool,
         "prompt_cache_key": str, "safety_identifier": str}
OFF = {"echo": (False,), "suffix": ("",), "best_of": (1,), "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],),
       "function_call": ("none", "auto"), "modalities": (["text"],), "audio": (), "prediction": (), "reasoning_effort": (), "verbosity": (), "web_search_options": ()}


MAX_CHOICES = 16  # n: each choice a row of its own
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings are matched at every token: bounded, so one request cannot stall the others
BODY_BYTES_PER_TOKEN = 64  # a request body past 64 bytes a token of the context (plus 64 KiB) cannot fit it: 413 unread


def build_parser() -> argparse.ArgumentParser:
    p = UsageParser(description="Serve a LLaMA-family model over an OpenAI-compatible HTTP API, with speculative decoding and continuous batching.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    p.add_argument("--batch-size", type=int, default=4, help="rows answering requests at once")
    p.add_argument("--cache-rows", type=int, default=None, help="more rows keeping finished requests' caches, whose prefixes later requests reuse (default: --batch-size)")
    p.add_argument("--context", type=int, default=2048, help="prompt plus max_tokens of one request, at most (and at most the model's context)")
    p.add_argument("--max-tokens", type=int, default=200, help="a request's max_tokens when it sets none (less when its prompt leaves less room)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for a row, at most: past it 429 with Retry-After")
    p.add_argument("--api-key", default=os.environ.get("EAGLET_API_KEY"), help="the key every endpoint but /health wants as 'Authorization: Bearer KEY' (default: $EAGLET_API_KEY, else none)")
    p.add_argument("--read-timeout", type=float, default=30.0, help="seconds a request's headers, and then its body, may take to arrive (then 408 or closed)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds an answer may take from its request's arrival (then 504 or an error event, and its row is freed)")
    p.add_argument("--drain-timeout", type=float, default=25.0, help="seconds SIGINT or SIGTERM waits for the open requests before it aborts them (a second signal: at once)")
    p.add_argument("--model-name", default=None, help="the model's id in /v1/models and responses (default: the checkpoint directory's name)")
    add_model_flags(p)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="apply the chat template to messages (default: on for chat models)")
    p.add_argument("--seed", type=int, default=0, help="the running generator's seed (requests without one draw from it)")
    return p


# ---------------------------------------------------------------- requests

class BadRequest(ValueError):
    """A request the server refuses with 400 and OpenAI's error object; param: the field at fault."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def field_of(req: dict, name: str, kind, default=None):
    value = req.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))):
        names = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object", list: "a list"}
        want = " or ".join(dict.fromkeys(names[k] for k in (kind if isinstance(kind, tuple) else (kind,))))
        raise BadRequest(f"{name} must be {want}, got {json.dumps(value)[:40]}", name)
    return value


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def same(value, off) -> bool:
    """value is off: numbers by value (0.0 is 0), anything else of off's own type (false is not 0)."""
    return value == off if number(value) and number(off) else type(value) is type(off) and value == off


def check_fields(req: dict):
    """BadRequest for a field this server would not honour (see READ, INERT and OFF above)."""
    for name, value in req.items():
        if name in INERT:
            field_of(req, name, INERT[name])
        elif name in OFF:
            if value is not None and not any(same(value, off) for off in OFF[name]):
                raise BadRequest(f"{name} is not supported by this server (accepted only as null"
                                 f"{''.join(f' or {json.dumps(off)}' for off in OFF[name])}), got {json.dumps(value)[:60]}", name)
        elif name not in READ:
            raise BadRequest(f"unrecognized request field: {name}", name)


def message_text(content, i: int) -> str:
    """A message's content: a string, or OpenAI's list of parts of which the text ones count."""
    if isinstance(content, str):
        return check_text(content, f"messages[{i}].content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return check_text("".join(p["text"] for p in content), f"messages[{i}].content")
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")


def logit_bias(bias: dict) -> dict:
    """OpenAI's logit_bias, {"token id": bias} -> {token id: bias}; BadRequest for a key that is no token id or a value
    that is no number in [-100, 100] (check_sampling checks the ids against the vocabulary)."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) < 12) or not (number(value) and -100 <= value <= 100):
            raise BadRequest(f'logit_bias maps token ids to numbers in [-100, 100] ({{"50256": -100}}), got {json.dumps(key)[:30]}: {json.dumps(value)[:20]}', "logit_bias")
        out[int(key)] = value
    return out


def parse_request(req, chat: bool, engine) -> dict:
    """The JSON body of a completion request -> Job's fields and stream; BadRequest (400) on bad input."""
    if not isinstance(req, dict):
        raise BadRequest("the request body must be a JSON object")
    check_fields(req)
    args, tokenizer = engine.gen.target.args, engine.tokenizer
    if chat:
        messages = field_of(req, "messages", list)
        if not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        turns = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise BadRequest(f"messages[{i}] must be an object with a role and a content", "messages")
            turns.append({"role": m["role"], "content": message_text(m["content"], i)})
        prompt = encode_prompt(tokenizer, args, turns, engine.chat_template)
    else:
        text = req.get("prompt")
        if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
            text = text[0]
        if isinstance(text, str):
            prompt = encode_prompt(tokenizer, args, [{"role": "user", "content": check_text(text, "prompt")}], chat=False)
        elif isinstance(text, list) and text and all(isinstance(t, int) and not isinstance(t, bool) for t in text):
            prompt = text
        else:
            raise BadRequest("prompt must be a string or a non-empty list of token ids (one prompt: n = 1)", "prompt")
    if not prompt:
        raise BadRequest("the prompt is empty (no tokens to condition on)", "prompt")
    if len(prompt) >= engine.context:
        raise BadRequest(f"the prompt ({len(prompt)} tokens) leaves no room in the context of {engine.context} tokens", "messages" if chat else "prompt")
    max_tokens = field_of(req, "max_completion_tokens", int, field_of(req, "max_tokens", int))
    if max_tokens is None:
        max_tokens = min(engine.default_max_tokens, engine.context - len(prompt))
    if max_tokens <= 0 or len(prompt) + max_tokens > engine.context:
        raise BadRequest(f"max_tokens must be >= 1 and, with the prompt's {len(prompt)} tokens, at most the context of {engine.context}; got {max_tokens}", "max_tokens")
    n = field_of(req, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n must be 1 to {MAX_CHOICES}, got {n}", "n")
    stop = field_of(req, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, (str, int)) and not isinstance(s, bool) for s in stop) or "" in stop:
        raise BadRequest("stop must be a string or a list of non-empty strings and token ids", "stop")
    if len(stop) > MAX_STOPS or any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stop):
        raise BadRequest(f"stop takes at most {MAX_STOPS} entries of at most {MAX_STOP_CHARS} characters each", "stop")
    stop_ids = [s for s in stop if isinstance(s, int)]
    try:
        check_prompts(args, [prompt], max_tokens, stop_ids)  # token ids within the vocabulary
        sampling = check_sampling(float(field_of(req, "temperature", (int, float), 0.0)),
                                  field_of(req, "top_k", int, 0), float(field_of(req, "top_p", (int, float), 1.0)),
                                  logit_bias(field_of(req, "logit_bias", dict, {})),
                                  float(field_of(req, "frequency_penalty", (int, float), 0.0)),
                                  float(field_of(req, "presence_penalty", (int, float), 0.0)), args.vocab_size)
    except UsageError as e:
        message = str(e).replace("--max-new-tokens", "max_tokens").replace("--", "")
        raise BadRequest(message.replace("top-", "top_").replace("-penalty", "_penalty").replace("logit-bias", "logit_bias")) from None
    try:
        grammar = json_grammar(field_of(req, "response_format", dict, {"type": "text"}), engine.tokenizer, args.vocab_size, engine.stops)
    except UsageError as e:
        raise BadRequest(str(e), "response_format") from None
    seed = field_of(req, "seed", int)
    if seed is not None and not 0 <= seed < 2 ** 63:
        raise BadRequest(f"seed must be in [0, 2^63), got {seed}", "seed")
    stream, options = field_of(req, "stream", bool, False), field_of(req, "stream_options", dict, {})
    if options and not stream:
        raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
    if set(options) - {"include_usage"}:
        raise BadRequest(f"stream_options takes include_usage only, got {sorted(options)}", "stream_options")
    include_usage = field_of(options, "include_usage", bool, False)
    if chat:  # chat: logprobs true, top_logprobs 0..20 beside; completions: logprobs 0..5, the alternatives wanted
        top = field_of(req, "top_logprobs", int)
        logprobs = (top or 0) if field_of(req, "logprobs", bool, False) else None
        if top is not None and (not 0 <= top <= 20 or top and logprobs is None):
            raise BadRequest(f"top_logprobs must be 0 to 20, and more than 0 only with logprobs true; got {top}", "top_logprobs")
    else:
        logprobs = field_of(req, "logprobs", int)
        if logprobs is not None and not 0 <= logprobs <= 5:
            raise BadRequest(f"logprobs must be 0 to 5, got {logprobs}", "logprobs")
        if req.get("top_logprobs") is not None:
            raise BadRequest("top_logprobs is a chat field: completions take logprobs (0 to 5)", "top_logprobs")
    return dict(prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop_ids=frozenset(args.stop_tokens) | frozenset(stop_ids),
                stops=tuple(s for s in stop if isinstance(s, str)), seed=seed, stream=stream, include_usage=include_usage,
                logprobs=logprobs, n=n, grammar=grammar)


# ---------------------------------------------------------------- HTTP

async def read_body(request, limit: int):
    """The request's body, or None once it is past limit bytes (what is left of it unread)."""
    if int(request.headers.get("content-length") or 0) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def error_response(status: int, message: str, param=None, kind="invalid_request_error", code=None, headers=None):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status, headers=headers)


async def departure(request):
    """Returns once the client has gone (its body read already: uvicorn's next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def logprobs_field(items: list, chat: bool, offset: int = 0) -> dict:
    """Engine's logprob entries in OpenAI's shape: chat's content list, or completions' parallel lists (offset: the
    characters of the answer before these tokens)."""
    if chat:
        return {"content": items, "refusal": None}
    tokens = [i["token"] for i in items]
    return {"tokens": tokens, "token_logprobs": [i["logprob"] for i in items],
            "top_logprobs": [{a["token"]: a["logprob"] for a in i["top_logprobs"]} for i in items],
            "text_offset": [offset + sum(map(len, tokens[:k])) for k in range(len(tokens))]}


def ended(event: dict) -> bool:
    return "error" in event or "finish_reason" in event


class Metrics:
    """The server for Prometheus (GET /metrics): the engine's counts and gauges, read when scraped, and of every answer
    its tokens, time to first token, time per token after the first, and tau."""

    def __init__(self, app):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.app, self.registry = app, CollectorRegistry()
        r = self.registry
        self.answers = Counter("eaglet_answers", "answers ended, by how: stop, length, error or cancelled", ["finish"], registry=r)
        self.prompt_tokens = Counter("eaglet_prompt_tokens", "prompt tokens of the answers ended", registry=r)
        self.completion_tokens = Counter("eaglet_completion_tokens", "tokens answered", registry=r)
        self.ttft = Histogram("eaglet_time_to_first_token_seconds", "from a request's arrival to its first tokens", registry=r,
                              buckets=(0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6))
        self.tpot = Histogram("eaglet_time_per_output_token_seconds", "an answer's time per token after its first", registry=r,
                              buckets=(0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64))
        self.tau = Histogram("eaglet_tokens_per_cycle", "an answer's tau: tokens committed per target forward", registry=r,
                             buckets=(1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8))
        r.register(self)  # collect() below: the engine's own figures

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engine = self.app.state.engine
        h = engine.health() if engine is not None else {}
        yield GaugeMetricFamily("eaglet_ready", "1 once every step is built and requests are answered", value=h.get("status") == "ok")
        for name, doc in (("rows", "rows answering requests at once"), ("busy", "rows answering now"), ("waiting", "requests waiting for a row")):
            yield GaugeMetricFamily(f"eaglet_{name}", doc, value=h.get(name, 0))
        for name, doc in (("requests", "requests taken"), ("refused", "requests refused with 429: the queue was full"),
                          ("cycles", "steps of the rows"), ("shared_cycles", "steps shared by more than one row"),
                          ("cancelled", "answers whose client left"), ("failed", "answers a fault ended"), ("aborted", "answers a stop cut")):
            yield CounterMetricFamily(f"eaglet_{name}", doc, value=h.get(name, 0))
        steps = CounterMetricFamily("eaglet_steps", "steps by kind and rows (what batch.py ran)", labels=["step"])
        for label, count in h.get("steps", {}).items():
            steps.add_metric([label], count)
        yield steps

    def describe(self):
        return []  # collected afresh at each scrape

    def answered(self, job, event: dict, first: Optional[float]):
        """An answer's figures from its last event; first: when its first tokens came (perf_counter), None if none did."""
        self.answers.labels("error" if "error" in event else event.get("finish_reason") or "cancelled").inc()
        self.prompt_tokens.inc(len(job.prompt))
        self.completion_tokens.inc(len(job.ids))
        if first is not None:
            self.ttft.observe(first - job.arrived)
            if len(job.ids) > 1:
                self.tpot.observe((time.perf_counter() - first) / (len(job.ids) - 1))
        if "tau" in event.get("eaglet", {}):
            self.tau.observe(event["eaglet"]["tau"])


class Answer:
    """One choice of a request as its events arrive: the text, token ids and logprob entries so far, the last event, when
    its first tokens came."""

    def __init__(self, job: Job):
        self.job, self.parts, self.ids, self.scored, self.event, self.first, self.offset = job, [], [], [], {}, None, 0
        self.closed = False

    @property
    def ended(self) -> bool:
        return ended(self.event)

    def take(self, event: dict):
        self.event = event
        self.first = self.first or (time.perf_counter() if event.get("token_ids") else None)
        self.parts.append(event.get("text", ""))
        self.ids += event.get("token_ids", [])
        self.scored += event.get("logprobs", [])
        self.offset += sum(len(i["token"]) for i in event.get("logprobs", []))

    def figures(self) -> dict:
        return self.event["eaglet"] | {"token_ids": self.ids}

    def close(self, metrics):
        """The answer is over for its client: a row still running it is freed at the next step; its figures counted."""
        if not self.closed:
            self.closed, self.job.cancelled = True, self.job.cancelled or not self.ended
            metrics.answered(self.job, self.event, self.first)


def usage_of(answers: list) -> dict:
    """A request's usage: its prompt once, the tokens of every choice."""
    prompt, completion = len(answers[0].job.prompt), sum(len(a.job.ids) for a in answers)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def make_app(model_name: str, api_key: Optional[str] = None, read_timeout: float = 30.0, request_timeout: float = 600.0):
    """The HTTP face of app.state.engine (None while the model loads: every endpoint answers 503 until it is ready).
    api_key: the key every endpoint but /health wants (Authorization: Bearer ...); read_timeout: seconds a request's
    body may take to arrive; request_timeout: seconds its answer may take (then 504, or an error event, its rows freed)."""
    import hmac

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="eaglet")
    app.state.engine, app.state.read_timeout = None, read_timeout
    metrics = Metrics(app)
    created = int(time.time())

    def ready():
        return app.state.engine is not None and app.state.engine.ready

    def refused(request):
        """A 401 when the request lacks the key, else None."""
        if api_key is None or hmac.compare_digest(request.headers.get("authorization", "").encode(), f"Bearer {api_key}".encode()):
            return None
        return error_response(401, "a valid API key is needed: Authorization: Bearer <key>", code="invalid_api_key")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):  # 404, 405, ...: OpenAI's error object, not Starlette's {"detail"}
        return error_response(e.status_code, str(e.detail))

    @app.get("/health")
    def health():
        if app.state.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse(app.state.engine.health(), status_code=200 if ready() else 503)

    @app.get("/metrics")
    def prometheus(request: Request):
        return refused(request) or Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models(request: Request):
        return refused(request) or {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "eaglet"}]}

    async def complete(request: Request, chat: bool):
        if denied := refused(request):
            return denied
        if not ready():
            return error_response(503, "the model is loading: try again once /health says ok", kind="server_error")
        engine = app.state.engine
        limit = BODY_BYTES_PER_TOKEN * engine.context + 65536
        try:
            try:
                async with asyncio.timeout(read_timeout):
                    body = await read_body(request, limit)
            except TimeoutError:
                return error_response(408, f"the request body did not arrive within {read_timeout:g} s")
            if body is None:
                return error_response(413, f"the request body is over {limit} bytes: no prompt that long fits the context of {engine.context} tokens")
            try:
                req = json.loads(body)
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(f"the request body is not valid JSON: {e}") from None
            except RecursionError:
                raise BadRequest("the request body is not valid JSON: nested too deep") from None
            fields = parse_request(req, chat, engine)
            stream, include_usage, n, seed = (fields.pop(k) for k in ("stream", "include_usage", "n", "seed"))
            events, loop = asyncio.Queue(), asyncio.get_running_loop()
            # choice i draws with seed + i: a seeded request's choices differ, and each is what that seed gives alone
            jobs = [Job(**fields, seed=None if seed is None else seed + i,
                        emit=lambda event, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, event))) for i in range(n)]
            taken = engine.submit(jobs)
            if taken == "closing":
                return error_response(503, "the server is shutting down", kind="server_error")
            if taken == "full":
                return error_response(429, f"{engine.max_waiting} requests are waiting for a row already: try again shortly",
                                      kind="requests", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        except (BadRequest, UsageError, OverflowError) as e:  # UsageError: text that is not Unicode; OverflowError: a number past float
            return error_response(400, str(e), getattr(e, "param", None))
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model_name}
        answers = [Answer(job) for job in jobs]
        if stream:
            return StreamingResponse(sse(answers, events, base, chat, include_usage), media_type="text/event-stream")
        gone, got = asyncio.ensure_future(departure(request)), None
        try:
            async with asyncio.timeout(request_timeout):
                while not all(a.ended for a in answers):
                    got = asyncio.ensure_future(events.get())
                    await asyncio.wait((got, gone), return_when=asyncio.FIRST_COMPLETED)
                    if not got.done():  # the client left: its rows are freed at the next step
                        return Response(status_code=499)
                    i, event = got.result()
                    answers[i].take(event)
        except TimeoutError:
            return error_response(504, f"the answer took longer than --request-timeout ({request_timeout:g} s)", kind="server_error", code="timeout")
        finally:
            for task in (gone, got):
                task and task.cancel()
            for a in answers:
                a.close(metrics)
        if error := next((a.event["error"] for a in answers if "error" in a.event), None):
            return error_response(500, error, kind="server_error")
        choices = []
        for i, a in enumerate(answers):
            text = "".join(a.parts)
            choice = {"index": i, "finish_reason": a.event["finish_reason"], "logprobs": None if a.job.logprobs is None else logprobs_field(a.scored, chat)}
            choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            choices.append(choice | ({"eaglet": a.figures()} if n > 1 else {}))
        return base | {"choices": choices, "usage": usage_of(answers), "eaglet": answers[0].figures()}

    async def sse(answers: list, events: asyncio.Queue, base: dict, chat: bool, include_usage: bool):
        base = base | {"object": "chat.completion.chunk" if chat else "text_completion"}
        deadline = asyncio.get_running_loop().time() + request_timeout  # no asyncio.timeout across a generator's yields
        try:
            while not all(a.ended for a in answers):
                i, event = await asyncio.wait_for(events.get(), max(0.0, deadline - asyncio.get_running_loop().time()))
                a = answers[i]
                if "error" in event:
                    a.take(event)
                    yield f"data: {json.dumps({'error': {'message': event['error'], 'type': 'server_error', 'param': None, 'code': None}})}\n\n"
                    return
                finish, opening, offset = event.get("finish_reason"), not a.parts, a.offset
                a.take(event)
                scored = None if finish or a.job.logprobs is None else logprobs_field(event["logprobs"], chat, offset)
                if chat:
                    delta = {} if finish else {"content": event["text"]} | ({"role": "assistant"} if opening else {})
                    choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": scored}
                else:
                    choice = {"index": i, "text": "" if finish else event["text"], "finish_reason": finish, "logprobs": scored}
                extra = {"usage": event["usage"], "eaglet": event["eaglet"]} if finish else {"eaglet": {"token_ids": event["token_ids"]}}
                yield f"data: {json.dumps(base | {'choices': [choice]} | extra)}\n\n"
        except TimeoutError:
            message = f"the answer took longer than --request-timeout ({request_timeout:g} s)"
            yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error', 'param': None, 'code': 'timeout'}})}\n\n"
            return
        finally:
            for a in answers:
                a.close(metrics)  # a client that left mid-answer: its rows are freed at the next cycle
        if include_usage:  # OpenAI's last chunk: no choices, the usage
            yield f"data: {json.dumps(base | {'choices': [], 'usage': usage_of(answers)})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


def uvicorn_server(app, log_level: str = "warning"):
    """A uvicorn Server that, once told to exit (should_exit), takes no new connections and answers the open ones before
    run() returns. Run on a thread other than the main one, it leaves the signals to its caller (drain_on_signals). A
    connection whose request headers take longer than the app's read_timeout seconds is closed."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        """uvicorn's HTTP/1.1 with a deadline for each request's headers, so clients trickling them cannot hold
        connections (and a drain) open: armed when the connection opens and after each response."""
        deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self.arm()

        def on_response_complete(self):
            super().on_response_complete()
            self.arm()

        def connection_lost(self, exc):
            self.deadline.cancel()
            super().connection_lost(exc)

        def arm(self):
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(app.state.read_timeout, self.expire)

        def expire(self):
            if self.cycle is None or self.cycle.response_complete:  # no request's headers came since the timer was armed
                self.transport.close()

    async def stoppable(scope, receive, send):
        """app, where a request that a forced stop cancels before its answer began gets a 503, not a traceback."""
        began = False

        async def sending(message):
            nonlocal began
            began = began or message["type"] == "http.response.start"
            await send(message)

        try:
            await app(scope, receive, sending)
        except asyncio.CancelledError:
            if began:
                raise
            await error_response(503, "the server stopped before this request was answered", kind="server_error")(scope, receive, send)

    return uvicorn.Server(uvicorn.Config(stoppable, http=Protocol, lifespan="off", log_level=log_level, access_log=False,
                                         timeout_graceful_shutdown=None))


def listen(host: str, port: int) -> socket.socket:
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
    except (OSError, OverflowError) as e:
        raise UsageError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    return sock


def parse(argv=None) -> tuple:
    """The command line -> (its options, the socket listening on --host and --port). Raises UsageError."""
    a = build_parser().parse_args(argv)
    if a.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {a.batch_size}")
    if a.cache_rows is not None and a.cache_rows < 0:
        raise UsageError(f"--cache-rows must be >= 0, got {a.cache_rows}")
    if a.context < 2 or a.max_tokens < 1:
        raise UsageError("--context must be >= 2 and --max-tokens >= 1")
    if a.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {a.max_queue}")
    for flag in ("read_timeout", "drain_timeout", "request_timeout"):
        if not (getattr(a, flag) > 0 and math.isfinite(getattr(a, flag))):
            raise UsageError(f"--{flag.replace('_', '-')} must be a number of seconds > 0, got {getattr(a, flag)}")
    if a.api_key == "":
        raise UsageError("--api-key is empty (leave it out for none)")
    if tp.world_size() > 1:
        raise UsageError("serve.py runs in one process, not under torchrun")
    return a, listen(a.host, a.port)  # before the slow work: a port in use is said at once


def load(a, sock) -> tuple:
    """The model, head and steps of the options a -> (an Engine not yet run, a line saying what is served). Raises
    UsageError."""
    gen, tokenizer = load_generator(a.checkpoint, a.draft, a.speculate, device=a.device, dtype=a.dtype, compile=a.compile,
                                    depth=a.depth, topk=a.topk, num_draft_tokens=a.num_draft_tokens, speculate_k=a.speculate_k,
                                    draft_vocab=a.draft_vocab, draft_checkpoint=a.draft_checkpoint, lookup_slots=a.lookup_slots,
                                    batch=a.batch_size, context=a.context)
    margs = gen.target.args
    context = min(a.context, margs.block_size)
    chat_template = a.chat if a.chat is not None else bool(margs.chat_template)
    engine = Engine(gen, tokenizer, a.batch_size, context, chat_template, a.max_tokens,
                    a.batch_size if a.cache_rows is None else a.cache_rows, a.max_queue, log=lambda s: print(s, file=sys.stderr))
    host, port = sock.getsockname()[:2]
    return engine, f"serving {model_name(a)} ({a.speculate}, {a.batch_size} rows, context {context}) on http://{host}:{port}"


def model_name(a) -> str:
    return a.model_name or (a.checkpoint.name if a.checkpoint else DEFAULT_NAME)


def build(argv=None) -> tuple:
    """The command line -> (Engine, its app, the listening socket, a line saying what is served), the model loaded: the
    server runs once the Engine runs (Engine.start) and uvicorn serves the app on the socket. Raises UsageError."""
    a, sock = parse(argv)
    try:
        engine, banner = load(a, sock)
    except BaseException:
        sock.close()
        raise
    app = make_app(model_name(a), a.api_key, a.read_timeout, a.request_timeout)
    app.state.engine = engine
    return engine, app, sock, banner


def main(argv=None) -> int:
    """HTTP on a thread of its own from the start (503 until ready); the model loaded, warmed up and run on this one,
    the thread its kernels stay on (engine.py). SIGINT or SIGTERM drains: no new connection, the open ones answered,
    exit 0; a second one, or --drain-timeout, aborts what is left (each stream gets an error event, a request not yet read
    a 503), exit 1."""
    try:
        a, sock = parse(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = make_app(model_name(a), a.api_key, a.read_timeout, a.request_timeout)
    server = uvicorn_server(app)

    def http():
        server.run(sockets=[sock])
        if app.state.engine is not None:
            app.state.engine.close()  # every connection answered: the loop ends once its rows are done

    thread = threading.Thread(target=http, name="http", daemon=True)
    thread.start()
    try:
        engine, banner = load(a, sock)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        server.should_exit = True
        thread.join()
        return 2
    app.state.engine = engine

    def ready():
        print(banner, file=sys.stderr, flush=True)
        drain_on_signals(server, engine, a.drain_timeout)

    engine.run(on_ready=ready)
    thread.join(timeout=5 if engine.aborting else None)  # forced: uvicorn closes what is open without waiting
    if engine.aborting:  # a second signal, or the drain's time ran out
        print(f"stopped: {engine.counts['aborted']} requests aborted, open connections closed", file=sys.stderr)
        return 1
    print("drained: every request answered", file=sys.stderr)
    return 0


def drain_on_signals(server, engine, limit: float):
    """SIGINT and SIGTERM: the first drains (uvicorn stops taking connections and answers the open ones) for at most
    limit seconds, the second, or the limit, aborts (Engine.abort)."""
    def handle(signum=None, frame=None):
        if server.should_exit:
            server.force_exit = True
            engine.abort()
            return
        server.should_exit = True
        timer = threading.Timer(limit, handle)
        timer.daemon = True
        timer.start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)


if __name__ == "__main__":
    tp.exit_with(main)
