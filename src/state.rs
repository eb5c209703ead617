//! A request's state in a file: the ids at its positions and their KV slots, so that a long
//! prompt (a system prompt, a document, a chat so far) is computed once and loaded back in a
//! later process instead of prefilled again (`dv2_state_save_file`, `dv2_state_load_file`).
//!
//! The file, little-endian: the header ([`HEADER_BYTES`]: magic, version, the KV values' type,
//! the model's fingerprint, layers, KV width, the count of ids n), the n ids (u32), then the
//! keys and the values, each `[layer][position][kv_dim]` for positions 0..n ([`file_order`]),
//! in the type of the backend that saved them (the CPU's f32, the GPU's bf16). A backend of the
//! other type converts them as it loads (bf16 to f32 exactly, f32 to bf16 rounded to nearest
//! even, as the GPU rounds the keys and values it computes).
//!
//! The values stream between the file and the backend's cache a chunk at a time
//! ([`StateWriter`], [`StateReader`]): a state of any size takes no host buffer of its size,
//! and on the GPU the file's reads overlap the copies to the device.
//!
//! The fingerprint ([`fingerprint`]) hashes the model's shape and a sample of its weights, so
//! that a state is refused by any other model: keys and values from other weights would decode
//! nonsense without an error.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::arch::ArchSpec;
use crate::error::{Error, Result};
use crate::model::{HostModel, QkvWeights};

const MAGIC: &[u8; 8] = b"DV2STATE";
const VERSION: u32 = 1;
/// magic, version, value type, fingerprint, layers, KV width, count of ids.
pub const HEADER_BYTES: usize = 8 + 4 + 4 + 8 + 4 + 4 + 8;

/// The type of a state file's KV values: the type the saving backend keeps them in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    /// The CPU backend's.
    F32,
    /// The GPU's: bf16 bit patterns.
    Bf16,
}

impl ValueType {
    fn code(self) -> u32 {
        match self {
            ValueType::F32 => 0,
            ValueType::Bf16 => 1,
        }
    }

    /// Bytes of one value.
    pub fn bytes(self) -> usize {
        match self {
            ValueType::F32 => 4,
            ValueType::Bf16 => 2,
        }
    }
}

/// Which cache a run of a file's values belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kv {
    Keys,
    Values,
}

/// The file's order of its values, a layer's slots 0..n at a time: every layer's keys, then
/// every layer's values.
pub fn file_order(layers: usize) -> impl Iterator<Item = (Kv, usize)> {
    [Kv::Keys, Kv::Values]
        .into_iter()
        .flat_map(move |kv| (0..layers).map(move |layer| (kv, layer)))
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

/// Bytes a state file's values are converted in: large enough that the copies run at memory
/// speed, small enough to stay in cache.
const IO_CHUNK: usize = 4 << 20;

/// Bytes of the state of `n` positions of `spec`'s model whose values are `value_type`: what
/// [`StateWriter`] writes, a state file's length.
pub fn state_bytes(spec: &ArchSpec, n: usize, value_type: ValueType) -> u64 {
    // n <= max_seq (an int32) and layers x kv_dim are a model's: no product overflows u64.
    HEADER_BYTES as u64 + 4 * n as u64 + (value_count(spec, n) * value_type.bytes()) as u64
}

/// The keys and values of `n` positions of `spec`'s model: the values a state holds.
fn value_count(spec: &ArchSpec, n: usize) -> usize {
    2 * spec.n_layers * n * spec.kv_dim()
}

/// A state being written: [`StateWriter::create`] (a file) or [`StateWriter::in_memory`] (a
/// host's buffer) writes its header, the backend its ids ([`StateWriter::write_ids`]) and then
/// its values in [`file_order`], and [`StateWriter::finish`] completes it.
pub struct StateWriter<'a> {
    sink: Sink<'a>,
    value_type: ValueType,
    n: usize,
    ids_written: bool,
    /// Values still owed.
    left: usize,
}

