#!/usr/bin/env python3
"""Drives `decodev2 serve` (already listening at BASE_URL, SmolLM2 on the CPU) with the official
`openai` client and raw HTTP: a chat answer containing "Paris", a stream of more than one
chunk (with the usage at its end where asked), a second turn whose first turn is not prefilled
again, nor after another conversation's turn, a completion cut at a stop string, seeds, n
choices (streamed too), logprobs in the chat and completions formats, logit_bias, a stream
left early and a request timed out that stop decoding, and 4xx JSON errors for malformed
requests.
Prints one line per check; exits 1 on the first failure.

Usage: python3 tests/server/openai_clients.py BASE_URL MODEL (the served model file, whose
tokenizer gives logit_bias its ids)"""
import json
import sys
import time
import urllib.error
import urllib.request

from openai import APITimeoutError, BadRequestError, OpenAI

base = sys.argv[1].rstrip("/")
client = OpenAI(base_url=f"{base}/v1", api_key="unused")
model = client.models.list().data[0].id
print("model:", model)

reply = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=40,
    temperature=0)
text = reply.choices[0].message.content
print("chat:", repr(text), reply.choices[0].finish_reason, reply.usage)
assert "Paris" in text, text
short = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_completion_tokens=3,
    temperature=0)
assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length", short

chunks = list(client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=40,
    temperature=0, stream=True))
streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
print(f"stream: {len(chunks)} chunks, {streamed!r}")
assert len(chunks) >= 2 and streamed == text, (len(chunks), streamed)
assert all(c.usage is None for c in chunks)

# stream_options.include_usage: one more chunk, with no choices, carries the usage.
chunks = list(client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=40,
    temperature=0, stream=True, stream_options={"include_usage": True}))
last = chunks[-1]
print("stream usage:", last.usage)
assert last.choices == [] and all(c.usage is None for c in chunks[:-1])
assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == text
assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (reply.usage.prompt_tokens,
                                                                    reply.usage.completion_tokens)

# A second turn: the first turn's prompt and reply, whose KV cache the last request left, are
# not prefilled again (usage.prompt_tokens_details.cached_tokens).
turns = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": text},
         {"role": "user", "content": "And of Italy?"}]
second = client.chat.completions.create(model=model, messages=turns, max_tokens=20, temperature=0)
cached = second.usage.prompt_tokens_details.cached_tokens
print("second turn:", repr(second.choices[0].message.content), second.usage)
assert reply.usage.prompt_tokens <= cached < second.usage.prompt_tokens, (reply.usage, second.usage)

# Conversations taking turns: A's second turn after B's first starts from A's state, which the
# server kept in host memory when B replaced it (StateCache), not from the template's opening B
# leaves; and it decodes what the same request decodes again from the engine's own cache.
sys_a, sys_b = "You are a geography teacher. " * 8, "You are a cooking assistant. " * 8
a1 = [{"role": "system", "content": sys_a}, {"role": "user", "content": "What is the capital of Spain?"}]
ra = client.chat.completions.create(model=model, messages=a1, max_tokens=8, temperature=0)
client.chat.completions.create(model=model, messages=[{"role": "system", "content": sys_b},
                                                      {"role": "user", "content": "How do I boil an egg?"}],
                               max_tokens=8, temperature=0)
a2 = a1 + [{"role": "assistant", "content": ra.choices[0].message.content},
           {"role": "user", "content": "And of Portugal?"}]
back = client.chat.completions.create(model=model, messages=a2, max_tokens=8, temperature=0)
again = client.chat.completions.create(model=model, messages=a2, max_tokens=8, temperature=0)
print("turns taken:", ra.usage.prompt_tokens, back.usage, repr(back.choices[0].message.content))
assert back.usage.prompt_tokens_details.cached_tokens >= ra.usage.prompt_tokens, (ra.usage, back.usage)
assert back.choices[0].message.content == again.choices[0].message.content

done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16, temperature=0,
                                 stop=[","])
print("stop:", repr(done.choices[0].text), done.choices[0].finish_reason)
assert "," not in done.choices[0].text and "Paris" in done.choices[0].text
assert done.choices[0].finish_reason == "stop"

sampled = [client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0.9,
                                     seed=s).choices[0].text for s in (1, 1, 2)]
print("seeds:", sampled)
assert sampled[0] == sampled[1] != sampled[2]

# n choices: choice i draws with seed + i, so choices 0 and 1 of seed 1 are the completions of
# seeds 1 and 2 above; streamed, each choice's chunks carry its index and end in its
# finish_reason; at temperature 0 every choice is the greedy one.
several = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0.9,
                                    seed=1, n=3)
texts = [c.text for c in sorted(several.choices, key=lambda c: c.index)]
print("n=3:", texts, several.usage)
assert [c.index for c in several.choices] == [0, 1, 2] and texts[:2] == [sampled[0], sampled[2]]
assert several.usage.completion_tokens > 12 * 2
stream = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0.9,
                                        seed=1, n=3, stream=True))
by_index = {i: "".join(c.choices[0].text for c in stream if c.choices[0].index == i) for i in range(3)}
ends = [c.choices[0].index for c in stream if c.choices[0].finish_reason]
print("n=3 streamed:", by_index, ends)
assert [by_index[i] for i in range(3)] == texts and ends == [0, 1, 2]
greedy = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0, n=2)
assert greedy.choices[0].text == greedy.choices[1].text

