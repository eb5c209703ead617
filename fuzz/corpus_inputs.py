"""Writes a target's whole corpus as input files for `cargo afl fuzz -i`: its seeds and kept
crash inputs as they are, and each entry of queue.patches with its edits applied (the format
tests/fuzz_corpus.rs reads; pack_corpus.py writes it). Why: queue.patches is no input itself —
given to AFL++ as one (fuzzing `-i fuzz/corpus/abi`), it runs as a single 661 KB call sequence
of seconds an execution that AFL++ reports as a hang and mutates into more of the same
(session 82), while its entries, the coverage earlier campaigns found, go unused.
Usage (repository root): python3 fuzz/corpus_inputs.py TARGET DIR
    then: cd fuzz && cargo afl fuzz -i DIR -o /dev/shm/afl-TARGET ... target/release/TARGET
"""
import glob, os, shutil, struct, sys


def queue_entries(corpus):
    """Each queue.patches entry of the corpus folder `corpus`, as whole bytes, in order."""
    patches = f'{corpus}/queue.patches'
    packed = open(patches, 'rb').read() if os.path.exists(patches) else b''
    at = 0
    while at < len(packed):
        (length,) = struct.unpack_from('<I', packed, at)
        rec = packed[at + 4:at + 4 + length]
        at += 4 + length
        name = rec[1:1 + rec[0]].decode()
        seed = open(f'{corpus}/{name}', 'rb').read()
        r = 1 + rec[0]
        (edits,) = struct.unpack_from('<I', rec, r)
        r += 4
        data, copied = b'', 0
        for _ in range(edits):
            off, removed, inserted = struct.unpack_from('<III', rec, r)
            r += 12
            data += seed[copied:off] + rec[r:r + inserted]
            r += inserted
            copied = off + removed
        yield data + seed[copied:]


def whole_files(corpus):
    """The corpus' own files that are inputs as they are: everything but queue.patches."""
    return sorted(f for f in glob.glob(f'{corpus}/*') if os.path.basename(f) != 'queue.patches')


if __name__ == '__main__':
    target, out = sys.argv[1], sys.argv[2]
    corpus = f'fuzz/corpus/{target}'
    os.makedirs(out, exist_ok=True)
    files = whole_files(corpus)
    for f in files:
        shutil.copy(f, os.path.join(out, os.path.basename(f)))
    n = 0
    for n, data in enumerate(queue_entries(corpus), 1):
        open(os.path.join(out, f'queue-{n:06d}'), 'wb').write(data)
    print(f'{target}: {len(files)} files and {n} queue entries in {out}')
