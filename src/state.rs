//! A request's state in a file: the ids at its positions and their KV slots, so that a long
//! prompt (a system prompt, a document, a chat so far) is computed once and loaded back in a
//! later process instead of prefilled again (`dv2_state_save_file`, `dv2_state_load_file`).
//!
//! The file, little-endian: the header ([`HEADER_BYTES`]: magic, version, the KV values' type,
//! the model's fingerprint, layers, KV width, the count of ids n), the n ids (u32), then the
//! keys and the values, each `[layer][position][kv_dim]` for positions 0..n, in the type of
//! the backend that saved them (the CPU's f32, the GPU's bf16). A backend of the other type
//! converts them as it loads (bf16 to f32 exactly, f32 to bf16 rounded to nearest even, as the
//! GPU rounds the keys and values it computes).
//!
//! The fingerprint ([`fingerprint`]) hashes the model's shape and a sample of its weights, so
//! that a state is refused by any other model: keys and values from other weights would decode
//! nonsense without an error.

use std::borrow::Cow;
use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};

use crate::arch::ArchSpec;
use crate::error::{host_capacity, Error, Result};
use crate::model::{HostModel, QkvWeights};

const MAGIC: &[u8; 8] = b"DV2STATE";
const VERSION: u32 = 1;
/// magic, version, value type, fingerprint, layers, KV width, count of ids.
pub const HEADER_BYTES: usize = 8 + 4 + 4 + 8 + 4 + 4 + 8;

/// KV values of `[layer][position][kv_dim]`, in the type the backend keeps them in.
#[derive(Clone, Debug, PartialEq)]
pub enum KvValues {
    F32(Vec<f32>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
}

impl KvValues {
    fn type_code(&self) -> u32 {
        match self {
            KvValues::F32(_) => 0,
            KvValues::Bf16(_) => 1,
        }
    }

    /// How many values.
    pub fn count(&self) -> usize {
        match self {
            KvValues::F32(v) => v.len(),
            KvValues::Bf16(v) => v.len(),
        }
    }

    /// The values as f32 (bf16 widens exactly).
    pub fn f32s(&self) -> Cow<'_, [f32]> {
        match self {
            KvValues::F32(v) => Cow::Borrowed(v),
            KvValues::Bf16(v) => v
                .iter()
                .map(|&b| f32::from_bits((b as u32) << 16))
                .collect(),
        }
    }

    /// The values as bf16 bit patterns (f32 rounds to nearest even, as the GPU's kernels do).
    pub fn bf16s(&self) -> Cow<'_, [u16]> {
        match self {
            KvValues::F32(v) => v
                .iter()
                .map(|&f| half::bf16::from_f32(f).to_bits())
                .collect(),
            KvValues::Bf16(v) => Cow::Borrowed(v),
        }
    }
}

/// The ids at positions 0..n of a request and their keys and values.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedState {
    pub ids: Vec<u32>,
    pub keys: KvValues,
    pub values: KvValues,
}

/// FNV-1a, 64 bits: a hash of a few hundred KiB with no dependency; it tells models apart, it
/// guards against no adversary.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// Bytes of each matrix's codes the fingerprint reads: enough to tell fine-tunes and seeds
/// apart, little enough that a 32B model's load does not notice it.
const SAMPLED_CODES: usize = 4096;

/// A hash of everything a state's KV values depend on, sampled: the shape (not the KV
/// capacity), the RoPE scaling, every norm weight, the first codes and scales of the embedding
/// and of each layer's q/k/v.
pub fn fingerprint(model: &HostModel) -> u64 {
    let s = &model.spec;
    let mut h = Fnv::new();
    let shape = ArchSpec { max_seq: 0, ..*s };
    h.bytes(format!("{shape:?} {:?}", model.rope_scaling).as_bytes());
    let matrix = |h: &mut Fnv, m: &crate::nf4::Nf4Matrix| {
        h.bytes(&m.packed[..m.packed.len().min(SAMPLED_CODES)]);
        for scale in m.absmax.iter().take(SAMPLED_CODES / 32) {
            h.bytes(&scale.to_bits().to_le_bytes());
        }
    };
    matrix(&mut h, &model.embed);
    let norm = |h: &mut Fnv, w: &[half::bf16]| {
        for v in w {
            h.bytes(&v.to_bits().to_le_bytes());
        }
    };
    for layer in &model.layers {
        norm(&mut h, &layer.attn_norm);
        norm(&mut h, &layer.ffn_norm);
        match &layer.qkv {
            QkvWeights::Separate { q, k, v } => {
                for l in [q, k, v] {
                    matrix(&mut h, &l.weight);
                }
            }
            QkvWeights::InternlmFused { wqkv } => matrix(&mut h, wqkv),
        }
    }
    norm(&mut h, &model.final_norm);
    h.0
}