# OpenAI's penalties (and llama.cpp's extensions through extra_body) reach the sampler: at
# temperature 0 a strong frequency penalty changes a greedy completion that repeats itself.
ask = dict(model=model, prompt="one, one, one, one, one,", max_tokens=12, temperature=0)
plain = client.completions.create(**ask).choices[0].text
penalized = client.completions.create(**ask, frequency_penalty=2.0, presence_penalty=1.0).choices[0].text
extended = client.completions.create(**ask, extra_body={"repeat_penalty": 3.0, "penalty_last_n": -1, "top_k": 1,
                                                        "min_p": 0.5}).choices[0].text
print("penalties:", repr(plain), repr(penalized), repr(extended))
assert plain != penalized and plain != extended

# logit_bias, by the ids of the model's tokenizer: banning the id greedy decoding chose first
# changes the completion's start; one favoured by 100 is the whole completion, greedy or sampled.
import decodev2

words = decodev2.Engine.load(sys.argv[2], backend="cpu", max_seq=16)
paris, banana = (words.tokenize(w, add_special=False)[0] for w in (" Paris", " banana"))
ask = dict(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
plain = client.completions.create(**ask).choices[0].text
banned = client.completions.create(**ask, logit_bias={str(paris): -100}).choices[0].text
forced = [client.completions.create(**ask | {"temperature": t}, logit_bias={str(banana): 100}).choices[0].text
          for t in (0, 1)]
print("logit_bias:", repr(plain), repr(banned), forced)
assert plain.startswith(" Paris") and not banned.startswith(" Paris"), (plain, banned)
assert forced == [words.piece(banana).decode() * 4] * 2, forced
# An end of generation that is not the engine's EOS id (SmolLM2's <|endoftext|>: the server
# stops at <|im_end|>) ends the completion too, with nothing of it in the text.
ends = [i for i in range(8) if words.is_eog(i) and i != words.special("eos")]
if ends:
    ended = client.completions.create(**ask, logit_bias={str(ends[0]): 100}).choices[0]
    print("other end of generation:", ends[0], repr(ended.text), ended.finish_reason)
    assert (ended.text, ended.finish_reason) == ("", "stop"), ended
words.close()

scored = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8,
    temperature=0, logprobs=True, top_logprobs=3)
entries = scored.choices[0].logprobs.content
print("chat logprobs:", [(e.token, round(e.logprob, 3), [t.token for t in e.top_logprobs]) for e in entries])
assert len(entries) == scored.usage.completion_tokens and "".join(e.token for e in entries).startswith(
    scored.choices[0].message.content[:1])
for e in entries:
    # Greedy: each token is its step's most likely one; alternatives in order, all <= 0.
    assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob, e
    assert all(a.logprob >= b.logprob for a, b in zip(e.top_logprobs, e.top_logprobs[1:])) and e.logprob <= 0, e
legacy = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0,
                                   logprobs=2).choices[0]
print("completion logprobs:", legacy.logprobs.tokens, legacy.logprobs.token_logprobs)
assert "".join(legacy.logprobs.tokens) == legacy.text and len(legacy.logprobs.top_logprobs[0]) == 2
assert legacy.logprobs.text_offset[0] == 0 and all(lp <= 0 for lp in legacy.logprobs.token_logprobs)

try:
    client.chat.completions.create(model=model, messages=[{"role": "user"}], max_tokens=4)
    raise AssertionError("a message without content was accepted")
except BadRequestError as err:
    print("4xx:", err.status_code, err.body)

# A client that leaves a stream early: its request stops at the next id, so the next request
# does not wait for the rest of it (a greedy completion of this prompt repeats itself to
# max_tokens).
ask = dict(model=model, prompt="one, one, one, one, one,", max_tokens=2000, temperature=0)
stream = client.completions.create(**ask, stream=True)
pieces, times = iter(stream), []
for _ in range(12):
    next(pieces)
    times.append(time.perf_counter())
stream.close()
per_id = (times[-1] - times[1]) / 10
start = time.perf_counter()
quick = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
waited = time.perf_counter() - start
print(f"left early: {per_id * 1e3:.1f} ms an id; the next request answered in {waited:.2f} s")
assert waited < 200 * per_id + 1.0, (waited, per_id)

# The same for a client that gives up on a completion not streamed (its timeout).
try:
    client.with_options(timeout=1.0, max_retries=0).completions.create(**ask)
    raise AssertionError("2,000 ids within 1 s")
except APITimeoutError:
    pass
start = time.perf_counter()
client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
waited = time.perf_counter() - start
print(f"timed out: the next request answered in {waited:.2f} s")
assert waited < 200 * per_id + 1.0, (waited, per_id)


def raw(path, data):
    req = urllib.request.Request(f"{base}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req)
        return 200, None
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


for path, data in [("/v1/chat/completions", b"{not json"), ("/v1/completions", b'{"prompt": 5}'),
                   ("/v1/completions", b'{"prompt": "x", "temperature": -1}'),
                   ("/v1/completions", b'{"prompt": "x", "logprobs": 21}'),
                   ("/v1/completions", b'{"prompt": "x", "frequency_penalty": 2.5}'),
                   ("/v1/completions", b'{"prompt": "x", "top_k": -1}'),
                   ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}'),
                   ("/v1/completions", b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}}'),
                   ("/v1/completions", b'{"prompt": "x", "n": 0}'),
                   ("/v1/completions", b'{"prompt": "x", "logit_bias": {"x": 1}}'),
                   ("/v1/completions", b'{"prompt": "x", "logit_bias": {"99999999": 1}}'),
                   ("/v1/completions", b'{"prompt": "x", "logit_bias": {"1": 101}}'),
                   ("/v1/completions", b'{"prompt": "x", "logit_bias": [1, 2]}'),
                   ("/v1/nothing", b"{}")]:
    status, body = raw(path, data)
    print("4xx:", path, status, body)
    assert 400 <= status < 500 and "error" in body, (status, body)
print("all checks passed")
