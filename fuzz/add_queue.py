"""Appends to fuzz/corpus/<target>/queue.patches the entries of a new AFL++ queue that reach
coverage the corpus lacks: the corpus (its seeds' patched queue) and the new queue go through
afl-showmap together, and a greedy cover keeps the fewest new entries whose tuples (edge and
hit-count bucket) no old input has; pack_corpus.py packs them (past 4 KB of edits left out).
Why: a second campaign's queue mostly repeats what the corpus already covers (session 52:
the hf target's 951 entries, 97 of them with anything new). Tuples a target reaches on some
runs only (AFL's "stability" below 100%) count as new too, so a run over its own output may
still keep a few.
Usage (repository root, after `cd fuzz && cargo afl build --release`):
    python3 fuzz/add_queue.py TARGET /tmp/afl-TARGET/default/queue
"""
import glob, os, shutil, subprocess, sys, tempfile

from corpus_inputs import queue_entries

target, queue = sys.argv[1], sys.argv[2]
corpus = f'fuzz/corpus/{target}'
work = tempfile.mkdtemp(prefix=f'dv2-add-{target}-')
inputs, maps, keep = (os.path.join(work, d) for d in ('inputs', 'maps', 'keep'))
for d in (inputs, keep):
    os.makedirs(d)

# The corpus' queue as whole inputs; none before a target's first campaign, whose queue is
# then covered against its seeds alone.
patches = f'{corpus}/queue.patches'
packed = open(patches, 'rb').read() if os.path.exists(patches) else b''
n_old = 0
for n_old, data in enumerate(queue_entries(corpus), 1):
    open(f'{inputs}/old-{n_old - 1:06d}', 'wb').write(data)
for f in glob.glob(f'{corpus}/seed-*'):
    shutil.copy(f, f'{inputs}/old-{os.path.basename(f)}')
new = sorted(glob.glob(f'{queue}/id:*'))
for i, f in enumerate(new):
    shutil.copy(f, f'{inputs}/new-{i:06d}')

env = dict(os.environ, AFL_SKIP_CPUFREQ='1', DV2_THREADS='1')
subprocess.run(['cargo', 'afl', 'showmap', '-q', '-i', inputs, '-o', maps, '-t', '5000', '--',
                f'target/release/{target}'], cwd='fuzz', env=env, check=True)

def tuples(f):
    return {line.strip() for line in open(os.path.join(maps, f)) if line.strip()}

old = set().union(*(tuples(f) for f in os.listdir(maps) if f.startswith('old-')))
gains = {f: tuples(f) - old for f in os.listdir(maps) if f.startswith('new-')}
covered, kept = set(), []
while True:
    best = max(gains, key=lambda f: len(gains[f] - covered), default=None)
    if best is None or not gains[best] - covered:
        break
    kept.append(best)
    covered |= gains.pop(best)
for f in kept:
    shutil.copy(f'{inputs}/{f}', f'{keep}/id:{f}')
print(f'{target}: {n_old} corpus entries, {len(new)} new, {len(kept)} kept for {len(covered)} new tuples')

# pack_corpus.py writes queue.patches from a queue alone: pack the kept ones, then append.
subprocess.run([sys.executable, 'fuzz/pack_corpus.py', target, keep], check=True)
added = open(patches, 'rb').read()
open(patches, 'wb').write(packed + added)
shutil.rmtree(work)
