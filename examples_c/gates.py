#!/usr/bin/env python3
"""decodev2 Python example: the oracle gates of tests/fixtures/oracle_gates.txt via ctypes.

    python3 examples_c/gates.py [--backend auto|cpu|cuda] [--fixture PATH]

Exits 1 on any mismatch, 2 on a usage or fixture error."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import decodev2  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def read_fixture(path):
    cases, case = [], None
    for line in Path(path).read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        key, rest = words[0], words[1:]
        if key == "case":
            case = {"preset": rest[0], "seed": int(rest[1])}
        elif key == "end":
            cases.append(case)
            case = None
        elif key in ("prompt", "greedy", "teacher"):
            case[key] = [int(v) for v in rest]
        elif key == "prefill_len":
            case[key] = int(rest[0])
        elif key == "logits_cap":
            case[key] = float(rest[0])
        else:
            raise ValueError(f"{path}: unexpected line {line!r}")
    return cases


def run_case(case, backend):
    with decodev2.Engine.synthetic(case["preset"], case["seed"], backend=backend) as e:
        print(f"{case['preset']} seed {case['seed']}: backend {e.backend}, vocab {e.info.vocab}, max_seq {e.info.max_seq}")
        greedy = [e.prefill(case["prompt"][: case["prefill_len"]])]
        greedy += e.step_n(len(case["greedy"]) - 1)
        # The same request with speculative decoding (drafts of up to 7 ids): the same ids.
        e.reset()
        e.set_speculation(7)
        speculative = [e.prefill(case["prompt"][: case["prefill_len"]])]
        speculative += e.step_n(len(case["greedy"]) - 1)
        e.set_speculation(0)
        # A host's own draft of the next three greedy ids: all kept, with the one after them.
        e.reset()
        e.prefill(case["prompt"][: case["prefill_len"]])
        drafted = e.step_draft(case["greedy"][1:4])
        if drafted != case["greedy"][1:5]:
            print(f"  step_draft  {' '.join(map(str, drafted))}, expected {' '.join(map(str, case['greedy'][1:5]))}")
            speculative = []
        e.reset()
        teacher = []
        for tok in case["prompt"]:
            e.prefill([tok])
            logits = e.logits()
            teacher.append(max(range(len(logits)), key=logits.__getitem__))
    failures = 0
    for name, want, got in (("greedy", "greedy", greedy), ("speculative", "greedy", speculative),
                            ("teacher", "teacher", teacher)):
        print(f"  {name:11s} {' '.join(map(str, got))}")
        if got != case[want]:
            print(f"  expected    {' '.join(map(str, case[want]))}")
            failures += 1
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", choices=sorted(decodev2.BACKENDS), default="auto")
    ap.add_argument("--fixture", default=str(ROOT / "tests" / "fixtures" / "oracle_gates.txt"))
    args = ap.parse_args()
    print(f"decodev2 {decodev2.version()}, fixture {args.fixture}")
    cases = read_fixture(args.fixture)
    if not cases:
        print("no cases in fixture", file=sys.stderr)
        return 2
    failures = sum(run_case(c, args.backend) for c in cases)
    print(f"{len(cases)} cases, {failures} failed gates")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
