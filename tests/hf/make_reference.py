#!/usr/bin/env python3
"""Reference outputs from Hugging Face transformers for decodev2's loader and engines.

For each config below: random weights (seeded), every linear and the embedding passed
through an NF4 round trip exactly as decodev2's codec does (blocks of 64 along K, f32 absmax,
reciprocal in f32, bitsandbytes' thresholds, high nibble first is irrelevant here since the
values are decoded again), norm weights rounded to bf16 (decodev2 keeps them in bf16); saved
with save_pretrained-compatible config.json + safetensors; then transformers runs the model
(float32 on the GPU): greedy ids for 32 steps after an 8-id prompt, and the teacher-forced
logits of every position of prompt + the first 31 generated ids.

    python3 tests/hf/make_reference.py OUT_DIR [--large]

Writes OUT_DIR/<name>/{config.json, model*.safetensors, reference.json, logits.f32}.
--large adds the Qwen2.5-3B shape, saved in bf16 (the dtype real checkpoints use).
tests/hf_reference.rs compares decodev2 with these (DV2_HF_REF_DIR=OUT_DIR).
"""
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

CODEBOOK = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], dtype=torch.float32)
# bitsandbytes' decision thresholds (dQuantizeNF4), ascending: code = number of thresholds < x.
THRESHOLDS = torch.tensor([
    -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
    -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
    0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
    0.5016634166240692, 0.6427869200706482, 0.8614784181118011], dtype=torch.float32)


def nf4_round_trip(w):
    """The values decodev2's NF4 codec decodes w [rows, cols] to (cols % 64 == 0)."""
    rows, cols = w.shape
    b = w.float().reshape(-1, 64)
    absmax = b.abs().amax(dim=1, keepdim=True)
    x = b * (1.0 / absmax)
    codes = torch.bucketize(x, THRESHOLDS.to(w.device), right=False)
    codes[torch.isnan(x)] = 0  # an all-zero block: bitsandbytes' NaN falls to code 0
    return (CODEBOOK.to(w.device)[codes] * absmax).reshape(rows, cols)


CONFIGS = {
    "tiny_qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_theta=1e6, tie_word_embeddings=True), 0.05),
    "tiny_llama": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False), 0.05),
    # Llama 3.1's RoPE bands over 32-dim heads with an original length of 32: pair 0
    # (wavelength 6.3) kept, pairs 1-2 blended, pairs 3-15 divided by the factor.
    "tiny_llama3": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32)), 0.05),
    # YaRN at factor 4 over an original length of 64; max_position_embeddings is 4 x 64 so
    # that transformers 4.x (which takes the factor as their ratio) and 5.x (as given) agree.
    "tiny_qwen2_yarn": (Qwen2Config, Qwen2ForCausalLM, dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_theta=1e6, tie_word_embeddings=True, rope_scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=64)), 0.05),
    # Heads set apart from hidden / heads (Mistral Nemo's form): 8 heads of 64 over hidden 256,
    # q and o 512 wide.
    "tiny_wide_heads": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False), 0.05),
}
LARGE = {
    "qwen25_3b_shape": (Qwen2Config, Qwen2ForCausalLM, dict(
        hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1e6, tie_word_embeddings=True), 0.5),
}


@torch.no_grad()
def build(name, cfg_cls, model_cls, kw, cap, out, dtype):
    torch.manual_seed(0)
    cfg = cfg_cls(**kw, hidden_act="silu")
    cfg.architectures = [model_cls.__name__]
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).to("cuda").float().eval()
    sd = model.state_dict()
    h = kw["hidden_size"]
    for key, t in sd.items():
        if key.endswith("norm.weight"):
            t.copy_((1 + 0.2 * torch.randn_like(t)).to(torch.bfloat16).float())
        elif key.endswith(".bias"):
            t.copy_(0.5 * torch.randn_like(t))
        elif key == "model.embed_tokens.weight":
            scale = 4.0 / math.sqrt(h) if kw["tie_word_embeddings"] else 1.0
            t.copy_(nf4_round_trip(torch.randn_like(t) * scale))
        elif key == "lm_head.weight":
            if not kw["tie_word_embeddings"]:
                t.copy_(nf4_round_trip(torch.randn_like(t) * 4.0 / math.sqrt(h)))
        elif t.dim() == 2:
            t.copy_(nf4_round_trip(torch.randn_like(t) / math.sqrt(t.shape[1])))
    if kw["tie_word_embeddings"]:
        model.tie_weights()
    if dtype == torch.bfloat16:
        # A bf16 checkpoint: transformers computes with the bf16-rounded values too.
        for t in model.state_dict().values():
            t.copy_(t.to(torch.bfloat16).float())
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(d)
    tensors = {k: v.to(dtype).contiguous().cpu() for k, v in model.state_dict().items()
               if not (kw["tie_word_embeddings"] and k == "lm_head.weight")}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, kw["vocab_size"], (8,), generator=g).tolist()
    ids = list(prompt)
    greedy = []
    past = None
    inp = torch.tensor([prompt], device="cuda")
    for _ in range(32):
        o = model(input_ids=inp, past_key_values=past, use_cache=True)
        past = o.past_key_values
        nxt = int(o.logits[0, -1].argmax())
        greedy.append(nxt)
        inp = torch.tensor([[nxt]], device="cuda")
    seq = prompt + greedy[:31]
    logits = model(input_ids=torch.tensor([seq], device="cuda")).logits[0].float().cpu()
    positions = len(seq) if kw["vocab_size"] * len(seq) <= 4_000_000 else len(prompt)
    logits[:positions].contiguous().numpy().tofile(d / "logits.f32")
    (d / "reference.json").write_text(json.dumps({
        "prompt": prompt, "greedy": greedy, "sequence": seq, "positions": positions,
        "vocab": kw["vocab_size"], "cap": cap, "dtype": str(dtype),
        "transformers_argmax": logits[:positions].argmax(-1).tolist()}))
    print(f"{name}: prompt {prompt}\n  greedy {greedy}", flush=True)


def main():
    out = Path(sys.argv[1])
    configs = dict(CONFIGS)
    if "--large" in sys.argv:
        configs.update(LARGE)
    for name, (c, m, kw, cap) in configs.items():
        build(name, c, m, kw, cap, out, torch.bfloat16 if name in LARGE else torch.float32)


if __name__ == "__main__":
    main()