enum Sink<'a> {
    /// A file written beside `path` and moved over it by `finish`; dropped before that, it
    /// removes what it wrote: a failed or interrupted save leaves any earlier file at `path`
    /// whole.
    File {
        file: File,
        path: PathBuf,
        partial: PathBuf,
        done: bool,
    },
    /// A buffer of exactly the state's bytes, filled from `at`.
    Memory { buf: &'a mut [u8], at: usize },
}

impl StateWriter<'static> {
    /// Starts the state file of `n` positions of the model `spec` (fingerprint `fingerprint`)
    /// whose KV values are `value_type`.
    pub fn create(
        path: &Path,
        spec: &ArchSpec,
        fingerprint: u64,
        value_type: ValueType,
        n: usize,
    ) -> Result<Self> {
        let partial = partial_path(path);
        let file = File::create(&partial).map_err(|e| write_error(path, e))?;
        let sink = Sink::File {
            file,
            path: path.to_path_buf(),
            partial,
            done: false,
        };
        Self::start(sink, spec, fingerprint, value_type, n)
    }
}

impl<'a> StateWriter<'a> {
    /// [`Self::create`] into `buf`, whose length is [`state_bytes`] of the state.
    pub fn in_memory(
        buf: &'a mut [u8],
        spec: &ArchSpec,
        fingerprint: u64,
        value_type: ValueType,
        n: usize,
    ) -> Result<Self> {
        let want = state_bytes(spec, n, value_type);
        if buf.len() as u64 != want {
            return Err(Error::Internal(format!(
                "a state of {want} bytes given a buffer of {}",
                buf.len()
            )));
        }
        Self::start(
            Sink::Memory { buf, at: 0 },
            spec,
            fingerprint,
            value_type,
            n,
        )
    }

    fn start(
        sink: Sink<'a>,
        spec: &ArchSpec,
        fingerprint: u64,
        value_type: ValueType,
        n: usize,
    ) -> Result<Self> {
        let mut w = Self {
            sink,
            value_type,
            n,
            ids_written: false,
            left: value_count(spec, n),
        };
        let mut header = Vec::with_capacity(HEADER_BYTES);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&value_type.code().to_le_bytes());
        header.extend_from_slice(&fingerprint.to_le_bytes());
        header.extend_from_slice(&(spec.n_layers as u32).to_le_bytes());
        header.extend_from_slice(&(spec.kv_dim() as u32).to_le_bytes());
        header.extend_from_slice(&(n as u64).to_le_bytes());
        w.write(&header)?;
        Ok(w)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        match &mut self.sink {
            Sink::File { file, path, .. } => {
                file.write_all(bytes).map_err(|e| write_error(path, e))
            }
            Sink::Memory { buf, at } => {
                let to = buf
                    .get_mut(*at..*at + bytes.len())
                    .ok_or_else(|| Error::Internal("a state wrote past its buffer".into()))?;
                to.copy_from_slice(bytes);
                *at += bytes.len();
                Ok(())
            }
        }
    }

    /// The ids at positions 0..n, first.
    pub fn write_ids(&mut self, ids: &[u32]) -> Result<()> {
        if self.ids_written || ids.len() != self.n {
            return Err(Error::Internal(format!(
                "a backend saved {} ids for a state of {} positions (already saved: {})",
                ids.len(),
                self.n,
                self.ids_written
            )));
        }
        let bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
        self.write(&bytes)?;
        self.ids_written = true;
        Ok(())
    }

    /// Checks that `count` values of `value_type` come next.
    fn owe(&mut self, count: usize, value_type: ValueType) -> Result<()> {
        if !self.ids_written || value_type != self.value_type || count > self.left {
            return Err(Error::Internal(format!(
                "a backend saved {count} values of {value_type:?} where {} of {:?} were \
                 owed (ids saved: {})",
                self.left, self.value_type, self.ids_written
            )));
        }
        self.left -= count;
        Ok(())
    }

    /// The next values, f32 (a state of [`ValueType::F32`]).
    pub fn write_f32s(&mut self, values: &[f32]) -> Result<()> {
        self.owe(values.len(), ValueType::F32)?;
        let mut bytes = Vec::with_capacity(IO_CHUNK.min(4 * values.len()));
        for chunk in values.chunks(IO_CHUNK / 4) {
            bytes.clear();
            bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
            self.write(&bytes)?;
        }
        Ok(())
    }

    /// The next values as their little-endian bf16 bytes (a state of [`ValueType::Bf16`]).
    pub fn write_bf16_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        self.owe(bytes.len() / 2, ValueType::Bf16)?;
        self.write(bytes)
    }

    /// Completes the state once every value is written: a file is flushed to the disk and
    /// moved over its path.
    pub fn finish(mut self) -> Result<()> {
        if !self.ids_written || self.left != 0 {
            return Err(Error::Internal(format!(
                "a state finished with {} values unsaved (ids saved: {})",
                self.left, self.ids_written
            )));
        }
        match &mut self.sink {
            Sink::File {
                file,
                path,
                partial,
                done,
            } => {
                file.sync_all().map_err(|e| write_error(path, e))?;
                std::fs::rename(&*partial, &*path).map_err(|e| {
                    Error::Io(format!(
                        "cannot move the written state into place at {}: {e}",
                        path.display()
                    ))
                })?;
                *done = true;
            }
            Sink::Memory { buf, at } if *at != buf.len() => {
                return Err(Error::Internal(format!(
                    "a state filled {at} of its {} bytes",
                    buf.len()
                )));
            }
            Sink::Memory { .. } => {}
        }
        Ok(())
    }
}

