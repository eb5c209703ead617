"""The decodev2 command line: greedy or sampled text from a model file.

    python -m decodev2 generate MODEL --prompt "The capital of France is" [--tokens N]
    python -m decodev2 chat MODEL [--system TEXT]   # a conversation on stdin, the chat template
    python -m decodev2 serve MODEL [--port 8000]   # an OpenAI-compatible server (the server extra)
A request's prompt is prefilled from where it leaves the last request's ids (a chat's earlier
turns are not computed again; serve also keeps earlier conversations' states in host memory,
--state-cache MIB, so that conversations taking turns are not either; serve --no-prefix-reuse
prefills every prompt whole).
Options: --backend auto|cpu|cuda, --temperature T, --top-p P, --seed S, --max-seq N, --stop TEXT
(repeatable: the reply ends before the first of them), --prompt-cache FILE (the request's KV cache
is saved to FILE after each reply, and a later run's prompt prefix that FILE holds, a long system
message for one, is not prefilled again), --speculate N (greedy replies check up to N ids copied
from where the text's last ids occurred before in one forward: the same reply, sooner where it
repeats its context; serve takes it too)."""
import argparse
import os
import sys

from . import BACKENDS, Dv2Error, Engine


SPECULATE_HELP = ("greedy replies: check up to N ids (1-15) copied from where the text's last ids occurred "
                  "before in one forward; faster where the reply repeats its context (0: off)")


def _engine(args):
    e = Engine.load(args.model, backend=args.backend, max_seq=args.max_seq, eos_id=-2)
    if args.temperature > 0:
        e.set_sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    e.set_speculation(args.speculate)
    return e


def _stream(e, prompt, args, out, chat=False):
    """Writes the reply to `prompt` as it is generated (up to args.tokens ids; the model's end
    of generation and a stop string are not written)."""
    for text in e.generate(prompt, max_tokens=args.tokens, chat=chat, stop=args.stop):
        out.write(text)
        out.flush()


def _load_prompt_cache(e, path):
    """Loads the prompt cache at `path` where there is one; one this engine cannot use (another
    model, a broken file) is reported and left to be overwritten."""
    if not os.path.exists(path):
        return
    try:
        e.load_state(path)
    except Dv2Error as err:
        print(f"decodev2: prompt cache {path} not used: {err}", file=sys.stderr)


def _save_prompt_cache(e, path):
    """Saves the request to the prompt cache at `path` (none given: nothing) and says on stderr
    how much of its prompt the cache held."""
    if path:
        saved = e.save_state(path)
        print(f"decodev2: prompt cache: {e.reused} prompt ids reused, {saved} saved to {path}", file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="decodev2", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("generate", "chat"):
        p = sub.add_parser(name)
        p.add_argument("model")
        p.add_argument("--backend", default="auto", choices=BACKENDS)
        p.add_argument("--tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--max-seq", type=int, default=4096)
        p.add_argument("--speculate", type=int, default=0, metavar="N", help=SPECULATE_HELP)
        p.add_argument("--stop", action="append", default=[], help="end the reply before this text (repeatable)")
        p.add_argument("--prompt-cache", metavar="FILE",
                       help="save the KV cache to FILE; a later prompt's prefix held there is not prefilled again")
        if name == "generate":
            p.add_argument("--prompt", required=True)
        else:
            p.add_argument("--system", help="a system message ahead of the conversation")
    p = sub.add_parser("serve")
    p.add_argument("model")
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-seq", type=int, default=4096)
    p.add_argument("--speculate", type=int, default=0, metavar="N", help=SPECULATE_HELP)
    p.add_argument("--no-prefix-reuse", dest="reuse", action="store_false",
                   help="prefill every prompt whole, not from where it leaves the last request's ids")
    p.add_argument("--state-cache", type=int, default=2048, metavar="MIB",
                   help="host memory for earlier conversations' states, so that conversations taking turns "
                        "are not prefilled again (0: none)")
    p.add_argument("--api-key", default=os.environ.get("DECODEV2_API_KEY"),
                   help="answer /v1 requests only with 'Authorization: Bearer KEY' (default: $DECODEV2_API_KEY)")
    args = ap.parse_args(argv)
    if args.command == "serve":
        from .server import serve

        serve(args.model, host=args.host, port=args.port, backend=args.backend, max_seq=args.max_seq,
              reuse=args.reuse, api_key=args.api_key or None, state_cache_mib=args.state_cache,
              speculate=args.speculate)
        return 0
    with _engine(args) as e:
        if args.prompt_cache:
            _load_prompt_cache(e, args.prompt_cache)
        if args.command == "generate":
            sys.stdout.write(args.prompt)
            _stream(e, args.prompt, args, sys.stdout)
            print()
            _save_prompt_cache(e, args.prompt_cache)
            return 0
        messages = [{"role": "system", "content": args.system}] if args.system else []
        for line in sys.stdin:
            messages.append({"role": "user", "content": line.rstrip("\n")})
            reply = []

            class Tee:
                def write(self, text):
                    reply.append(text)
                    sys.stdout.write(text)

                def flush(self):
                    sys.stdout.flush()

            _stream(e, messages, args, Tee(), chat=True)
            print()
            _save_prompt_cache(e, args.prompt_cache)
            messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