/// What a state file must match to load into an engine.
pub struct Expected<'a> {
    pub spec: &'a ArchSpec,
    pub fingerprint: u64,
    /// The engine's KV capacity.
    pub max_seq: usize,
}

/// Writes `state` to `path` through a temporary file beside it, renamed over `path` once
/// complete: a failed or interrupted save leaves any earlier file at `path` whole.
pub fn write(path: &Path, state: &SavedState, spec: &ArchSpec, fingerprint: u64) -> Result<()> {
    let n = state.ids.len();
    let len = spec.n_layers * n * spec.kv_dim();
    if (state.keys.count(), state.values.count()) != (len, len)
        || state.keys.type_code() != state.values.type_code()
    {
        return Err(Error::Internal(format!(
            "a backend saved {} keys and {} values of types {} and {} for {n} positions \
             ({len} each, of one type)",
            state.keys.count(),
            state.values.count(),
            state.keys.type_code(),
            state.values.type_code()
        )));
    }
    let io = |what: &str, e: std::io::Error| Error::Io(format!("{what} {}: {e}", path.display()));
    let partial = partial_path(path);
    let body = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&partial)?;
        let mut header = Vec::with_capacity(HEADER_BYTES);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&state.keys.type_code().to_le_bytes());
        header.extend_from_slice(&fingerprint.to_le_bytes());
        header.extend_from_slice(&(spec.n_layers as u32).to_le_bytes());
        header.extend_from_slice(&(spec.kv_dim() as u32).to_le_bytes());
        header.extend_from_slice(&(n as u64).to_le_bytes());
        file.write_all(&header)?;
        write_le(&mut file, &state.ids)?;
        for kv in [&state.keys, &state.values] {
            match kv {
                KvValues::F32(v) => write_le(&mut file, v)?,
                KvValues::Bf16(v) => write_le(&mut file, v)?,
            }
        }
        file.sync_all()
    };
    if let Err(e) = body() {
        let _ = std::fs::remove_file(&partial);
        return Err(io("cannot write the state file", e));
    }
    std::fs::rename(&partial, path).map_err(|e| {
        let _ = std::fs::remove_file(&partial);
        io("cannot move the written state into place at", e)
    })
}

/// `path` with `.partial-<pid>` added to its name: where [`write`] writes before the rename.
fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".partial-{}", std::process::id()));
    path.with_file_name(name)
}

