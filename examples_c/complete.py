#!/usr/bin/env python3
"""Text in, streamed text out, with the model file's own tokenizer: greedy completion of a
prompt, printed piece by piece as the ids arrive (a piece can end inside a UTF-8 character;
decodev2.TextStream holds such bytes back until the character is whole).

Usage: python3 examples_c/complete.py MODEL PROMPT [--tokens N] [--backend auto|cpu|cuda]"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import decodev2  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("prompt")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--backend", default="auto", choices=decodev2.BACKENDS)
    args = ap.parse_args()
    with decodev2.Engine.load(args.model, backend=args.backend) as e:
        ids = e.tokenize(args.prompt, add_special=True)
        stream = decodev2.TextStream()
        sys.stdout.write(args.prompt)
        sys.stdout.write(stream.push(e.piece(e.prefill(ids))))
        for _ in range(args.tokens - 1):
            if e.finished() or e.position() >= e.info.max_seq:
                break
            sys.stdout.write(stream.push(e.piece(e.step())))
            sys.stdout.flush()
        print()


if __name__ == "__main__":
    main()
