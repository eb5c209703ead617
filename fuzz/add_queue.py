"""Appends to fuzz/corpus/<target>/queue.patches the entries of a new AFL++ queue that reach
coverage the corpus lacks: the corpus (its seeds' patched queue) and the new queue go through
afl-showmap, each in processes of its own, and a greedy cover keeps the fewest new entries whose
tuples (edge and hit-count bucket) no old input has; pack_corpus.py packs them (past 4 KB of
edits left out). Why: a second campaign's queue mostly repeats what the corpus already covers
(session 52: the hf target's 951 entries, 97 of them with anything new). Tuples a target
reaches on some runs only (AFL's "stability" below 100%) do not count as new (see
SHOWMAP_RUNS).
Usage (repository root, after `cd fuzz && cargo afl build --release`):
    python3 fuzz/add_queue.py TARGET /tmp/afl-TARGET/default/queue
"""
import glob, os, shutil, subprocess, sys, tempfile

from corpus_inputs import queue_entries, whole_files

target, queue = sys.argv[1], sys.argv[2]
corpus = f'fuzz/corpus/{target}'
work = tempfile.mkdtemp(prefix=f'dv2-add-{target}-')
old_inputs, new_inputs, keep = (os.path.join(work, d) for d in ('old', 'new', 'keep'))
for d in (old_inputs, new_inputs, keep):
    os.makedirs(d)

# The corpus' queue as whole inputs (none before a target's first campaign), its seeds and its
# kept crash inputs: what a new entry must reach beyond.
patches = f'{corpus}/queue.patches'
packed = open(patches, 'rb').read() if os.path.exists(patches) else b''
n_old = 0
for n_old, data in enumerate(queue_entries(corpus), 1):
    open(f'{old_inputs}/{n_old - 1:06d}', 'wb').write(data)
for f in whole_files(corpus):
    shutil.copy(f, old_inputs)
new = sorted(glob.glob(f'{queue}/id:*'))
for i, f in enumerate(new):
    shutil.copy(f, f'{new_inputs}/{i:06d}')

# A target's coverage moves between runs of one input: HashMap's random hashing, and in
# persistent mode a path's one-time setup (a tokenizer's regex compiled on first use) lands on
# whichever input takes that path first. So the old and the new inputs run in separate
# processes, each taking its own first time through every path, SHOWMAP_RUNS times; a tuple is
# new only if a new entry reaches it in every run and no old input in any. Session 83: the
# corpus' own seeds, offered as a queue and run once in one process with the old inputs, kept
# 3 entries for 3,966 "new" tuples.
SHOWMAP_RUNS = 3
env = dict(os.environ, AFL_SKIP_CPUFREQ='1', DV2_THREADS='1')


def showmap(inputs, maps):
    """Each input's tuples (edge and hit-count bucket), by file name."""
    subprocess.run(['cargo', 'afl', 'showmap', '-q', '-i', inputs, '-o', maps, '-t', '5000', '--',
                    f'target/release/{target}'], cwd='fuzz', env=env, check=True)
    return {f: {line.strip() for line in open(os.path.join(maps, f)) if line.strip()}
            for f in os.listdir(maps)}  # none for an input that timed out


runs = [(showmap(old_inputs, f'{work}/old-maps{r}'), showmap(new_inputs, f'{work}/new-maps{r}'))
        for r in range(SHOWMAP_RUNS)]
old = set().union(*(t for old_maps, _ in runs for t in old_maps.values()))
gains = {f: set.intersection(*(new_maps.get(f, set()) for _, new_maps in runs)) - old
         for f in os.listdir(new_inputs)}
covered, kept = set(), []
while True:
    best = max(gains, key=lambda f: len(gains[f] - covered), default=None)
    if best is None or not gains[best] - covered:
        break
    kept.append(best)
    covered |= gains.pop(best)
for f in kept:
    shutil.copy(f'{new_inputs}/{f}', f'{keep}/id:{f}')
print(f'{target}: {n_old} corpus entries, {len(new)} new, {len(kept)} kept for {len(covered)} new tuples')

# pack_corpus.py writes queue.patches from a queue alone: pack the kept ones, then append.
subprocess.run([sys.executable, 'fuzz/pack_corpus.py', target, keep], check=True)
added = open(patches, 'rb').read()
open(patches, 'wb').write(packed + added)
shutil.rmtree(work)
