#!/usr/bin/env python3
"""Writes a word-level tokenizer.json of VOCAB entries and a tokenizer_config.json with a ChatML
template into DIR, for a synthetic model written as a Hugging Face directory (convert_bnb
--synthetic): no model hub is reachable, and a served model needs a tokenizer that covers
every id it can draw. Id 0 is the end of text, 1 to 3 ChatML's markers, then common English
words, then "w<id>" for the rest; each decodes with a leading space (Metaspace).

Usage: python3 tests/gpu/word_tokenizer.py DIR VOCAB"""
import json
import sys

out, vocab_size = sys.argv[1], int(sys.argv[2])
special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
words = ("the of and to a in is it you that he was for on are with as I his they be at one have this "
         "from or had by word but what some we can out other were all there when up use your how said an "
         "each she which do their time if will way about many then them write would like so these her long "
         "make thing see him two has look more day could go come did number sound no most people my over "
         "know water than call first who may down side been now find capital France Paris city").split()
tokens = special + [f"\u2581{w}" for w in dict.fromkeys(words)]
tokens = tokens[:vocab_size] + [f"\u2581w{i}" for i in range(len(tokens), vocab_size)]
assert len(tokens) == vocab_size
added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
          "normalized": False, "special": True} for i, t in enumerate(special[:3])]
tokenizer = {
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
    "normalizer": None,
    "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
    "post_processor": None,
    "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
    "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(tokens)}, "unk_token": "<unk>"},
}
template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
config = {"eos_token": "<|endoftext|>", "add_bos_token": False, "chat_template": template}
with open(f"{out}/tokenizer.json", "w") as f:
    json.dump(tokenizer, f, ensure_ascii=False)
with open(f"{out}/tokenizer_config.json", "w") as f:
    json.dump(config, f)
print(f"{out}: a word-level tokenizer of {vocab_size} ids")
