"""An OpenAI-compatible HTTP server: POST /v1/chat/completions and /v1/completions (streamed as server-sent events, one
chunk per committed burst of tokens, or whole), GET /v1/models and GET /health, on FastAPI and uvicorn. The model,
head, mode and compile flags are generate.py's; docs/serving.md shows how to call it.

Continuous batching: one thread owns the Generator and its B rows (batch.run_rows). A request joins a free row before
the next cycle, is streamed as its row commits, and leaves it when done (a stop token or string, max_tokens, or a
client gone), so the rows stay full while requests wait; each answer is the one its prompt gets alone (batch.py).

Sampling: a cycle runs one sampling rule for all its rows (the rule is a static argument of the batched step), so the
rows answer requests of one rule at a time: temperature, top_k and top_p equal. A waiting request of the rule being
served joins a free row; one of another rule waits until the rows are empty, then its rule is served. A request is
overtaken by at most B later requests of the rule being served, so none waits for ever. Greedy requests (T = 0) all
share one rule. No request's rule is ever applied to another's tokens.

Seeds: a request with a seed and T > 0 is answered in the rows alone, the torch generator seeded with it first, so
the same request with the same seed gives the same answer from this server (B, mode and dtype unchanged). Without a
seed, draws come from the server's running generator. At T = 0 the seed changes nothing.

Compiling (--compile): the steps for greedy rows and for the rule of --temperature/--top-k/--top-p are compiled, and
every row run once through them, before the server listens; a request with another sampling rule runs its cycles
uncompiled (same tokens and distribution, slower) rather than compiling while others wait.
"""
import interrupt  # noqa: F401  first of all: Ctrl-C during the imports below exits 130 in one line too
import argparse
import asyncio
import collections
import json
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

import batch
import tp
from checkpoint import DEFAULT_NAME, UsageError, UsageParser, check_prompts, check_text
from eaglet import GREEDY, acceptance_metrics, add_model_flags, check_sampling, load_generator
from generator import decode_row
from sampling import Sampling
from tokenizer import encode_prompt

# Request fields OpenAI's API defines that this server accepts and ignores (type-checked all the same).
IGNORED = {"model": str, "user": str, "stream_options": dict, "frequency_penalty": (int, float), "presence_penalty": (int, float),
           "logit_bias": dict, "logprobs": (bool, int), "top_logprobs": int, "response_format": dict, "echo": bool, "suffix": str,
           "best_of": int, "parallel_tool_calls": bool, "metadata": dict, "store": bool, "service_tier": str}


def build_parser() -> argparse.ArgumentParser:
    p = UsageParser(description="Serve a LLaMA-family model over an OpenAI-compatible HTTP API, with speculative decoding and continuous batching.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    p.add_argument("--batch-size", type=int, default=4, help="rows answering requests at once")
    p.add_argument("--context", type=int, default=2048, help="prompt plus max_tokens of one request, at most (and at most the model's context)")
    p.add_argument("--max-tokens", type=int, default=200, help="a request's max_tokens when it sets none (less when its prompt leaves less room)")
    p.add_argument("--model-name", default=None, help="the model's id in /v1/models and responses (default: the checkpoint directory's name)")
    add_model_flags(p)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="apply the chat template to messages (default: on for chat models)")
    p.add_argument("--temperature", type=float, default=0.0, help="--compile: the sampling rule compiled besides greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="the running generator's seed (requests without one draw from it)")
    return p


# ---------------------------------------------------------------- requests

class BadRequest(ValueError):
    """A request the server refuses with 400 and OpenAI's error object; param: the field at fault."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


@dataclass(eq=False)  # a Job is itself alone: hashed by identity
class Job:
    """One request on its way through the rows. emit(event) hands an event to the request's HTTP handler (any thread)."""
    prompt: list
    max_tokens: int
    sampling: Sampling
    stop_ids: frozenset  # the model's stop tokens and the request's own
    stops: tuple  # stop strings
    seed: Optional[int]
    emit: Callable
    ids: list = field(default_factory=list)  # the answer's tokens, the stop token included
    hist: list = field(default_factory=list)  # cycles that accepted 0, 1, ... draft tokens
    sent: int = 0  # characters of the answer's text emitted
    cancelled: bool = False  # the client went away
    overtaken: int = 0  # later requests admitted before this one

    @property
    def seeded(self) -> bool:
        return self.seed is not None and self.sampling.temperature > 0


def field_of(req: dict, name: str, kind, default=None):
    value = req.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))):
        names = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object", list: "a list"}
        want = " or ".join(dict.fromkeys(names[k] for k in (kind if isinstance(kind, tuple) else (kind,))))
        raise BadRequest(f"{name} must be {want}, got {json.dumps(value)[:40]}", name)
    return value


