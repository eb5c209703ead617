//! GGUF (v2, v3) files: metadata, tensor directory, and the llama-family model they hold,
//! re-quantized to NF4 at load. The file is memory-mapped; no whole-file copy is made.
//!
//! Architectures: `llama`, `mistral`, `internlm2` (llama.cpp's converter permutes the rows
//! of Q and K of these into its interleaved RoPE layout, after splitting InternLM2's fused
//! wqkv; we undo the permutation, since decodev2 uses rotate-half), and `qwen2` (no
//! permutation; q/k/v biases).

use std::collections::HashMap;
use std::path::Path;

use half::bf16;

use super::ggml::GgmlType;
use crate::arch::{ArchSpec, Family};
use crate::error::{Error, Result};
use crate::model::{HostModel, Layer, Linear, QkvWeights};
use crate::nf4::Nf4Matrix;
use crate::rope::{yarn_mscale, RopeScaling};

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

/// One tensor of the directory: ggml dims (`dims[0]` varies fastest), type, byte range in the
/// map of part `part` (0 for an unsplit file).
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    pub start: usize,
    pub len: usize,
    pub part: usize,
}

/// A parsed GGUF file over its memory map, or the parts of a split one (llama.cpp's
/// `gguf-split`: `NAME-00001-of-00003.gguf` and its siblings) over theirs.
pub struct Gguf {
    maps: Vec<memmap2::Mmap>,
    pub version: u32,
    pub meta: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    name: String,
}

/// Bounds-checked little-endian reads; errors say what was being read and where.
struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| {
                Error::ModelFile(format!(
                    "truncated: {what} at byte {} needs {n} bytes, file has {}",
                    self.at,
                    self.buf.len()
                ))
            })?;
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn len(&mut self, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        usize::try_from(n)
            .ok()
            .filter(|n| *n <= self.buf.len())
            .ok_or_else(|| Error::ModelFile(format!("{what}: length {n} is larger than the file")))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.len(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| Error::ModelFile(format!("{what}: not UTF-8")))
    }
    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value> {
        let w = |n: usize, c: &mut Self| -> Result<Vec<u8>> { Ok(c.take(n, key)?.to_vec()) };
        Ok(match ty {
            0 => Value::Int(w(1, self)?[0] as i64),
            1 => Value::Int(w(1, self)?[0] as i8 as i64),
            2 => Value::Int(u16::from_le_bytes(w(2, self)?.try_into().unwrap()) as i64),
            3 => Value::Int(i16::from_le_bytes(w(2, self)?.try_into().unwrap()) as i64),
            4 => Value::Int(self.u32(key)? as i64),
            5 => Value::Int(self.u32(key)? as i32 as i64),
            6 => Value::Float(f32::from_le_bytes(w(4, self)?.try_into().unwrap()) as f64),
            7 => Value::Bool(w(1, self)?[0] != 0),
            8 => Value::Str(self.string(key)?),
            9 if depth == 0 => {
                let elem = self.u32(key)?;
                let n = self.len(key)?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::Int(self.u64(key)? as i64),
            11 => Value::Int(self.u64(key)? as i64),
            12 => Value::Float(f64::from_le_bytes(w(8, self)?.try_into().unwrap())),
            t => {
                return Err(Error::ModelFile(format!(
                    "metadata {key}: unknown value type {t}"
                )))
            }
        })
    }
}

