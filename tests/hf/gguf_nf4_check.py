#!/usr/bin/env python3
"""Separates the loader from the quantization: SmolLM2 (or any llama GGUF) through
transformers' GGUF loader, once as transformers dequantizes it (f32) and once with every 2-D
weight passed through decodev2's NF4 round trip; both against decodev2's CPU backend (through
the ctypes module) on the same teacher-forced sequence. decodev2 must match the NF4 variant.

    DV2_LIB=target/release/libdecodev2.so python3 tests/hf/gguf_nf4_check.py MODEL.gguf IDS

Needs torch, transformers, gguf and accelerate (CPU is enough). Exits 1 when decodev2 and
transformers-with-NF4 differ by more than 0.01 in any logit or in any argmax.
"""
import importlib.util
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "python"))
import decodev2  # noqa: E402

spec = importlib.util.spec_from_file_location("make_reference", HERE / "make_reference.py")
make_reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_reference)


@torch.no_grad()
def main():
    path, ids = Path(sys.argv[1]).resolve(), [int(v) for v in sys.argv[2].split(",")]
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32, output_loading_info=True)
    model.eval()
    if "lm_head.weight" in info["missing_keys"]:
        # A GGUF without output.weight ties it to the embedding; some transformers versions
        # leave lm_head randomly initialised instead.
        model.lm_head.weight = model.model.embed_tokens.weight
    f32 = model(torch.tensor([ids])).logits[0]
    for _, p in model.named_parameters():
        if p.dim() == 2:
            p.copy_(make_reference.nf4_round_trip(p.data))
    nf4 = model(torch.tensor([ids])).logits[0]
    engine = decodev2.Engine.load(str(path), backend="cpu", max_seq=len(ids))
    ours = []
    for tok in ids:
        engine.prefill([tok])
        ours.append(engine.logits())
    ours = torch.tensor(ours)
    d_nf4 = (ours - nf4).abs().max().item()
    agree = bool((ours.argmax(-1) == nf4.argmax(-1)).all())
    print(f"max |decodev2 - transformers f32 dequant| = {(ours - f32).abs().max().item():.4f}")
    print(f"max |transformers NF4 - transformers f32|  = {(nf4 - f32).abs().max().item():.4f}")
    print(f"max |decodev2 - transformers NF4|          = {d_nf4:.4f}, argmax equal at all {len(ids)} positions: {agree}")
    return 0 if d_nf4 <= 0.01 and agree else 1


if __name__ == "__main__":
    sys.exit(main())
