#!/usr/bin/env python3
"""Reference outputs for a GGUF file from transformers' own GGUF loader (needs the `gguf`
package): the file is dequantized to f32 by transformers and run on the GPU.

    python3 tests/hf/gguf_reference.py MODEL.gguf OUT_DIR PROMPT_IDS [--compare-steps N]

Writes OUT_DIR/{reference.json, logits.f32}; reference.json names the model file, which
tests/hf_reference.rs then loads with decodev2 (DV2_HF_REF_DIR=the parent of OUT_DIR).
decodev2 re-quantizes every tensor to NF4, transformers keeps the dequantized f32 values, so
the two differ by quantization noise: the cap is loose and only the first --compare-steps
greedy ids must agree.
"""
import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("prompt", help="comma-separated token ids")
    ap.add_argument("--compare-steps", type=int, default=8)
    ap.add_argument("--cap", type=float, default=3.0)
    a = ap.parse_args()
    path = Path(a.gguf).resolve()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = model.to("cuda").eval()
    prompt = [int(v) for v in a.prompt.split(",")]
    greedy, past = [], None
    inp = torch.tensor([prompt], device="cuda")
    for _ in range(16):
        o = model(input_ids=inp, past_key_values=past, use_cache=True)
        past = o.past_key_values
        greedy.append(int(o.logits[0, -1].argmax()))
        inp = torch.tensor([[greedy[-1]]], device="cuda")
    seq = prompt + greedy[:15]
    logits = model(input_ids=torch.tensor([seq], device="cuda")).logits[0].float().cpu()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logits.contiguous().numpy().tofile(out / "logits.f32")
    (out / "reference.json").write_text(json.dumps({
        "model": str(path), "prompt": prompt, "greedy": greedy, "sequence": seq,
        "positions": len(seq), "vocab": logits.shape[1], "cap": a.cap,
        "compare_steps": a.compare_steps}))
    print(f"{path.name}: transformers greedy {greedy}")


if __name__ == "__main__":
    main()
