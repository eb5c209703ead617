"""bitsandbytes 4-bit directories between transformers + bitsandbytes and decodev2 (issue 31),
on the GPU machine. Prints one line per case and exits non-zero when a check fails.

1. transformers writes them: a random Llama-shaped model and a Qwen2-shaped one (q/k/v
   biases, tied embeddings), loaded with load_in_4bit (nf4, compute float32), with and without
   the nested (double) quantization, saved with save_pretrained. decodev2 loads that directory
   on the CPU and on CUDA, prefills a prompt and decodes 32 greedy ids; transformers + bitsandbytes, teacher-
   forced on decodev2's ids, gives the logits at each step. Each id must be transformers'
   argmax or a near-tie (its margin under 0.05); the largest |logit difference| is printed
   against the cap. The embedding (and an untied lm_head), which transformers keeps in 16/32
   bits while decodev2 holds NF4, are made NF4 values first (bitsandbytes' own quantize and
   dequantize), and the norms bf16 values (as checkpoints hold them), so both sides compute
   with the same weights.
2. decodev2 writes them (examples/convert_bnb --synthetic): transformers + bitsandbytes load the
   directory; its logits on a prompt against decodev2's on the same directory.

usage: PYTHONPATH=<bitsandbytes> DV2_LIB=<libdecodev2.so> python3 tests/gpu/bnb-check.py WORKDIR CONVERT_BNB
"""

import os
import subprocess
import sys

import torch
import bitsandbytes.functional as bnbf
from transformers import (AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import decodev2  # noqa: E402

CAP = 0.05
NEAR_TIE = 0.05
STEPS = 32
work, convert = sys.argv[1], sys.argv[2]
failed = []


def nf4_values(w):
    """w replaced by the values of its NF4 codes (blocksize 64), as bitsandbytes decodes them."""
    q, state = bnbf.quantize_4bit(w.detach().float().cuda().contiguous(), blocksize=64, quant_type="nf4")
    return bnbf.dequantize_4bit(q, state).float().cpu()


def load_4bit(path, nested):
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=nested,
                             bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg, dtype=torch.float32,
                                                device_map="cuda").eval()


@torch.no_grad()
def teacher_logits(model, ids):
    """transformers' logits after each prefix of ids (f32, on the CPU)."""
    out = model(input_ids=torch.tensor([ids], device="cuda")).logits[0].float().cpu()
    return out


def dv2_greedy(path, prompt, steps, backend):
    e = decodev2.Engine.load(path, backend=backend, max_seq=128)
    ids, logits = [e.prefill(prompt)], [e.logits()]
    for _ in range(steps - 1):
        ids.append(e.step())
        logits.append(e.logits())
    e.close()
    return ids, torch.tensor(logits)


def compare(name, model, prompt, path, steps):
    for backend in ("cpu", "cuda"):
        ids, logits = dv2_greedy(path, prompt, steps, backend)
        compare_ids(f"{name} ({backend})", model, prompt, ids, logits)


def compare_ids(name, model, prompt, ids, logits):
    ref = teacher_logits(model, prompt + ids[:-1])[len(prompt) - 1:]
    err = (ref - logits).abs().max().item()
    ties, wrong = [], []
    for i, (want, got) in enumerate(zip(ref, ids)):
        best = int(want.argmax())
        if best != got:
            gap = (want[best] - want[got]).item()
            (ties if gap < NEAR_TIE else wrong).append((i, round(gap, 4)))
    ok = not wrong and err <= CAP
    print(f"{name}: {len(ids)} ids {'equal' if not ties and not wrong else 'differ'}; near-ties {ties}; "
          f"other differences {wrong}; max |logit - transformers| {err:.5f} (cap {CAP}): {'ok' if ok else 'FAILED'}")
    if not ok:
        failed.append(name)


def written_by_transformers(kind, nested):
    torch.manual_seed(0)
    common = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256, rms_norm_eps=1e-6,
                  initializer_range=512 ** -0.5)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0))
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.5)
            # Norms as checkpoints hold them (and decodev2 keeps them): bf16 values.
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(torch.randn_like(norm.weight).mul(0.2).add(1).bfloat16().float())
        model.model.norm.weight.copy_(model.model.norm.weight.bfloat16().float())
        model.model.embed_tokens.weight.copy_(nf4_values(model.model.embed_tokens.weight))
        if not model.config.tie_word_embeddings:
            model.lm_head.weight.copy_(nf4_values(model.lm_head.weight))
    src = os.path.join(work, f"{kind}-f32")
    model.save_pretrained(src)
    q = load_4bit(src, nested)
    dst = os.path.join(work, f"{kind}-bnb{'-nested' if nested else ''}")
    q.save_pretrained(dst)
    prompt = [int(i) for i in torch.randint(0, 4096, (8,), generator=torch.Generator().manual_seed(1))]
    compare(f"transformers-written {kind}, nested={nested}", q, prompt, dst, STEPS)


def written_by_decodev2(preset):
    dst = os.path.join(work, f"dv2-{preset}")
    subprocess.run([convert, "--synthetic", preset, "0", dst], check=True)
    q = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32, device_map="cuda").eval()
    vocab = q.config.vocab_size
    prompt = [int(i) for i in torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(2))]
    compare(f"decodev2-written {preset} in transformers", q, prompt, dst, 8)


for kind in ("llama", "qwen2"):
    for nested in (False, True):
        written_by_transformers(kind, nested)
for preset in ("medium_llama", "tiny_internlm"):
    written_by_decodev2(preset)
print("FAILED: " + ", ".join(failed) if failed else "all bitsandbytes checks passed")
sys.exit(1 if failed else 0)
