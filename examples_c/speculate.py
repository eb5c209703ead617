#!/usr/bin/env python3
"""What speculative greedy decoding (dv2_set_speculation, prompt lookup) gives on a model file
and a few kinds of chat request: the same reply with drafts off and on (the ids compared),
the forwards each took, the draft ids accepted, and the wall time of each reply.

    python3 examples_c/speculate.py MODEL.gguf [--backend cpu|cuda] [--draft 8] [--tokens 160]

Drafts pay where the reply repeats its context (an edit of given code, a list reformatted,
facts quoted from a passage) and seldom in free text: the table says how often on each.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import decodev2  # noqa: E402

CODE = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total += (value - m) ** 2
    return total / len(values)
'''

PASSAGE = ("The Amazon River in South America is the largest river by discharge volume of water "
           "in the world, and the disputed longest river system in the world in comparison to the "
           "Nile. The headwaters of the Apurimac River on Nevado Mismi had been considered for "
           "nearly a century as the Amazon basin's most distant source, until a 2014 study found "
           "it to be the headwaters of the Mantaro River on the Cordillera Rumi Cruz in Peru.")

REQUESTS = [
    ("edit code", f"Rename the variable `total` to `acc` in this code and print the whole code:\n\n{CODE}"),
    ("quote facts", f"{PASSAGE}\n\nList every fact in the passage above as a bullet point, in its words."),
    ("reformat list", "Write these as a numbered list: apples, pears, plums, cherries, grapes, lemons, "
                      "limes, oranges, peaches, apricots, melons, figs."),
    ("free text", "Write a short story about a lighthouse keeper."),
]


def reply(engine, messages, draft, tokens):
    engine.set_speculation(draft)
    before = engine.speculation_stats()
    ids = engine.tokenize(engine.chat(messages), add_special=True, parse_special=True)
    engine.reset()
    t = time.perf_counter()
    out = [engine.prefill(ids)]
    while len(out) < tokens and not engine.finished():
        out += engine.step_n(min(32, tokens - len(out)))
    seconds = time.perf_counter() - t
    after = engine.speculation_stats()
    stats = {k: after[k] - before[k] for k in after}
    return out, seconds, stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--draft", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=160)
    args = ap.parse_args()
    engine = decodev2.Engine.load(args.model, backend=args.backend, max_seq=2048, eos_id=-2)
    print(f"{'request':<14} {'ids':>4} {'forwards':>9} {'checks':>7} {'accepted':>9} {'off s':>7} {'on s':>7} "
          f"{'speedup':>8} same")
    for name, text in REQUESTS:
        messages = [{"role": "user", "content": text}]
        off, t_off, _ = reply(engine, messages, 0, args.tokens)
        on, t_on, stats = reply(engine, messages, args.draft, args.tokens)
        # Each check is one forward for 1 + its accepted ids; every other id is a step.
        forwards = len(on) - 1 - stats["accepted"]
        print(f"{name:<14} {len(on):>4} {forwards:>9} {stats['checks']:>7} {stats['accepted']:>4}/{stats['drafted']:<4} "
              f"{t_off:>7.2f} {t_on:>7.2f} {t_off / t_on:>8.2f} {off == on}")


if __name__ == "__main__":
    main()
