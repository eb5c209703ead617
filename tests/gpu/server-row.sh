#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after ../shared/tools/device-pack built
# .device/ here (or .dz/device.tgz carried) and with starlette and uvicorn wheels in .whl/
# (docs/lab.md session 25 says how): issue 35's row, the OpenAI-compatible server on the 3B
# shape against the library's own rate. The model: qwen25_3b's synthetic weights written as a
# bitsandbytes nf4 directory by convert_bnb, with a word-level tokenizer of its 151,936 ids
# (tests/gpu/word_tokenizer.py). The library's own: step_n over 128 steps (the graph replays)
# and Engine.generate (the loop the server runs: a step and a piece per token) in Python.
# Logs go to $OUT (or ./device-logs).
# Usage: bash tests/gpu/server-row.sh [TOKENS] [REPS]   (PRESET=tiny_llama BACKEND=cpu: a check here)
set -uo pipefail
[[ -d .device || ! -f .dz/device.tgz ]] || tar xzf .dz/device.tgz
out=${OUT:-device-logs}; mkdir -p "$out"
tokens=${1:-128} reps=${2:-5}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/python:/tmp/site DV2_LIB=$PWD/.device/lib/libdecodev2.so DV2_CACHE_DIR=/tmp/dv2-cache
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
preset=${PRESET:-qwen25_3b} backend=${BACKEND:-cuda}
model=/tmp/$preset-bnb
[[ -f $model/tokenizer.json ]] || {
  .device/examples/convert_bnb --synthetic $preset 1 $model &&
    python3 tests/gpu/word_tokenizer.py $model "$(python3 -c "import json; print(json.load(open('$model/config.json'))['vocab_size'])")"
} > "$out/model.log" 2>&1 || { cat "$out/model.log"; exit 1; }
python3 - "$model" "$tokens" "$backend" > "$out/library.txt" 2>&1 <<'PY'
import sys, time
import decodev2
path, tokens, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3]
t = time.perf_counter()
e = decodev2.Engine.load(path, backend=backend, max_seq=4096)
print(f"loaded on {e.backend} in {time.perf_counter() - t:.2f} s")
prompt = e.tokenize("the capital of France is")
for name, sampling in [("greedy", {"temperature": 0}), ("sampled (T 1, top_p 0.9)", {"temperature": 1.0, "top_p": 0.9, "seed": 5})]:
    e.reset(); e.set_sampling(**sampling); e.prefill(prompt); e.step_n(tokens)  # capture
    rates = []
    for _ in range(5):
        e.reset(); e.prefill(prompt)
        t = time.perf_counter(); e.step_n(tokens); rates.append(tokens / (time.perf_counter() - t))
    gen = []
    for _ in range(5):
        t = time.perf_counter(); n = sum(1 for _ in e.generate(prompt, max_tokens=tokens, **sampling))
        gen.append(n / (time.perf_counter() - t))
    rates.sort(); gen.sort()
    print(f"  {name}: step_n({tokens}) {rates[2]:.1f} tok/s; Engine.generate {gen[2]:.1f} tok/s (pieces a second)")
PY
cat "$out/library.txt"
python3 -m decodev2 serve $model --backend "$backend" --port 8123 --max-seq 4096 > "$out/server.log" 2>&1 &
server=$!
python3 -c "
import time, urllib.request
for _ in range(240):
    try: urllib.request.urlopen('http://127.0.0.1:8123/v1/models'); break
    except OSError: time.sleep(0.5)"
python3 tests/server/rate_clients.py http://127.0.0.1:8123 "$tokens" "$reps" 2>&1 | tee "$out/server-rate.txt"
status=${PIPESTATUS[0]}
kill $server; wait $server 2>/dev/null
tail -3 "$out/server.log"
exit $status