/// Reads a state file and checks it against `expected` before it allocates for its values:
/// the magic and version, the model (fingerprint, layers, KV width), the count of ids against
/// the engine's capacity and against the file's length, every id against the vocabulary.
pub fn read(path: &Path, expected: &Expected) -> Result<SavedState> {
    let file = std::fs::File::open(path).map_err(|e| {
        Error::Io(format!(
            "cannot open the state file {}: {e}",
            path.display()
        ))
    })?;
    let file_len = file
        .metadata()
        .map_err(|e| Error::Io(format!("cannot stat {}: {e}", path.display())))?
        .len();
    let bad = |why: String| Error::StateFile(format!("{}: {why}", path.display()));
    let mut r = BufReader::new(file);
    let mut header = [0u8; HEADER_BYTES];
    r.read_exact(&mut header).map_err(|_| {
        bad(format!(
            "{file_len} bytes, shorter than a state file's {HEADER_BYTES}-byte header"
        ))
    })?;
    if &header[..8] != MAGIC {
        return Err(bad("not a decodev2 state file (no DV2STATE magic)".into()));
    }
    let u32_at = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().unwrap());
    let (version, type_code, fingerprint) = (u32_at(8), u32_at(12), u64_at(16));
    let (layers, kv_dim, n) = (u32_at(24) as usize, u32_at(28) as usize, u64_at(32));
    if version != VERSION {
        return Err(bad(format!(
            "version {version}; this library reads version {VERSION}"
        )));
    }
    let elem = match type_code {
        0 => 4,
        1 => 2,
        t => return Err(bad(format!("unknown KV value type {t}"))),
    };
    let spec = expected.spec;
    if (layers, kv_dim) != (spec.n_layers, spec.kv_dim()) {
        return Err(bad(format!(
            "saved from a model of {layers} layers and KV width {kv_dim}; this one has {} and {}",
            spec.n_layers,
            spec.kv_dim()
        )));
    }
    if fingerprint != expected.fingerprint {
        return Err(bad(
            "saved from another model (the same shape, other weights or RoPE scaling)".into(),
        ));
    }
    if n > expected.max_seq as u64 {
        return Err(Error::SequenceFull(format!(
            "the state file {} holds {n} positions; this engine's max_seq is {}",
            path.display(),
            expected.max_seq
        )));
    }
    let n = n as usize;
    // n <= max_seq (an int32) and layers x kv_dim are the model's: no product overflows u64.
    let values = (layers * n * kv_dim) as u64;
    let want = HEADER_BYTES as u64 + 4 * n as u64 + 2 * values * elem;
    if file_len != want {
        return Err(bad(format!(
            "{file_len} bytes; {n} positions of this model take {want} (truncated or extended)"
        )));
    }
    let ids: Vec<u32> = read_le(&mut r, n, "a state file's ids", &bad)?;
    if let Some((i, id)) = ids
        .iter()
        .enumerate()
        .find(|(_, id)| **id as usize >= spec.vocab)
    {
        return Err(bad(format!(
            "id {id} at position {i} is outside the vocabulary ({})",
            spec.vocab
        )));
    }
    let what = "a state file's KV values";
    let mut kv = || -> Result<KvValues> {
        let len = values as usize;
        Ok(if elem == 4 {
            KvValues::F32(read_le(&mut r, len, what, &bad)?)
        } else {
            KvValues::Bf16(read_le(&mut r, len, what, &bad)?)
        })
    };
    let keys = kv()?;
    let values = kv()?;
    Ok(SavedState { ids, keys, values })
}

/// Bytes a state file is read and written in: large enough that the copies run at memory speed.
const IO_CHUNK: usize = 4 << 20;

/// A value of a state file: its little-endian bytes.
trait LittleEndian: Copy {
    const BYTES: usize;
    fn put(self, out: &mut Vec<u8>);
    fn take(bytes: &[u8]) -> Self;
}

macro_rules! little_endian {
    ($($t:ty),*) => {$(
        impl LittleEndian for $t {
            const BYTES: usize = std::mem::size_of::<$t>();
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn take(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().unwrap())
            }
        }
    )*};
}
little_endian!(u16, u32, f32);

/// Writes `values` as little-endian bytes, a chunk at a time.
fn write_le<T: LittleEndian>(w: &mut impl Write, values: &[T]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(IO_CHUNK);
    for chunk in values.chunks(IO_CHUNK / T::BYTES) {
        buf.clear();
        chunk.iter().for_each(|v| v.put(&mut buf));
        w.write_all(&buf)?;
    }
    Ok(())
}

