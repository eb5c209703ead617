#!/usr/bin/env python3
"""Reference outputs for a GGUF file from transformers' own GGUF loader (needs the `gguf`
package). decodev2 re-quantizes every 2-D tensor to NF4 at load; so that the comparison tests
the loader and not the quantization, the same NF4 round trip (make_reference.nf4_round_trip)
is applied to every 2-D weight inside transformers before it runs. The logits of the plain f32
dequantization are recorded too (logits_f32.f32), for the size of the quantization effect.

    python3 tests/hf/gguf_reference.py MODEL.gguf OUT_DIR PROMPT_IDS [--cap C]

Writes OUT_DIR/{reference.json, logits.f32, logits_f32.f32}; reference.json names the model
file, which tests/hf_reference.rs then loads with decodev2 (DV2_HF_REF_DIR=the parent of
OUT_DIR).
"""
import importlib.util
import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

_spec = importlib.util.spec_from_file_location("make_reference", Path(__file__).resolve().parent / "make_reference.py")
make_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_reference)


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("prompt", help="comma-separated token ids")
    ap.add_argument("--cap", type=float, default=0.25)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    path = Path(a.gguf).resolve()
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32, output_loading_info=True)
    if "lm_head.weight" in info["missing_keys"]:
        model.lm_head.weight = model.model.embed_tokens.weight  # a GGUF without output.weight is tied
    dev = a.device
    model = model.to(dev).eval()
    prompt = [int(v) for v in a.prompt.split(",")]
    f32_weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() == 2}
    for _, p in model.named_parameters():
        if p.dim() == 2:
            p.copy_(make_reference.nf4_round_trip(p.data))
    greedy, past = [], None
    inp = torch.tensor([prompt], device=dev)
    for _ in range(16):
        o = model(input_ids=inp, past_key_values=past, use_cache=True)
        past = o.past_key_values
        greedy.append(int(o.logits[0, -1].argmax()))
        inp = torch.tensor([[greedy[-1]]], device=dev)
    seq = prompt + greedy[:15]
    logits = model(input_ids=torch.tensor([seq], device=dev)).logits[0].float().cpu()
    for n, p in model.named_parameters():
        if n in f32_weights:
            p.copy_(f32_weights[n])
    f32_logits = model(input_ids=torch.tensor([seq], device=dev)).logits[0].float().cpu()
    print(f"max |transformers NF4 - transformers f32| = {(logits - f32_logits).abs().max().item():.4f}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logits.contiguous().numpy().tofile(out / "logits.f32")
    f32_logits.contiguous().numpy().tofile(out / "logits_f32.f32")
    (out / "reference.json").write_text(json.dumps({
        "model": str(path), "prompt": prompt, "greedy": greedy, "sequence": seq,
        "positions": len(seq), "vocab": logits.shape[1], "cap": a.cap}))
    print(f"{path.name}: transformers greedy {greedy}")


if __name__ == "__main__":
    main()
