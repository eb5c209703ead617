"""Packs an AFL++ queue as edits on the corpus seeds: fuzz/corpus/<target>/queue.patches.
Each record: u32 length, then the patch: u8 seed-name length, seed name, u32 edit count, and
per edit u32 offset, u32 bytes removed, u32 bytes inserted, the inserted bytes (offsets into
the seed, ascending). Entries whose patch passes 4 KB are left out."""
import glob, os, struct, sys
def runs(seed, data):
    out=[]; i=0; n=len(data)
    while i<n:
        if data[i]!=seed[i]:
            j=i
            while j<n and (data[j]!=seed[j] or any(data[k]!=seed[k] for k in range(j, min(n,j+8)))):
                j+=1
            out.append((i, j-i, data[i:j])); i=j
        else: i+=1
    return out
def edits(seed, data):
    if len(seed)==len(data): return runs(seed,data)
    p=0; n=min(len(seed),len(data))
    while p<n and seed[p]==data[p]: p+=1
    s=0
    while s<n-p and seed[-1-s]==data[-1-s]: s+=1
    return [(p, len(seed)-p-s, data[p:len(data)-s])]
def encode(name, ed):
    b = bytes([len(name)]) + name.encode() + struct.pack('<I', len(ed))
    for off, rem, ins in ed: b += struct.pack('<III', off, rem, len(ins)) + ins
    return b
def apply(seed, ed):
    out=b''; at=0
    for off, rem, ins in ed: out += seed[at:off] + ins; at = off+rem
    return out + seed[at:]
target, queue = sys.argv[1], sys.argv[2]
seeds={os.path.basename(f): open(f,'rb').read() for f in glob.glob(f'fuzz/corpus/{target}/seed-*')}
out=b''; kept=0; q=sorted(glob.glob(queue + '/id:*'))
for f in q:
    d=open(f,'rb').read()
    name, ed = min(((n, edits(sd, d)) for n, sd in seeds.items()), key=lambda t: sum(12+len(x[2]) for x in t[1]))
    enc = encode(name, ed)
    if len(enc) > 4096: continue
    assert apply(seeds[name], ed) == d
    out += struct.pack('<I', len(enc)) + enc; kept += 1
open(f'fuzz/corpus/{target}/queue.patches','wb').write(out)
print(target, 'kept', kept, 'of', len(q), 'bytes', len(out))
