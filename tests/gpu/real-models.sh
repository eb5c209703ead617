#!/usr/bin/env bash
# Runs on the GPU machine after tests/gpu/run-on-device.sh's setup: the real-model checks.
#   1. SmolLM2-135M GGUF: cuda ids == cpu ids for 32 steps (DV2_SMOLLM2_GGUF must point at it).
#   2. transformers cross-check: tests/hf/make_reference.py writes random-weight Qwen2/Llama
#      directories (and, with --large, the Qwen2.5-3B shape in bf16) with reference outputs;
#      tests/hf_reference.rs compares decodev2 (cuda, and cpu for the small ones) with them.
# Logs in $OUT (or ./device-logs).
set -uo pipefail
out=${OUT:-device-logs}; mkdir -p "$out"
export DV2_REQUIRE_CUDA=1 DV2_CACHE_DIR=/tmp/dv2-cache
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
if [[ -n ${DV2_SMOLLM2_GGUF:-} ]]; then
  DV2_REQUIRE_MODELS=1 .device/tests/smollm2 --nocapture > "$out/smollm2.log" 2>&1 && echo "SmolLM2: ok" || { echo "SmolLM2: FAILED"; status=1; }
  grep -E "cuda |cpu |\||loaded|test result|panicked" "$out/smollm2.log"
fi
ref=/tmp/dv2-hf-ref
PYTHONUNBUFFERED=1 python3 tests/hf/make_reference.py "$ref" ${1:-} > "$out/hf-make.log" 2>&1 || { echo "make_reference: FAILED"; tail -20 "$out/hf-make.log"; exit 1; }
# SmolLM2 through transformers' GGUF loader (the gguf wheel travels in .whl/).
if [[ -n ${DV2_SMOLLM2_GGUF:-} ]] && ls .whl/gguf-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl
  PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 tests/hf/gguf_reference.py "$DV2_SMOLLM2_GGUF" "$ref-gguf/smollm2_gguf" 504,3575,282,4649,314 \
    >> "$out/hf-make.log" 2>&1 || { echo "gguf_reference: FAILED"; tail -20 "$out/hf-make.log"; status=1; }
fi
DV2_HF_REF_DIR=$ref .device/tests/hf_reference --nocapture > "$out/hf-reference.log" 2>&1 && echo "transformers cross-check: ok" || { echo "transformers cross-check: FAILED"; status=1; }
grep -E "load|panicked|test result|differ|cap" "$out/hf-reference.log"
# The GGUF comparison (transformers with the same NF4 round trip as decodev2's re-quantization).
if [[ -d $ref-gguf ]]; then
  DV2_HF_REF_DIR=$ref-gguf .device/tests/hf_reference --nocapture > "$out/hf-reference-gguf.log" 2>&1 \
    && echo "SmolLM2 GGUF vs transformers: ok" || { echo "SmolLM2 GGUF vs transformers: FAILED"; status=1; }
  grep -E "load|differ|cap" "$out/hf-reference-gguf.log"
fi
exit $status