impl Drop for Sink<'_> {
    fn drop(&mut self) {
        if let Sink::File {
            partial,
            done: false,
            ..
        } = self
        {
            let _ = std::fs::remove_file(partial);
        }
    }
}

fn write_error(path: &Path, e: std::io::Error) -> Error {
    Error::Io(format!(
        "cannot write the state file {}: {e}",
        path.display()
    ))
}

/// `path` with `.partial-<pid>` added to its name: where [`StateWriter`] writes before the
/// rename.
fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".partial-{}", std::process::id()));
    path.with_file_name(name)
}

/// A state opened and checked, its ids read ([`StateReader::open`] from a file,
/// [`StateReader::from_bytes`] from memory); its values are read next, in [`file_order`], by
/// the backend they load into.
pub struct StateReader<'a> {
    source: Box<dyn Read + 'a>,
    /// The file's path, or what the bytes are, for messages.
    name: String,
    ids: Vec<u32>,
    value_type: ValueType,
    fingerprint: u64,
    /// Values not yet read.
    left: usize,
    /// File bytes of the values being converted.
    scratch: Vec<u8>,
}

impl StateReader<'static> {
    /// Opens a state file and checks it against `expected` before anything is allocated for
    /// its values: the magic and version, the model (fingerprint, layers, KV width), the count
    /// of ids against the engine's capacity and against the file's length, every id against
    /// the vocabulary.
    pub fn open(path: &Path, expected: &Expected) -> Result<Self> {
        let file = File::open(path).map_err(|e| {
            Error::Io(format!(
                "cannot open the state file {}: {e}",
                path.display()
            ))
        })?;
        let len = file
            .metadata()
            .map_err(|e| Error::Io(format!("cannot stat {}: {e}", path.display())))?
            .len();
        Self::new(Box::new(file), len, path.display().to_string(), expected)
    }
}

impl<'a> StateReader<'a> {
    /// [`Self::open`] on a state's bytes in memory (what [`StateWriter::in_memory`] wrote).
    pub fn from_bytes(bytes: &'a [u8], expected: &Expected) -> Result<Self> {
        let len = bytes.len() as u64;
        Self::new(Box::new(bytes), len, "the state's bytes".into(), expected)
    }