/// Reads `len` little-endian values, a chunk at a time, into a buffer refused as
/// [`host_capacity`] refuses (`what` names it); a short read is `bad`'s error.
fn read_le<T: LittleEndian>(
    r: &mut impl Read,
    len: usize,
    what: &str,
    bad: &impl Fn(String) -> Error,
) -> Result<Vec<T>> {
    let mut out = host_capacity(len, what)?;
    let mut buf = vec![0u8; IO_CHUNK / T::BYTES * T::BYTES];
    while out.len() < len {
        let bytes = &mut buf[..(len - out.len()).min(IO_CHUNK / T::BYTES) * T::BYTES];
        r.read_exact(bytes).map_err(|e| bad(e.to_string()))?;
        out.extend(bytes.chunks_exact(T::BYTES).map(T::take));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ArchSpec {
        crate::arch::preset("tiny_llama").unwrap()
    }

    fn state(spec: &ArchSpec, n: usize) -> SavedState {
        let len = spec.n_layers * n * spec.kv_dim();
        SavedState {
            ids: (0..n as u32).map(|i| i * 7 % spec.vocab as u32).collect(),
            keys: KvValues::F32((0..len).map(|i| i as f32 * 0.25 - 3.0).collect()),
            values: KvValues::F32((0..len).map(|i| (i * 31 % 1000) as f32).collect()),
        }
    }

    #[test]
    fn bf16_widens_exactly_and_f32_rounds_to_nearest_even() {
        let f = KvValues::F32(vec![
            1.0,
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            -0.0,
        ]);
        let b = f.bf16s().into_owned();
        // 1 + 2^-8 is half-way between 1 and 1 + 2^-7: ties go to the even 1.0; 1 + 3 x 2^-8
        // half-way between 1 + 2^-7 and 1 + 2^-6: to the even 1 + 2^-6.
        assert_eq!(b, vec![0x3f80, 0x3f80, 0x3f82, 0x8000]);
        assert_eq!(
            *KvValues::Bf16(b).f32s(),
            [1.0, 1.0, 1.0 + 2f32.powi(-6), -0.0]
        );
    }

    #[test]
    fn a_state_reads_back_as_written_and_other_models_are_refused() {
        let dir = tempfile_dir();
        let path = dir.join("s.dv2state");
        let spec = spec();
        let saved = state(&spec, 5);
        write(&path, &saved, &spec, 42).unwrap();
        let expected = Expected {
            spec: &spec,
            fingerprint: 42,
            max_seq: 5,
        };
        assert_eq!(read(&path, &expected).unwrap(), saved);
        let other = Expected {
            fingerprint: 43,
            ..expected
        };
        let err = read(&path, &other).unwrap_err().to_string();
        assert!(err.contains("another model"), "{err}");
        let small = Expected {
            max_seq: 4,
            ..expected
        };
        assert!(matches!(read(&path, &small), Err(Error::SequenceFull(_))));
        let wider = ArchSpec {
            n_layers: spec.n_layers + 1,
            ..spec
        };
        let err = read(
            &path,
            &Expected {
                spec: &wider,
                ..expected
            },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("layers"), "{err}");
        // Truncated by a byte, extended by one, magic and an id broken: each its own error,
        // and none allocates for the values a corrupt count claims.
        let bytes = std::fs::read(&path).unwrap();
        let cases: [(&str, Vec<u8>); 4] = [
            ("truncated", bytes[..bytes.len() - 1].to_vec()),
            ("truncated", [&bytes[..], &[0]].concat()),
            ("magic", [b"DV2STATX", &bytes[8..]].concat()),
            ("vocabulary", {
                let mut b = bytes.clone();
                b[HEADER_BYTES..HEADER_BYTES + 4].copy_from_slice(&u32::MAX.to_le_bytes());
                b
            }),
        ];
        for (what, b) in cases {
            std::fs::write(&path, b).unwrap();
            let err = read(&path, &expected).unwrap_err();
            assert!(matches!(err, Error::StateFile(_)), "{what}: {err}");
            assert!(err.to_string().contains(what), "{what}: {err}");
        }
        let huge = {
            let mut b = bytes[..HEADER_BYTES].to_vec();
            b[32..40].copy_from_slice(&(i32::MAX as u64).to_le_bytes());
            b
        };
        std::fs::write(&path, huge).unwrap();
        let big = Expected {
            max_seq: i32::MAX as usize,
            ..expected
        };
        let err = read(&path, &big).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_failed_write_keeps_the_earlier_file_whole() {
        let dir = tempfile_dir();
        let path = dir.join("s.dv2state");
        let spec = spec();
        write(&path, &state(&spec, 3), &spec, 1).unwrap();
        let before = std::fs::read(&path).unwrap();
        // A directory where the partial file would go makes the write fail before the rename.
        std::fs::create_dir(partial_path(&path)).unwrap();
        let err = write(&path, &state(&spec, 4), &spec, 1).unwrap_err();
        assert!(matches!(err, Error::Io(_)), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), before);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_fingerprint_tells_seeds_apart_and_ignores_the_capacity() {
        let spec = spec();
        let a = crate::synth::build(&spec, 1).unwrap();
        let b = crate::synth::build(&spec, 2).unwrap();
        assert_ne!(fingerprint(&a), fingerprint(&b));
        let mut wider = a.clone();
        wider.spec.max_seq *= 2;
        assert_eq!(fingerprint(&a), fingerprint(&wider));
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "dv2-state-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