impl Gguf {
    /// Opens a GGUF file; the first part of a split one brings its other parts, which lie
    /// beside it under the names llama.cpp's `gguf-split` gives them.
    pub fn open(path: &Path) -> Result<Self> {
        let name = path.display().to_string();
        let (map, version, meta, mut tensors) = Self::open_part(path, 0)?;
        let mut maps = vec![map];
        let count = |meta: &HashMap<String, Value>, key: &str| match meta.get(key) {
            Some(Value::Int(v)) => Some(*v),
            _ => None,
        };
        let parts = count(&meta, "split.count").unwrap_or(1);
        if parts > 1 {
            let no = count(&meta, "split.no").unwrap_or(0);
            if no != 0 {
                return Err(Error::InvalidArgument(format!(
                    "{name} is part {} of {parts} of a split GGUF: open the first part",
                    no + 1
                )));
            }
            let prefix = name
                .strip_suffix(&format!("-00001-of-{parts:05}.gguf"))
                .ok_or_else(|| {
                    Error::ModelFile(format!(
                        "{name}: split.count is {parts}, but the name does not end in \
                         -00001-of-{parts:05}.gguf, so its other parts cannot be found"
                    ))
                })?;
            for part in 1..parts as usize {
                let path = format!("{prefix}-{:05}-of-{parts:05}.gguf", part + 1);
                let (map, _, part_meta, part_tensors) = Self::open_part(Path::new(&path), part)?;
                if count(&part_meta, "split.no") != Some(part as i64)
                    || count(&part_meta, "split.count") != Some(parts)
                {
                    return Err(Error::ModelFile(format!(
                        "{path}: its split.no / split.count do not say part {} of {parts}",
                        part + 1
                    )));
                }
                for (tensor, info) in part_tensors {
                    if tensors.insert(tensor.clone(), info).is_some() {
                        return Err(Error::ModelFile(format!(
                            "{path}: tensor {tensor} is in two parts"
                        )));
                    }
                }
                maps.push(map);
            }
        }
        if let Some(n) = count(&meta, "split.tensors.count") {
            if n != tensors.len() as i64 {
                return Err(Error::ModelFile(format!(
                    "{name}: split.tensors.count is {n}, the parts hold {}",
                    tensors.len()
                )));
            }
        }
        Ok(Self {
            maps,
            version,
            meta,
            tensors,
            name,
        })
    }