    fn new(
        mut source: Box<dyn Read + 'a>,
        len: u64,
        name: String,
        expected: &Expected,
    ) -> Result<Self> {
        let bad = |why: String| Error::StateFile(format!("{name}: {why}"));
        let mut header = [0u8; HEADER_BYTES];
        source.read_exact(&mut header).map_err(|_| {
            bad(format!(
                "{len} bytes, shorter than a state's {HEADER_BYTES}-byte header"
            ))
        })?;
        if &header[..8] != MAGIC {
            return Err(bad("not a decodev2 state (no DV2STATE magic)".into()));
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
        let value_type = match type_code {
            0 => ValueType::F32,
            1 => ValueType::Bf16,
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
                "{name} holds {n} positions; this engine's max_seq is {}",
                expected.max_seq
            )));
        }
        let n = n as usize;
        let want = state_bytes(spec, n, value_type);
        if len != want {
            return Err(bad(format!(
                "{len} bytes; {n} positions of this model take {want} (truncated or extended)"
            )));
        }
        let mut id_bytes = crate::error::host_buffer::<u8>(4 * n, "a state's ids")?;
        source
            .read_exact(&mut id_bytes)
            .map_err(|e| read_error(&name, e))?;
        let ids: Vec<u32> = id_bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect();
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
        Ok(Self {
            source,
            name,
            ids,
            value_type,
            fingerprint,
            left: value_count(spec, n),
            scratch: Vec::new(),
        })
    }

    /// The ids at positions 0..n.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The fingerprint of the model that saved the state (the one it was opened against).
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The type of the state's values.
    pub fn value_type(&self) -> ValueType {
        self.value_type
    }

    /// Values not yet read.
    pub fn values_left(&self) -> usize {
        self.left
    }

    /// Reads the next `count` values' bytes into `out` (`out` of `count` × the state's value
    /// size) or into the scratch buffer (`out` None).
    fn read_next(&mut self, count: usize, out: Option<&mut [u8]>) -> Result<()> {
        if count > self.left {
            return Err(Error::Internal(format!(
                "a backend asked for {count} values of a state with {} left",
                self.left
            )));
        }
        let bytes = count * self.value_type.bytes();
        let out = match out {
            Some(out) => out,
            None => {
                self.scratch.resize(bytes, 0);
                &mut self.scratch[..]
            }
        };
        self.source
            .read_exact(&mut out[..bytes])
            .map_err(|e| read_error(&self.name, e))?;
        self.left -= count;
        Ok(())
    }

    /// The next `out.len()` values as f32 (bf16 widens exactly).
    pub fn read_f32s(&mut self, out: &mut [f32]) -> Result<()> {
        for chunk in out.chunks_mut(IO_CHUNK / 4) {
            self.read_next(chunk.len(), None)?;
            match self.value_type {
                ValueType::F32 => {
                    for (o, b) in chunk.iter_mut().zip(self.scratch.chunks_exact(4)) {
                        *o = f32::from_le_bytes(b.try_into().unwrap());
                    }
                }
                ValueType::Bf16 => {
                    for (o, b) in chunk.iter_mut().zip(self.scratch.chunks_exact(2)) {
                        *o = f32::from_bits(
                            (u16::from_le_bytes(b.try_into().unwrap()) as u32) << 16,
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// The next `out.len() / 2` values as little-endian bf16 bytes (f32 rounds to nearest
    /// even, as the GPU's kernels round): a bf16 file's bytes are read into `out` as they are.
    pub fn read_bf16_bytes(&mut self, out: &mut [u8]) -> Result<()> {
        match self.value_type {
            ValueType::Bf16 => self.read_next(out.len() / 2, Some(out)),
            ValueType::F32 => {
                for chunk in out.chunks_mut(IO_CHUNK / 2) {
                    self.read_next(chunk.len() / 2, None)?;
                    for (o, b) in chunk.chunks_exact_mut(2).zip(self.scratch.chunks_exact(4)) {
                        let f = f32::from_le_bytes(b.try_into().unwrap());
                        o.copy_from_slice(&half::bf16::from_f32(f).to_bits().to_le_bytes());
                    }
                }
                Ok(())
            }
        }
    }
}

fn read_error(name: &str, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::StateFile(format!("{name}: cut short while it was read"))
    } else {
        Error::Io(format!("cannot read the state file {name}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ArchSpec {
        crate::arch::preset("tiny_llama").unwrap()
    }

    /// Values of a test state: keys then values, each `[layer][position][kv_dim]`.
    fn values(spec: &ArchSpec, n: usize) -> Vec<f32> {
        (0..value_count(spec, n))
            .map(|i| (i % 1000) as f32 * 0.25 - 3.0)
            .collect()
    }

    /// Ids of a test state.
    fn ids(spec: &ArchSpec, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 % spec.vocab as u32).collect()
    }

    /// Writes `n` positions of [`ids`] and [`values`] as f32 to `w`, a layer at a time as a
    /// backend does.
    fn fill(mut w: StateWriter, spec: &ArchSpec, n: usize) {
        w.write_ids(&ids(spec, n)).unwrap();
        for layer in values(spec, n).chunks(n * spec.kv_dim()) {
            w.write_f32s(layer).unwrap();
        }
        w.finish().unwrap();
    }

    fn save(path: &Path, spec: &ArchSpec, fingerprint: u64, n: usize) {
        let w = StateWriter::create(path, spec, fingerprint, ValueType::F32, n).unwrap();
        fill(w, spec, n);
    }

    fn expected(spec: &ArchSpec, fingerprint: u64, max_seq: usize) -> Expected<'_> {
        Expected {
            spec,
            fingerprint,
            max_seq,
        }
    }

    #[test]
    fn bf16_widens_exactly_and_f32_rounds_to_nearest_even() {
        let dir = tempfile_dir();
        let path = dir.join("s.dv2state");
        let spec = ArchSpec {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 2,
            ..spec()
        };
        // 1 + 2^-8 is half-way between 1 and 1 + 2^-7: ties go to the even 1.0; 1 + 3 x 2^-8
        // half-way between 1 + 2^-7 and 1 + 2^-6: to the even 1 + 2^-6.
        let f = [1.0, 1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), -0.0];
        let mut w = StateWriter::create(&path, &spec, 9, ValueType::F32, 1).unwrap();
        w.write_ids(&[3]).unwrap();
        w.write_f32s(&f).unwrap();
        w.finish().unwrap();
        let mut r = StateReader::open(&path, &expected(&spec, 9, 1)).unwrap();
        let mut b = [0u8; 8];
        r.read_bf16_bytes(&mut b).unwrap();
        assert_eq!(r.values_left(), 0);
        let bits: Vec<u16> = b
            .chunks(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(bits, [0x3f80, 0x3f80, 0x3f82, 0x8000]);

        let mut w = StateWriter::create(&path, &spec, 9, ValueType::Bf16, 1).unwrap();
        w.write_ids(&[3]).unwrap();
        w.write_bf16_bytes(&b).unwrap();
        w.finish().unwrap();
        let mut r = StateReader::open(&path, &expected(&spec, 9, 1)).unwrap();
        let mut widened = [0f32; 4];
        r.read_f32s(&mut widened).unwrap();
        assert_eq!(widened, [1.0, 1.0, 1.0 + 2f32.powi(-6), -0.0]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_state_reads_back_as_written_and_other_models_are_refused() {
        let dir = tempfile_dir();
        let path = dir.join("s.dv2state");
        let spec = spec();
        save(&path, &spec, 42, 5);
        let expected = expected(&spec, 42, 5);
        let mut r = StateReader::open(&path, &expected).unwrap();
        assert_eq!(r.ids(), ids(&spec, 5));
        let mut back = vec![0f32; r.values_left()];
        // Read in pieces unlike the writes', as a backend's staging reads them.
        for piece in back.chunks_mut(333) {
            r.read_f32s(piece).unwrap();
        }
        assert_eq!(back, values(&spec, 5));
        assert!(matches!(r.read_f32s(&mut [0.0]), Err(Error::Internal(_))));
        // In memory: the file's bytes, read back the same way; a buffer of another size refused.
        let file_bytes = std::fs::read(&path).unwrap();
        let mut memory = vec![0u8; state_bytes(&spec, 5, ValueType::F32) as usize];
        fill(
            StateWriter::in_memory(&mut memory, &spec, 42, ValueType::F32, 5).unwrap(),
            &spec,
            5,
        );
        assert_eq!(memory, file_bytes);
        let mut r = StateReader::from_bytes(&memory, &expected).unwrap();
        let mut again = vec![0f32; r.values_left()];
        r.read_f32s(&mut again).unwrap();
        assert_eq!(again, back);
        let mut short = vec![0u8; memory.len() - 1];
        let err = StateWriter::in_memory(&mut short, &spec, 42, ValueType::F32, 5).err();
        assert!(matches!(err, Some(Error::Internal(_))));
        let err = StateReader::from_bytes(&memory[..memory.len() - 1], &expected).err();
        assert!(matches!(err, Some(Error::StateFile(_))));
        let other = Expected {
            fingerprint: 43,
            ..expected
        };
        let err = StateReader::open(&path, &other).err().unwrap().to_string();
        assert!(err.contains("another model"), "{err}");
        let small = Expected {
            max_seq: 4,
            ..expected
        };
        assert!(matches!(
            StateReader::open(&path, &small),
            Err(Error::SequenceFull(_))
        ));
        let wider = ArchSpec {
            n_layers: spec.n_layers + 1,
            ..spec
        };
        let err = StateReader::open(
            &path,
            &Expected {
                spec: &wider,
                ..expected
            },
        )
        .err()
        .unwrap()
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
            let err = StateReader::open(&path, &expected).err().unwrap();
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
        let err = StateReader::open(&path, &big).err().unwrap().to_string();
        assert!(err.contains("truncated"), "{err}");
        // A file cut short after it was opened: the read that finds its end says so.
        std::fs::write(&path, &bytes).unwrap();
        let mut r = StateReader::open(&path, &expected).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 8]).unwrap();
        let mut all = vec![0f32; r.values_left()];
        let err = r.read_f32s(&mut all).unwrap_err();
        assert!(err.to_string().contains("cut short"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_failed_or_unfinished_write_keeps_the_earlier_file_whole() {
        let dir = tempfile_dir();
        let path = dir.join("s.dv2state");
        let spec = spec();
        save(&path, &spec, 1, 3);
        let before = std::fs::read(&path).unwrap();
        // Dropped before finish: its partial file is gone, the earlier file as it was.
        let mut w = StateWriter::create(&path, &spec, 1, ValueType::F32, 4).unwrap();
        w.write_ids(&[1, 2, 3, 4]).unwrap();
        w.write_f32s(&[0.5; 10]).unwrap();
        drop(w);
        assert!(!partial_path(&path).exists());
        assert_eq!(std::fs::read(&path).unwrap(), before);
        // Finished short of its values, or written out of order: an internal error, no file.
        let mut w = StateWriter::create(&path, &spec, 1, ValueType::F32, 4).unwrap();
        assert!(matches!(w.write_f32s(&[0.5]), Err(Error::Internal(_))));
        w.write_ids(&[1, 2, 3, 4]).unwrap();
        assert!(matches!(
            w.write_bf16_bytes(&[0, 0]),
            Err(Error::Internal(_))
        ));
        assert!(matches!(w.finish(), Err(Error::Internal(_))));
        assert_eq!(std::fs::read(&path).unwrap(), before);
        // A directory where the partial file would go makes the write fail before the rename.
        std::fs::create_dir(partial_path(&path)).unwrap();
        let err = StateWriter::create(&path, &spec, 1, ValueType::F32, 4)
            .err()
            .unwrap();
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