def message_text(content, i: int) -> str:
    """A message's content: a string, or OpenAI's list of parts of which the text ones count."""
    if isinstance(content, str):
        return check_text(content, f"messages[{i}].content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return check_text("".join(p["text"] for p in content), f"messages[{i}].content")
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_request(req, chat: bool, engine) -> dict:
    """The JSON body of a completion request -> Job's fields and stream; BadRequest (400) on bad input."""
    if not isinstance(req, dict):
        raise BadRequest("the request body must be a JSON object")
    for name, kind in IGNORED.items():
        field_of(req, name, kind)
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
    if field_of(req, "n", int, 1) != 1:
        raise BadRequest("n must be 1 (one answer per request)", "n")
    stop = field_of(req, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, (str, int)) and not isinstance(s, bool) for s in stop) or "" in stop:
        raise BadRequest("stop must be a string or a list of non-empty strings and token ids", "stop")
    stop_ids = [s for s in stop if isinstance(s, int)]
    try:
        check_prompts(args, [prompt], max_tokens, stop_ids)  # token ids within the vocabulary
        sampling = check_sampling(float(field_of(req, "temperature", (int, float), 0.0)),
                                  field_of(req, "top_k", int, 0), float(field_of(req, "top_p", (int, float), 1.0)))
    except UsageError as e:
        message = str(e).replace("--max-new-tokens", "max_tokens").replace("--top-", "top_").replace("--", "")
        raise BadRequest(message) from None
    seed = field_of(req, "seed", int)
    if seed is not None and not 0 <= seed < 2 ** 63:
        raise BadRequest(f"seed must be in [0, 2^63), got {seed}", "seed")
    return dict(prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop_ids=frozenset(args.stop_tokens) | frozenset(stop_ids),
                stops=tuple(s for s in stop if isinstance(s, str)), seed=seed, stream=field_of(req, "stream", bool, False))


# ---------------------------------------------------------------- the generation loop

