#!/usr/bin/env python3
"""The server's API key and health route, in process (Starlette's test client) over a synthetic
model: without a key every route answers; with one, the /v1 routes answer 401 unless the
request carries it as a bearer token, and /health answers either way. Prints one line; exits 1
on the first failure."""
from starlette.testclient import TestClient

import decodev2
from decodev2.server import create_app

engine = decodev2.Engine.synthetic("tiny_llama", backend="cpu")
open_app = TestClient(create_app(engine, "tiny"))
assert open_app.get("/v1/models").status_code == 200
assert open_app.get("/health").json() == {"status": "ok"}

locked = TestClient(create_app(engine, "tiny", api_key="s3cret"))
for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Bearer s3cre"}):
    r = locked.get("/v1/models", headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (headers, r.text)
    r = locked.post("/v1/completions", json={"prompt": "x"}, headers=headers)
    assert r.status_code == 401, (headers, r.text)
r = locked.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny", r.text
assert locked.get("/health").json() == {"status": "ok"}
engine.close()
print("api key ok")
