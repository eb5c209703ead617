"""An OpenAI-compatible HTTP server over one loaded model (Starlette on uvicorn): /v1/models,
/v1/completions and /v1/chat/completions, streamed as server-sent events (the usage in a last
chunk under stream_options.include_usage) or not, with max_tokens (or max_completion_tokens),
stop, temperature, top_p, seed, logprobs, presence_penalty and frequency_penalty (OpenAI's:
subtracted once, and per occurrence, from the logit of an id among the request's last
penalty_last_n ids, 64 unless given, the prompt's included, as llama.cpp's server counts them),
n (up to 16 choices, decoded one after the other, choice i drawn with seed + i), logit_bias
(up to 1024 token ids, each bias in [-100, 100] added to the id's logit), and llama.cpp's
extensions top_k, min_p, repeat_penalty and penalty_last_n (an OpenAI client passes them in
extra_body). decodev2 decodes batch 1: requests wait their turn on one lock and run one
at a time in a worker thread; a request whose client leaves stops at its next id. A prompt is
prefilled from its first id that differs from the ids the last request left in the KV cache
(Engine.start: a chat's earlier turns, and a choice's prompt after the first choice, are not
prefilled again; usage.prompt_tokens_details.cached_tokens counts the ids kept), or from an
earlier conversation's state kept in host memory (StateCache, up to --state-cache MiB, 2048
unless given, 0 for none: conversations taking turns are not prefilled again either), unless
--no-prefix-reuse. A request decodes in dv2_step_n batches of about 20 ms (a step at a time
where a step takes longer, or where logprobs are asked), whose pieces then stream out one by
one.

    python -m decodev2 serve MODEL [--host 127.0.0.1] [--port 8000] [--backend auto] [--no-prefix-reuse]
        [--state-cache 2048] [--speculate 0]   # greedy requests check drafts of up to N ids
        [--api-key KEY]   # (or DECODEV2_API_KEY) the /v1 routes answer only "Authorization: Bearer KEY"

GET /health answers {"status": "ok"} once the model is loaded (no key needed).

Needs the `server` extra (`pip install "./python[server]"`)."""
import asyncio
import hmac
import json
import threading
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from . import Dv2Error, Engine, StateCache, StopText, TextStream

MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16
MAX_LOGIT_BIAS = 1024  # DV2_MAX_LOGIT_BIAS
# The request fields that go to Engine.set_sampling as they are.
SAMPLING = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "repeat_penalty",
            "penalty_last_n", "top_k", "min_p")


class BadRequest(Exception):
    pass