class Engine:
    """The Generator, its B rows and the thread that runs them, fed by a queue of Jobs."""

    def __init__(self, gen, tokenizer, rows: int, context: int, chat_template: bool, default_max_tokens: int, warm: list,
                 compile: bool):
        self.gen, self.tokenizer, self.rows, self.context = gen, tokenizer, rows, context
        self.chat_template, self.default_max_tokens = chat_template, default_max_tokens
        self.stop_tokens = frozenset(gen.target.args.stop_tokens)
        self.waiting, self.active = collections.deque(), set()
        self.cond, self.closing = threading.Condition(), False
        self.counts = collections.Counter()
        self.warm = set(warm)
        # Uncompiled batched steps, for a sampling rule not compiled before listening (module docstring)
        self.eager_step = (batch.batched(gen.eager_cycle) if gen.spec else batch.batched(decode_row)) if compile else None
        gen.reserve(context)  # every request's caches, allocated once: rows made now stay valid
        gen.build(GREEDY)  # the prefill for caches of this size (packaged steps are built per cache size)
        warm_prompt = encode_prompt(tokenizer, gen.target.args, [{"role": "user", "content": "Hi"}], chat_template)
        for rule in self.warm:  # compiles each warmed rule's steps for B rows and gives every row a state
            gen.generate_batch([warm_prompt] * rows, 2, rule)
        self.thread = threading.Thread(target=self.serve, name="rows", daemon=True)
        self.thread.start()

    def submit(self, job: Job):
        with self.cond:
            if self.closing:
                raise BadRequest("the server is shutting down")
            job.hist = [0] * ((self.gen.spec.depth + 1) if self.gen.spec else 1)
            self.waiting.append(job)
            self.counts["requests"] += 1
            self.cond.notify()

    def close(self):
        """Stops the loop once every request taken or waiting is answered."""
        with self.cond:
            self.closing = True
            self.cond.notify()
        self.thread.join()

    def serve(self):
        while True:
            with self.cond:
                while not self.waiting and not self.closing:
                    self.cond.wait()
                if not self.waiting:
                    return
                head = self.waiting[0]
            rule = head.sampling
            step = None if rule in self.warm or self.eager_step is None else self.eager_step
            try:
                if head.seeded:
                    torch.manual_seed(head.seed)
                batch.run_rows(self.gen, self.rows, rule, lambda: self.take(rule, head), self.commit, step, self.counts)
            except Exception as e:  # a fault in the batched step: the requests in the rows fail, the server goes on
                traceback.print_exc()
                with self.cond:
                    if head in self.waiting:  # failed before it was taken: it would be the next head again
                        self.waiting.remove(head)
                        self.fail(head, e)
                for job in list(self.active):
                    self.fail(job, e)
            self.active.clear()

    def take(self, rule: Sampling, head: Job):
        """The next waiting request for a free row under this rule, or None (module docstring: who may overtake whom)."""
        with self.cond:
            for job in [j for j in self.waiting if j.cancelled]:
                self.waiting.remove(job)
                self.counts["cancelled"] += 1
            if head.seeded:  # answered alone
                if self.waiting and self.waiting[0] is head:
                    return self.admit(self.waiting.popleft())
                return None
            older = []
            for job in self.waiting:
                if job.sampling == rule and not job.seeded:
                    if any(o.overtaken >= self.rows for o in older):
                        return None
                    for o in older:
                        o.overtaken += 1
                    self.waiting.remove(job)
                    return self.admit(job)
                older.append(job)
            return None

    def admit(self, job: Job) -> tuple:
        self.active.add(job)
        return job, job.prompt

    def commit(self, job: Job, new: list, accept_len) -> bool:
        """A row's new tokens for job -> whether its answer goes on; they are emitted as one burst."""
        if job.cancelled:
            self.counts["cancelled"] += 1
            self.active.discard(job)
            return False
        try:
            if accept_len is not None:
                job.hist[accept_len] += 1
            new = batch.cut(new, job.max_tokens - len(job.ids), job.stop_ids)
            job.ids += new
            text = self.tokenizer.decode([t for t in job.ids if t not in job.stop_ids])
            cut_at = min((i for i in (text.find(s) for s in job.stops) if i >= 0), default=-1)
            finish = ("stop" if cut_at >= 0 or job.ids[-1] in job.stop_ids else "length" if len(job.ids) >= job.max_tokens else None)
            if cut_at >= 0:
                text = text[:cut_at]
            elif finish is None:  # hold back a split character and what may begin a stop string
                text = text.rstrip("\ufffd")
                text = text[:len(text) - max((n for s in job.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)]
            delta, job.sent = text[job.sent:], max(job.sent, len(text))
            job.emit({"token_ids": new, "text": delta})
            if finish:
                last = {"finish_reason": finish, "usage": self.usage(job), "eaglet": self.figures(job)}
                self.active.discard(job)  # before the answer is out: whoever reads it sees the row free
                job.emit(last)
            return finish is None
        except Exception as e:  # this request fails alone
            self.fail(job, e)
            return False

    def fail(self, job: Job, e: Exception):
        print(f"a request failed: {type(e).__name__}: {e}", file=sys.stderr)
        self.counts["failed"] += 1
        self.active.discard(job)
        job.emit({"error": f"{type(e).__name__}: {e}"})

    def usage(self, job: Job) -> dict:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.ids), "total_tokens": len(job.prompt) + len(job.ids)}

    def figures(self, job: Job) -> dict:
        """The speculative figures of an answer: tau (tokens per target forward) and the acceptance rate per draft depth."""
        cycles = sum(job.hist)
        if not self.gen.spec or not cycles:
            return {"mode": self.gen.spec.mode if self.gen.spec else "none", "cycles": cycles}
        m = acceptance_metrics(job.hist, len(job.ids) - 1, cycles)
        return {"mode": self.gen.spec.mode, "cycles": cycles, "tau": m["mean_accept_len"], "accept_rate_per_depth": m["accept_rate_per_depth"],
                "accept_len_hist": m["accept_len_hist"]}

    def health(self) -> dict:
        with self.cond:
            return {"status": "draining" if self.closing else "ok", "rows": self.rows, "busy": len(self.active), "waiting": len(self.waiting),
                    "cycles": self.counts["cycles"], "shared_cycles": self.counts["shared_cycles"], "requests": self.counts["requests"],
                    "cancelled": self.counts["cancelled"], "failed": self.counts["failed"]}


# ---------------------------------------------------------------- HTTP