    /// One file's map and its parse, its tensors marked as part `part`.
    #[allow(clippy::type_complexity)]
    fn open_part(
        path: &Path,
        part: usize,
    ) -> Result<(
        memmap2::Mmap,
        u32,
        HashMap<String, Value>,
        HashMap<String, TensorInfo>,
    )> {
        let name = path.display().to_string();
        let file = super::open_regular(path)?;
        // SAFETY: the map is read-only; a file truncated by another process while mapped is
        // outside what any mmap-based loader can guard against (documented in docs/api.md).
        let map =
            unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::Io(format!("{name}: {e}")))?;
        let (version, meta, mut tensors) = Self::parse(&map).map_err(|e| match e {
            Error::ModelFile(m) => Error::ModelFile(format!("{name}: {m}")),
            other => other,
        })?;
        tensors.values_mut().for_each(|t| t.part = part);
        Ok((map, version, meta, tensors))
    }

    #[allow(clippy::type_complexity)]
    fn parse(buf: &[u8]) -> Result<(u32, HashMap<String, Value>, HashMap<String, TensorInfo>)> {
        let mut c = Cursor { buf, at: 0 };
        if c.take(4, "magic")? != b"GGUF" {
            return Err(Error::ModelFile("wrong magic (not a GGUF file)".into()));
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(Error::Unsupported(format!(
                "GGUF version {version} (2 and 3 are read)"
            )));
        }
        let n_tensors = c.len("tensor count")?;
        let n_kv = c.len("metadata count")?;
        let mut meta = HashMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key {i}"))?;
            let ty = c.u32(&key)?;
            let v = c.value(ty, &key, 0)?;
            meta.insert(key, v);
        }
        // A tensor's entry takes at least 32 bytes of the file: the count cannot reserve more.
        let mut infos = Vec::with_capacity(n_tensors.min(buf.len().saturating_sub(c.at) / 32));
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor name {i}"))?;
            let n_dims = c.u32(&name)? as usize;
            if n_dims == 0 || n_dims > 4 {
                return Err(Error::ModelFile(format!(
                    "tensor {name}: {n_dims} dimensions"
                )));
            }
            let dims = (0..n_dims)
                .map(|_| c.len(&name))
                .collect::<Result<Vec<_>>>()?;
            let ty_id = c.u32(&name)?;
            let ty = GgmlType::from_id(ty_id).ok_or_else(|| {
                Error::Unsupported(format!(
                    "tensor {name}: ggml type {ty_id} is not read by decodev2"
                ))
            })?;
            let offset = c.len(&name)?;
            infos.push((name, dims, ty, offset));
        }
        let align = match meta.get("general.alignment") {
            Some(Value::Int(a)) if *a > 0 && (*a as usize).is_power_of_two() => *a as usize,
            None => 32,
            Some(v) => return Err(Error::ModelFile(format!("general.alignment = {v:?}"))),
        };
        let data = c.at.next_multiple_of(align);
        let mut tensors = HashMap::new();
        for (name, dims, ty, offset) in infos {
            let n = dims
                .iter()
                .try_fold(1usize, |a, d| a.checked_mul(*d))
                .ok_or_else(|| Error::ModelFile(format!("tensor {name}: size overflows")))?;
            let len = ty
                .bytes(n)
                .map_err(|e| Error::ModelFile(format!("tensor {name}: {e}")))?;
            let start = data.checked_add(offset).filter(|s| s.checked_add(len).is_some_and(|e| e <= buf.len())).ok_or_else(|| {
                Error::ModelFile(format!("tensor {name}: data [{}, +{len}) lies past the end of the file ({} bytes): truncated", data + offset, buf.len()))
            })?;
            tensors.insert(
                name,
                TensorInfo {
                    dims,
                    ty,
                    start,
                    len,
                    part: 0,
                },
            );
        }
        Ok((version, meta, tensors))
    }

    fn int(&self, key: &str) -> Result<usize> {
        match self.meta.get(key) {
            Some(Value::Int(v)) if *v >= 0 => Ok(*v as usize),
            Some(v) => Err(Error::ModelFile(format!(
                "{}: metadata {key} = {v:?} is not a count",
                self.name
            ))),
            None => Err(Error::ModelFile(format!(
                "{}: metadata {key} is missing",
                self.name
            ))),
        }
    }

    fn float(&self, key: &str) -> Option<f64> {
        match self.meta.get(key) {
            Some(Value::Float(v)) => Some(*v),
            Some(Value::Int(v)) => Some(*v as f64),
            _ => None,
        }
    }

    pub fn str(&self, key: &str) -> Option<&str> {
        match self.meta.get(key) {
            Some(Value::Str(s)) => Some(s),
            _ => None,
        }
    }

    /// The tensor's directory entry, checked to be a `[rows, cols]` matrix (ggml dims
    /// `[cols, rows]`) or, with `rows` = 0, a vector of `cols`.
    fn tensor(&self, name: &str, rows: usize, cols: usize) -> Result<&TensorInfo> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::ModelFile(format!("{}: tensor {name} is missing", self.name)))?;
        let want: Vec<usize> = if rows == 0 {
            vec![cols]
        } else {
            vec![cols, rows]
        };
        let got: Vec<usize> = t
            .dims
            .iter()
            .copied()
            .rev()
            .skip_while(|d| *d == 1)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        if got != want {
            return Err(Error::ModelFile(format!(
                "{}: tensor {name} has dims {:?}, the hyper-parameters say {want:?}",
                self.name, t.dims
            )));
        }
        Ok(t)
    }

    fn bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.maps[t.part][t.start..t.start + t.len]
    }

    /// A vector tensor in f32.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.tensor(name, 0, len)?;
        let mut out = vec![0f32; len];
        t.ty.dequantize(self.bytes(t), &mut out);
        super::finite(&self.name, name, out)
    }

    fn norm(&self, name: &str, len: usize) -> Result<Vec<bf16>> {
        Ok(super::to_bf16(self.vector(name, len)?))
    }

    /// A `[rows, cols]` matrix re-quantized to NF4; `row_of(r)` names the file row that
    /// becomes row r (undoing a permutation).
    fn matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        row_of: impl Fn(usize) -> usize + Sync,
    ) -> Result<Nf4Matrix> {
        let t = self.tensor(name, rows, cols)?;
        let row_bytes =
            t.ty.bytes(cols)
                .map_err(|e| Error::ModelFile(format!("{}: tensor {name}: {e}", self.name)))?;
        let data = self.bytes(t);
        Nf4Matrix::quantize_with(rows, cols, |r, out| {
            let src = row_of(r);
            t.ty.dequantize(&data[src * row_bytes..(src + 1) * row_bytes], out)
        })
        .map_err(|e| Error::ModelFile(format!("{}: tensor {name}: {e}", self.name)))
    }

    /// The model this file holds, with its hyper-parameters from the metadata.
    pub fn model(&self) -> Result<HostModel> {
        self.model_admitted(&|_| Ok(()))
    }

    /// [`Self::model`], with `admit` judging the shape before any weight is read.
    pub fn model_admitted(&self, admit: super::Admit) -> Result<HostModel> {
        let (spec, permuted, rope_scaling) = self.spec()?;
        admit(&spec)?;
        self.weights(spec, permuted, rope_scaling)
    }

    /// The hyper-parameters from the metadata, whether q and k rows are in llama.cpp's
    /// permuted order, and RoPE's scaling.
    fn spec(&self) -> Result<(ArchSpec, bool, RopeScaling)> {
        let arch = self.str("general.architecture").ok_or_else(|| {
            Error::ModelFile(format!("{}: general.architecture is missing", self.name))
        })?;
        let permuted = match arch {
            // llama.cpp's converter splits InternLM2's wqkv into q/k/v and permutes them
            // like llama's.
            "llama" | "mistral" | "internlm2" => true,
            "qwen2" => false,
            other => {
                return Err(Error::Unsupported(format!(
                    "{}: architecture {other} (llama, mistral, internlm2 and qwen2 are read)",
                    self.name
                )))
            }
        };
        let key = |k: &str| format!("{arch}.{k}");
        let hidden = self.int(&key("embedding_length"))?;
        let n_q_heads = self.int(&key("attention.head_count"))?;
        let n_kv_heads = self
            .int(&key("attention.head_count_kv"))
            .unwrap_or(n_q_heads);
        // A head's width is embedding_length / head_count unless the file sets it apart
        // (attention.key_length: Mistral Nemo's heads of 128 over 5,120 / 32).
        let head_dim = self
            .int(&key("attention.key_length"))
            .unwrap_or(hidden.checked_div(n_q_heads).unwrap_or(0));
        if let Ok(len) = self.int(&key("attention.value_length")) {
            if len != head_dim {
                return Err(Error::Unsupported(format!(
                    "{}: value heads of {len} beside key heads of {head_dim}",
                    self.name
                )));
            }
        }
        if let Ok(rot) = self.int(&key("rope.dimension_count")) {
            if rot != head_dim {
                return Err(Error::Unsupported(format!(
                    "{}: partial rotary ({rot} of {head_dim} dims)",
                    self.name
                )));
            }
        }
        // A mixture of experts under the llama architecture (Mixtral) is named here rather than
        // met later as a missing tensor.
        if let Ok(experts @ 1..) = self.int(&key("expert_count")) {
            return Err(Error::Unsupported(format!(
                "{}: a mixture of {experts} experts ({arch}.expert_count)",
                self.name
            )));
        }
        let embed_info = self.tensors.get("token_embd.weight").ok_or_else(|| {
            Error::ModelFile(format!(
                "{}: tensor token_embd.weight is missing",
                self.name
            ))
        })?;
        let vocab = *embed_info.dims.get(1).unwrap_or(&0);
        let has_bias = self.tensors.contains_key("blk.0.attn_q.bias");
        let spec = ArchSpec {
            family: Family::LlamaSwiglu,
            n_layers: self.int(&key("block_count"))?,
            hidden,
            n_q_heads,
            n_kv_heads,
            head_dim,
            intermediate: self.int(&key("feed_forward_length"))?,
            vocab,
            max_seq: self.int(&key("context_length"))?,
            rms_eps: self
                .float(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5) as f32,
            rope_theta: self.float(&key("rope.freq_base")).unwrap_or(10000.0) as f32,
            qkv_bias: has_bias,
            tied_embed: !self.tensors.contains_key("output.weight"),
        };
        let invalid = |e: Error| match e {
            Error::InvalidSpec(m) => Error::Unsupported(format!("{}: {m}", self.name)),
            other => other,
        };
        spec.validate().map_err(invalid)?;
        self.every_tensor_is_read(&spec)?;
        let rope_scaling = self.rope_scaling(arch, head_dim, spec.max_seq)?;
        rope_scaling
            .divisors(head_dim, spec.rope_theta)
            .map_err(invalid)?;
        Ok((spec, permuted, rope_scaling))
    }

    /// Every tensor of the file must be one this reader takes for `spec`: one it would pass over
    /// (an o-projection or FFN bias, a q/k norm, an expert) changes the model's output, so the
    /// file is refused naming it, as llama.cpp refuses tensors its architecture does not create.
    fn every_tensor_is_read(&self, spec: &ArchSpec) -> Result<()> {
        const LAYER: [&str; 9] = [
            "attn_norm.weight",
            "attn_q.weight",
            "attn_k.weight",
            "attn_v.weight",
            "attn_output.weight",
            "ffn_norm.weight",
            "ffn_gate.weight",
            "ffn_up.weight",
            "ffn_down.weight",
        ];
        const QKV_BIAS: [&str; 3] = ["attn_q.bias", "attn_k.bias", "attn_v.bias"];
        let read = |name: &str| match name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((layer, rest)) => {
                layer.parse::<usize>().is_ok_and(|l| l < spec.n_layers)
                    && (LAYER.contains(&rest) || (spec.qkv_bias && QKV_BIAS.contains(&rest)))
            }
            None => {
                matches!(
                    name,
                    "token_embd.weight" | "output_norm.weight" | "rope_freqs.weight"
                ) || (name == "output.weight" && !spec.tied_embed)
            }
        };
        super::refuse_unread(&self.name, self.tensors.keys(), read)
    }

    /// RoPE's scaling as llama.cpp reads it: a linear factor (`rope.scaling.factor`, or the
    /// older `rope.scale_linear`; 0 means none) under the scaling type `linear` or `none` (or
    /// no type), times the per-pair divisors of a `rope_freqs.weight` tensor, which is how
    /// llama.cpp's converter stores Llama 3.1's bands; or YaRN under the type `yarn`.
    fn rope_scaling(&self, arch: &str, head_dim: usize, context: usize) -> Result<RopeScaling> {
        let key = |k: &str| format!("{arch}.{k}");
        let factor = self
            .float(&key("rope.scaling.factor"))
            .or_else(|| self.float(&key("rope.scale_linear")))
            .filter(|f| *f != 0.0)
            .map_or(1.0, |f| f as f32);
        const FREQS: &str = "rope_freqs.weight";
        match self.str(&key("rope.scaling.type")) {
            None | Some("none" | "linear") => {}
            Some("yarn") if self.tensors.contains_key(FREQS) => {
                return Err(Error::Unsupported(format!(
                    "{}: YaRN over the per-pair divisors of {FREQS}",
                    self.name
                )))
            }
            Some("yarn") => return self.yarn(arch, factor, context),
            Some(kind) => {
                return Err(Error::Unsupported(format!(
                "{}: rope scaling {kind} (none, linear and yarn are read, and rope_freqs.weight)",
                self.name
            )))
            }
        }
        Ok(if self.tensors.contains_key(FREQS) {
            let divisors = self.vector(FREQS, head_dim / 2)?;
            RopeScaling::Divisors(divisors.into_iter().map(|d| d * factor).collect())
        } else if factor != 1.0 {
            RopeScaling::Linear { factor }
        } else {
            RopeScaling::None
        })
    }

    /// YaRN as llama.cpp runs it: `factor` over `rope.scaling.original_context_length` (else the
    /// context length), the ramp between `yarn_beta_fast` and `yarn_beta_slow` (32 and 1 unless
    /// set) rounded out to whole pairs, cos and sin scaled by 0.1 ln(factor) + 1. The keys that
    /// change that magnitude or the ramp's weight in llama.cpp (DeepSeek's and others') are
    /// refused by name rather than half read.
    fn yarn(&self, arch: &str, factor: f32, context: usize) -> Result<RopeScaling> {
        let key = |k: &str| format!("{arch}.rope.scaling.{k}");
        for (k, neutral) in [
            ("attn_factor", 1.0),
            ("yarn_attn_factor", 1.0),
            ("yarn_ext_factor", 1.0),
            ("yarn_log_multiplier", 0.0),
        ] {
            if let Some(v) = self.float(&key(k)).filter(|v| *v != neutral) {
                return Err(Error::Unsupported(format!(
                    "{}: YaRN with {} = {v}",
                    self.name,
                    key(k)
                )));
            }
        }
        let original = self.int(&key("original_context_length")).unwrap_or(context);
        Ok(RopeScaling::Yarn {
            factor,
            original_max_position: original as f32,
            beta_fast: self.float(&key("yarn_beta_fast")).unwrap_or(32.0) as f32,
            beta_slow: self.float(&key("yarn_beta_slow")).unwrap_or(1.0) as f32,
            truncate: true,
            attention_factor: yarn_mscale(factor as f64, 1.0) as f32,
        })
    }

    fn weights(
        &self,
        spec: ArchSpec,
        permuted: bool,
        rope_scaling: RopeScaling,
    ) -> Result<HostModel> {
        let (h, kv, inter, head_dim) =
            (spec.hidden, spec.kv_dim(), spec.intermediate, spec.head_dim);
        let identity = |r: usize| r;
        // llama.cpp stores row 2i of a head as HF row i and row 2i+1 as HF row i + hd/2.
        let unpermute = |r: usize| {
            if !permuted {
                return r;
            }
            let (head, j) = (r / head_dim, r % head_dim);
            let half = head_dim / 2;
            head * head_dim + if j < half { 2 * j } else { 2 * (j - half) + 1 }
        };
        let mut layers = Vec::with_capacity(spec.n_layers);
        for i in 0..spec.n_layers {
            let p = |t: &str| format!("blk.{i}.{t}");
            let linear = |t: &str, rows: usize, perm: bool| -> Result<Linear> {
                let weight = if perm {
                    self.matrix(&p(&format!("{t}.weight")), rows, h, unpermute)?
                } else {
                    self.matrix(&p(&format!("{t}.weight")), rows, h, identity)?
                };
                let bias = if spec.qkv_bias {
                    Some(self.vector(&p(&format!("{t}.bias")), rows)?)
                } else {
                    None
                };
                Ok(Linear { weight, bias })
            };
            layers.push(Layer {
                attn_norm: self.norm(&p("attn_norm.weight"), h)?,
                qkv: QkvWeights::Separate {
                    q: linear("attn_q", spec.q_dim(), true)?,
                    k: linear("attn_k", kv, true)?,
                    v: linear("attn_v", kv, false)?,
                },
                o: self.matrix(&p("attn_output.weight"), h, spec.q_dim(), identity)?,
                ffn_norm: self.norm(&p("ffn_norm.weight"), h)?,
                gate: self.matrix(&p("ffn_gate.weight"), inter, h, identity)?,
                up: self.matrix(&p("ffn_up.weight"), inter, h, identity)?,
                down: self.matrix(&p("ffn_down.weight"), h, inter, identity)?,
            });
        }
        let model = HostModel {
            spec,
            embed: self.matrix("token_embd.weight", spec.vocab, h, identity)?,
            layers,
            final_norm: self.norm("output_norm.weight", h)?,
            lm_head: if spec.tied_embed {
                None
            } else {
                Some(self.matrix("output.weight", spec.vocab, h, identity)?)
            },
            rope_scaling,
        };
        model.validate()?;
        Ok(model)
    }

    /// The token strings of the embedded tokenizer (`tokenizer.ggml.tokens`).
    pub fn tokens(&self) -> Vec<String> {
        self.string_array("tokenizer.ggml.tokens")
    }

    /// The BPE merges of the embedded tokenizer (`tokenizer.ggml.merges`), "a b" each.
    pub fn merges(&self) -> Vec<String> {
        self.string_array("tokenizer.ggml.merges")
    }

    fn string_array(&self, key: &str) -> Vec<String> {
        match self.meta.get(key) {
            Some(Value::Array(items)) => items
                .iter()
                .filter_map(|v| {
                    if let Value::Str(s) = v {
                        Some(s.clone())
                    } else {
                        None
                    }
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The tokenizer's EOS id, when the file names one.
    /// Every metadata value as text (arrays as JSON, up to [`super::META_ARRAY_MAX`] items).
    pub fn metadata(&self) -> super::Metadata {
        fn text(v: &Value) -> String {
            match v {
                Value::Int(i) => i.to_string(),
                Value::Float(f) => f.to_string(),
                Value::Bool(b) => b.to_string(),
                Value::Str(s) => s.clone(),
                Value::Array(items) => {
                    let json = |v: &Value| match v {
                        Value::Str(s) => serde_json::Value::String(s.clone()).to_string(),
                        other => text(other),
                    };
                    format!("[{}]", items.iter().map(json).collect::<Vec<_>>().join(","))
                }
            }
        }
        self.meta
            .iter()
            .map(|(k, v)| {
                let value = match v {
                    Value::Array(items) if items.len() > super::META_ARRAY_MAX => Err(items.len()),
                    v => Ok(text(v)),
                };
                (k.clone(), value)
            })
            .collect()
    }

    pub fn eos_id(&self) -> Option<u32> {
        match self.meta.get("tokenizer.ggml.eos_token_id") {
            Some(Value::Int(v)) => u32::try_from(*v).ok(),
            _ => None,
        }
    }
}