def _error(status, message, kind="invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _number(body, name, default, low, high, kind=float):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise BadRequest(f"{name} must be a {'integer' if kind is int else 'number'}")
    if not low <= value <= high:
        raise BadRequest(f"{name} = {value} is outside [{low}, {high}]")
    return kind(value)


class Generator:
    """One engine, one request at a time."""

    def __init__(self, engine, name, reuse=True, state_cache_mib=2048):
        self.engine, self.name, self.reuse = engine, name, reuse
        self.states = StateCache(state_cache_mib << 20) if reuse and state_cache_mib > 0 else None
        self.lock = threading.Lock()

    def params(self, body):
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise BadRequest("stop must be a non-empty string or a list of up to 4 of them")
        return {
            "logprobs": self.logprobs_asked(body),
            # max_completion_tokens: the chat API's newer name for it (the first given counts).
            "max_tokens": _number(body, "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens",
                                  256, 1, 1 << 20, int),
            "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
            "top_p": _number(body, "top_p", 1.0, 1e-6, 1.0),
            "seed": _number(body, "seed", 0, 0, (1 << 64) - 1, int),
            "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
            "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
            "repeat_penalty": _number(body, "repeat_penalty", 1.0, 1e-3, 10.0),
            "penalty_last_n": _number(body, "penalty_last_n", 64, -1, 1 << 20, int),
            "top_k": _number(body, "top_k", 0, 0, 1 << 20, int),
            "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
            "stop": stop,
            "n": _number(body, "n", 1, 1, MAX_CHOICES, int),
            "logit_bias": self.logit_bias_of(body),
        }

    def logit_bias_of(self, body):
        """The request's logit_bias ({"token id": bias in [-100, 100]}, OpenAI's) as
        Engine.set_logit_bias takes it."""
        asked = body.get("logit_bias") or {}
        if not isinstance(asked, dict) or len(asked) > MAX_LOGIT_BIAS:
            raise BadRequest(f"logit_bias must be an object of up to {MAX_LOGIT_BIAS} token ids")
        bias = {}
        for key in asked:
            try:
                token = int(key)
            except ValueError:
                raise BadRequest(f"logit_bias key {key!r} is not a token id")
            if not 0 <= token < self.engine.info.vocab:
                raise BadRequest(f"logit_bias token {token} is outside the vocabulary of {self.engine.info.vocab}")
            if token in bias:
                raise BadRequest(f"logit_bias names token {token} twice")
            bias[token] = _number(asked, key, 0.0, -100.0, 100.0)
        return bias

    @staticmethod
    def logprobs_asked(body):
        """None, or how many alternatives to give with each token's logprob: the chat API's
        logprobs (a boolean) with top_logprobs, the completions API's logprobs (a count)."""
        asked = body.get("logprobs")
        if asked is None or asked is False:
            if body.get("top_logprobs") not in (None, 0):
                raise BadRequest("top_logprobs needs logprobs")
            return None
        if asked is True:
            return _number(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, int)
        return _number(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS, int)

    def run_choices(self, prompt, p, emit, done, gone=lambda: False):
        """run() for each of the request's n choices, one after the other: choice i draws with
        seed + i (sampled choices differ; at temperature 0 they are the same), and each after
        the first prefills only the prompt's last id (Engine.start keeps the rest). Calls
        emit(i, text, tokens) per piece and done(i, finish_reason) at the end of choice i;
        returns the choices' (text, finish_reason, tokens) and the usage's (prompt_tokens,
        cached_tokens of the first choice, completion_tokens of all)."""
        choices, usage = [], None
        for i in range(p["n"]):
            seeded = dict(p, seed=(p["seed"] + i) % (1 << 64))
            text, finish, n_in, cached, n, tokens = self.run(
                prompt, seeded, lambda t, lps, i=i: emit(i, t, lps), gone)
            choices.append((text, finish, tokens))
            done(i, finish)
            usage = (n_in, cached, n) if usage is None else (usage[0], usage[1], usage[2] + n)
        return choices, usage

    def run(self, prompt, p, emit, gone=lambda: False):
        """Tokenizes prompt (a (text, chat) pair) and decodes after it, calling emit(text,
        tokens) per piece of text, with the logprob entries of the tokens whose text begins in it
        (where asked); returns (text, finish_reason, prompt_tokens, cached_tokens,
        completion_tokens, tokens): cached_tokens are the prompt's first ids whose KV cache the
        last request left (Engine.start). Stops at max_tokens, a stop string (not emitted) or
        the model's end of generation, or before the next id once gone() says the client left
        (finish_reason "cancelled"; nothing runs for a client gone before its turn)."""
        with self.lock:
            if gone():
                return "", "cancelled", 0, 0, 0, []
            e = self.engine
            content, chat = prompt
            if chat:
                ids = e.tokenize(e.chat(content), add_special=True, parse_special=True)
            else:
                ids = e.tokenize(content, add_special=True)
            e.set_sampling(**{k: p[k] for k in SAMPLING})
            e.set_logit_bias(p["logit_bias"])
            room = e.info.max_seq - len(ids)
            if room < 1:
                raise BadRequest(f"the prompt's {len(ids)} tokens leave no room in max_seq {e.info.max_seq}")
            stream, stops, count = TextStream(), StopText(p["stop"]), 0
            tokens, told = [], 0  # logprob entries, and how many went out
            first = self.states.start(e, ids) if self.states else e.start(ids, self.reuse)

            def out(text, final=False):
                """Emits text, the new text stops released, with the tokens that begin in it."""
                nonlocal told
                new = tokens[told:] if final else [t for t in tokens[told:] if t["offset"] < stops.sent]
                told += len(new)
                emit(text, new)

            limit = min(p["max_tokens"], room)
            # The logprobs read each step's logits: one dv2_step per id where they are asked.
            for next_id in e.decoded(first, limit, each_step=p["logprobs"] is not None):
                if gone():
                    finish = "cancelled"
                    break
                piece = e.piece(next_id)
                if p["logprobs"] is not None:
                    lp, top = e.logprobs(next_id, p["logprobs"])
                    tokens.append({"offset": len(stops.text), "id": next_id, "bytes": piece, "logprob": lp,
                                   "top": [(i, v, e.piece(i)) for i, v in top]})
                count += 1
                if stops.add(stream.push(piece)):
                    # The tokens that began the stop string go with it.
                    finish = "stop"
                    tokens = [t for t in tokens if t["offset"] < len(stops.text)]
                    break
                text = stops.release()
                if text:
                    out(text)
            else:
                # The ids ran out: at the model's end of generation, or at the limit.
                finish = "stop" if count < limit else "length"
            text = stops.release(final=True)
            if text or len(tokens) > told:
                out(text, final=True)
            return stops.text, finish, len(ids), e.reused, count, tokens


def _token(data):
    return data.decode("utf-8", errors="replace")


def logprobs_of(tokens, chat):
    """The tokens' logprob entries as the chat API (content: token, logprob, bytes,
    top_logprobs) or the completions API (tokens, token_logprobs, top_logprobs, text_offset)
    gives them."""
    if chat:
        return {"content": [{
            "token": _token(t["bytes"]), "logprob": t["logprob"], "bytes": list(t["bytes"]),
            "top_logprobs": [{"token": _token(b), "logprob": v, "bytes": list(b)} for _, v, b in t["top"]],
        } for t in tokens]}
    return {
        "tokens": [_token(t["bytes"]) for t in tokens],
        "token_logprobs": [t["logprob"] for t in tokens],
        "top_logprobs": [{_token(b): v for _, v, b in t["top"]} for t in tokens],
        "text_offset": [t["offset"] for t in tokens],
    }


def create_app(engine, name, reuse=True, api_key=None, state_cache_mib=2048):
    """The app over `engine`, served as `name`. With api_key, the /v1 routes answer only requests
    that carry it (`Authorization: Bearer KEY`, as OpenAI clients send their key); /health needs
    none."""
    gen = Generator(engine, name, reuse, state_cache_mib)

    def guarded(endpoint):
        if api_key is None:
            return endpoint
        want = f"Bearer {api_key}".encode()

        async def check(request):
            if not hmac.compare_digest(request.headers.get("authorization", "").encode(), want):
                return _error(401, "a missing or wrong API key (Authorization: Bearer KEY)", "authentication_error")
            return await endpoint(request)

        return check

    async def health(_request):
        return JSONResponse({"status": "ok"})

    async def models(_request):
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "decodev2"}]})

    async def body_of(request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the body is not JSON")
        if not isinstance(body, dict):
            raise BadRequest("the body is not a JSON object")
        return body

    def prompt_of(body, chat):
        """The request's prompt as run() takes it, checked."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise BadRequest("messages must be a non-empty list of {role, content} strings")
            return [{"role": m["role"], "content": m["content"]} for m in messages], True
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt must be a non-empty string")
        return prompt, False

    def handler(chat):
        kind = "chat.completion" if chat else "text_completion"

        async def handle(request: Request):
            try:
                body = await body_of(request)
                p = gen.params(body)
                prompt = prompt_of(body, chat)
            except BadRequest as err:
                return _error(400, str(err))
            rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())

            def choice(index, text, finish, tokens, delta=False):
                logprobs = None if p["logprobs"] is None else logprobs_of(tokens, chat)
                if chat:
                    key = "delta" if delta else "message"
                    content = {"content": text} if delta else {"role": "assistant", "content": text}
                    return {"index": index, key: content, "logprobs": logprobs, "finish_reason": finish}
                return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

            def usage(n_in, cached, n):
                return {"prompt_tokens": n_in, "completion_tokens": n, "total_tokens": n_in + n,
                        "prompt_tokens_details": {"cached_tokens": cached}}

            loop = asyncio.get_running_loop()
            # Set when the client leaves (a stream closed early, a timeout): the request stops at
            # its next id rather than decoding to max_tokens while the next requests wait.
            left = threading.Event()
            if not body.get("stream"):
                # Nothing is sent until the answer, so the disconnect is polled every 0.1 s.
                async def watch():
                    while not left.is_set():
                        if await request.is_disconnected():
                            left.set()
                        await asyncio.sleep(0.1)

                watcher = asyncio.create_task(watch())
                try:
                    choices, counts = await loop.run_in_executor(
                        None, gen.run_choices, prompt, p, lambda *_: None, lambda *_: None, left.is_set)
                except (BadRequest, Dv2Error) as err:
                    return _error(400, str(err))
                finally:
                    left.set()
                    watcher.cancel()
                return JSONResponse({
                    "id": rid, "object": kind, "created": created, "model": name,
                    "choices": [choice(i, *c) for i, c in enumerate(choices)], "usage": usage(*counts),
                })
            # stream_options.include_usage: every chunk has "usage": null, and one more chunk with
            # no choices carries the request's usage before [DONE], as OpenAI streams it.
            options = body.get("stream_options") or {}
            if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
                return _error(400, "stream_options must be an object whose include_usage is a boolean")
            with_usage = options.get("include_usage", False)

            queue = asyncio.Queue()

            def put(*event):
                loop.call_soon_threadsafe(queue.put_nowait, event)

            def work():
                try:
                    _, counts = gen.run_choices(prompt, p, lambda i, t, lps: put("text", (i, t, lps, None)),
                                                lambda i, finish: put("text", (i, "", [], finish)), left.is_set)
                    put("end", counts)
                except Exception as err:  # noqa: BLE001 - reported in the stream
                    put("error", str(err))

            async def events():
                loop.run_in_executor(None, work)
                try:
                    async for event in relay():
                        yield event
                finally:
                    left.set()

            async def relay():
                chunk = "chat.completion.chunk" if chat else "text_completion"
                while True:
                    what, value = await queue.get()
                    if what == "error":
                        yield f"data: {json.dumps({'error': {'message': value, 'type': 'server_error'}})}\n\n"
                        break
                    data = {"id": rid, "object": chunk, "created": created, "model": name}
                    if what == "end":
                        if with_usage:
                            data.update(choices=[], usage=usage(*value))
                            yield f"data: {json.dumps(data)}\n\n"
                        break
                    index, text, tokens, finish = value
                    data["choices"] = [choice(index, text, finish, tokens, delta=True)]
                    if with_usage:
                        data["usage"] = None
                    yield f"data: {json.dumps(data)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return handle

    async def not_found(request, _exc):
        return _error(404, f"no route {request.url.path}", "not_found_error")

    return Starlette(routes=[
        Route("/health", health),
        Route("/v1/models", guarded(models)),
        Route("/v1/completions", guarded(handler(False)), methods=["POST"]),
        Route("/v1/chat/completions", guarded(handler(True)), methods=["POST"]),
    ], exception_handlers={404: not_found})


def serve(model, host="127.0.0.1", port=8000, backend="auto", max_seq=4096, reuse=True, api_key=None,
          state_cache_mib=2048, speculate=0):
    import os

    import uvicorn

    engine = Engine.load(model, backend=backend, max_seq=max_seq, eos_id=-2)
    engine.set_speculation(speculate)
    name = os.path.basename(model.rstrip("/"))
    app = create_app(engine, name, reuse, api_key, state_cache_mib)
    uvicorn.run(app, host=host, port=port, log_level="warning")