def error_response(status: int, message: str, param=None, kind="invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def make_app(engine: Engine, model_name: str):
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI(title="eaglet")
    created = int(time.time())

    @app.get("/health")
    def health():
        return engine.health()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "eaglet"}]}

    async def complete(request: Request, chat: bool):
        try:
            try:
                req = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(f"the request body is not valid JSON: {e}") from None
            fields = parse_request(req, chat, engine)
            stream = fields.pop("stream")
            events, loop = asyncio.Queue(), asyncio.get_running_loop()
            job = Job(**fields, emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
            engine.submit(job)
        except (BadRequest, UsageError, OverflowError) as e:  # UsageError: text that is not Unicode; OverflowError: a number past float
            return error_response(400, str(e), getattr(e, "param", None))
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model_name}
        if stream:
            return StreamingResponse(sse(job, events, base, chat), media_type="text/event-stream")
        parts, ids, event = [], [], {}
        try:
            while not ("error" in event or "finish_reason" in event):
                event = await events.get()
                parts.append(event.get("text", ""))
                ids += event.get("token_ids", [])
        finally:
            job.cancelled = not ("error" in event or "finish_reason" in event)  # the handler was cancelled: the client left
        if "error" in event:
            return error_response(500, event["error"], kind="server_error")
        text = "".join(parts)
        choice = {"index": 0, "finish_reason": event["finish_reason"], "logprobs": None}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        return base | {"choices": [choice], "usage": event["usage"], "eaglet": event["eaglet"] | {"token_ids": ids}}

    async def sse(job: Job, events: asyncio.Queue, base: dict, chat: bool):
        base = base | {"object": "chat.completion.chunk" if chat else "text_completion"}
        done = False
        try:
            first = True
            while True:
                event = await events.get()
                if "error" in event:
                    done = True
                    yield f"data: {json.dumps({'error': {'message': event['error'], 'type': 'server_error', 'param': None, 'code': None}})}\n\n"
                    return
                finish = event.get("finish_reason")
                if chat:
                    delta = {} if finish else {"content": event["text"]} | ({"role": "assistant"} if first else {})
                    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                else:
                    choice = {"index": 0, "text": "" if finish else event["text"], "finish_reason": finish, "logprobs": None}
                extra = {"usage": event["usage"], "eaglet": event["eaglet"]} if finish else {"eaglet": {"token_ids": event["token_ids"]}}
                yield f"data: {json.dumps(base | {'choices': [choice]} | extra)}\n\n"
                first = False
                if finish:
                    done = True
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancelled = not done  # the client left mid-answer: its row is freed at the next cycle

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


def uvicorn_server(app, log_level: str = "warning"):
    """A uvicorn Server whose SIGINT / SIGTERM drain it: no new connections, the open ones answered, then run() returns."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # drained is a clean exit: not the signal's default action afterwards

    return Draining(uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=None))


def listen(host: str, port: int) -> socket.socket:
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
    except (OSError, OverflowError) as e:
        raise UsageError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    return sock


def build(argv=None) -> tuple:
    """The command line -> (Engine, its app, the listening socket, a line saying what is served), every step compiled
    and every row warmed up: the server is ready once uvicorn runs the app on the socket. Raises UsageError."""
    a = build_parser().parse_args(argv)
    sampling = check_sampling(a.temperature, a.top_k, a.top_p)
    if a.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {a.batch_size}")
    if a.context < 2 or a.max_tokens < 1:
        raise UsageError("--context must be >= 2 and --max-tokens >= 1")
    if tp.world_size() > 1:
        raise UsageError("serve.py runs in one process, not under torchrun")
    sock = listen(a.host, a.port)  # before the slow work: a port in use is said at once
    try:
        gen, tokenizer = load_generator(a.checkpoint, a.draft, a.speculate, device=a.device, dtype=a.dtype, compile=a.compile,
                                        depth=a.depth, topk=a.topk, num_draft_tokens=a.num_draft_tokens, speculate_k=a.speculate_k,
                                        draft_vocab=a.draft_vocab, draft_checkpoint=a.draft_checkpoint, lookup_slots=a.lookup_slots,
                                        sampling=sampling, batch=a.batch_size)
        margs = gen.target.args
        context = min(a.context, margs.block_size)
        chat_template = a.chat if a.chat is not None else bool(margs.chat_template)
        engine = Engine(gen, tokenizer, a.batch_size, context, chat_template, a.max_tokens, {GREEDY, sampling}, bool(a.compile))
    except BaseException:
        sock.close()
        raise
    torch.manual_seed(a.seed)  # after the warm-up's draws
    name = a.model_name or (a.checkpoint.name if a.checkpoint else DEFAULT_NAME)
    host, port = sock.getsockname()[:2]
    banner = f"serving {name} ({a.speculate}, {a.batch_size} rows, context {context}) on http://{host}:{port}"
    return engine, make_app(engine, name), sock, banner


def main(argv=None) -> int:
    try:
        engine, app, sock, banner = build(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(banner, file=sys.stderr, flush=True)
    uvicorn_server(app).run(sockets=[sock])
    engine.close()
    print("drained: every request answered", file=sys.stderr)
    return 0


if __name__ == "__main__":
    tp.exit_with(main)
