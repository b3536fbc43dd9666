"""An OpenAI-compatible HTTP server: POST /v1/chat/completions and /v1/completions (streamed as server-sent events, one
chunk per committed burst of tokens, or whole), GET /v1/models and GET /health, on FastAPI and uvicorn. The model,
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
from tokenizer import check_text, encode_prompt

# Request fields OpenAI's API defines that this server accepts and ignores (type-checked all the same).
IGNORED = {"model": str, "user": str, "stream_options": dict, "frequency_penalty": (int, float), "presence_penalty": (int, float),
           "logit_bias": dict, "logprobs": (bool, int), "top_logprobs": int, "response_format": dict, "echo": bool, "suffix": str,
           "best_of": int, "parallel_tool_calls": bool, "metadata": dict, "store": bool, "service_tier": str}


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
    if len(stop) > MAX_STOPS or any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stop):
        raise BadRequest(f"stop takes at most {MAX_STOPS} entries of at most {MAX_STOP_CHARS} characters each", "stop")
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


def error_response(status: int, message: str, param=None, kind="invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def make_app(model_name: str):
    """The HTTP face of app.state.engine (None while the model loads: every endpoint answers 503 until it is ready)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="eaglet")
    app.state.engine = None
    created = int(time.time())

    def ready():
        return app.state.engine is not None and app.state.engine.ready

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):  # 404, 405, ...: OpenAI's error object, not Starlette's {"detail"}
        return error_response(e.status_code, str(e.detail))

    @app.get("/health")
    def health():
        if app.state.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse(app.state.engine.health(), status_code=200 if ready() else 503)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "eaglet"}]}

    async def complete(request: Request, chat: bool):
        if not ready():
            return error_response(503, "the model is loading: try again once /health says ok", kind="server_error")
        engine = app.state.engine
        limit = BODY_BYTES_PER_TOKEN * engine.context + 65536
        try:
            body = await read_body(request, limit)
            if body is None:
                return error_response(413, f"the request body is over {limit} bytes: no prompt that long fits the context of {engine.context} tokens")
            try:
                req = json.loads(body)
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(f"the request body is not valid JSON: {e}") from None
            except RecursionError:
                raise BadRequest("the request body is not valid JSON: nested too deep") from None
            fields = parse_request(req, chat, engine)
            stream = fields.pop("stream")
            events, loop = asyncio.Queue(), asyncio.get_running_loop()
            job = Job(**fields, emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
            if not engine.submit(job):
                return error_response(503, "the server is shutting down", kind="server_error")
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
    """A uvicorn Server that, once told to exit (should_exit), takes no new connections and answers the open ones before
    run() returns. Run on a thread other than the main one, it leaves the signals to its caller (drain_on_signals)."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=None))


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
                    a.batch_size if a.cache_rows is None else a.cache_rows, log=lambda s: print(s, file=sys.stderr))
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
    app = make_app(model_name(a))
    app.state.engine = engine
    return engine, app, sock, banner


def main(argv=None) -> int:
    """HTTP on a thread of its own from the start (503 until ready); the model loaded, warmed up and run on this one,
    the thread its kernels stay on (engine.py). SIGINT or SIGTERM drains: no new connection, the open ones answered,
    exit 0; a second one aborts what is left (each stream gets an error event), exit 1."""
    try:
        a, sock = parse(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = make_app(model_name(a))
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
        return 2
    app.state.engine = engine

    def ready():
        print(banner, file=sys.stderr, flush=True)
        drain_on_signals(server, engine)

    engine.run(on_ready=ready)
    if engine.counts["aborted"]:
        print(f"stopped: {engine.counts['aborted']} requests aborted", file=sys.stderr)
        return 1
    thread.join()
    print("drained: every request answered", file=sys.stderr)
    return 0


def drain_on_signals(server, engine):
    """SIGINT and SIGTERM: the first drains (uvicorn stops taking connections and answers the open ones), the second
    aborts (Engine.abort)."""
    def handle(signum, frame):
        if server.should_exit:
            server.force_exit = True
            engine.abort()
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)


if __name__ == "__main__":
    tp.exit_with(main)
