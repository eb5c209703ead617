//! Writes small GGUF v3 files for the loader tests (F32 tensors only).

#[derive(Clone)]
pub enum Meta {
    U32(u32),
    F32(f32),
    Str(String),
    Bool(bool),
    StrArray(Vec<String>),
    F32Array(Vec<f32>),
    I32Array(Vec<i32>),
}

#[derive(Clone)]
pub struct GgufWriter {
    pub meta: Vec<(String, Meta)>,
    /// (name, ggml dims, data): dims[0] varies fastest.
    pub tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl GgufWriter {
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.meta.len() as u64).to_le_bytes());
        for (k, v) in &self.meta {
            string(&mut out, k);
            match v {
                Meta::U32(x) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                Meta::F32(x) => {
                    out.extend(6u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                Meta::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    string(&mut out, s);
                }
                Meta::Bool(b) => {
                    out.extend(7u32.to_le_bytes());
                    out.push(*b as u8);
                }
                Meta::StrArray(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(8u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    items.iter().for_each(|s| string(&mut out, s));
                }
                Meta::F32Array(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(6u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    items.iter().for_each(|v| out.extend(v.to_le_bytes()));
                }
                Meta::I32Array(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(5u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    items.iter().for_each(|v| out.extend(v.to_le_bytes()));
                }
            }
        }
        let mut offset = 0u64;
        for (name, dims, data) in &self.tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend((*d as u64).to_le_bytes());
            }
            out.extend(0u32.to_le_bytes()); // F32
            out.extend(offset.to_le_bytes());
            offset += (data.len() * 4).next_multiple_of(32) as u64;
        }
        out.resize(out.len().next_multiple_of(32), 0);
        for (_, _, data) in &self.tensors {
            for v in data {
                out.extend(v.to_le_bytes());
            }
            out.resize(out.len().next_multiple_of(32), 0);
        }
        out
    }

    /// A one-layer llama model: hidden 64, 4 q heads / 2 kv heads of 16, intermediate 128,
    /// vocab 32, untied output; weights from a fixed formula (no zeros).
    pub fn tiny_llama() -> Self {
        let value = |seed: usize, i: usize| {
            (((i * 7919 + seed * 104729) % 1000) as f32 / 1000.0 - 0.5) * 0.2
        };
        let t = |name: &str, dims: Vec<usize>, seed: usize| {
            let n = dims.iter().product();
            (
                name.to_string(),
                dims,
                (0..n).map(|i| value(seed, i)).collect::<Vec<f32>>(),
            )
        };
        let ones = |name: &str, n: usize| (name.to_string(), vec![n], vec![1.0f32; n]);
        let meta = vec![
            ("general.architecture".into(), Meta::Str("llama".into())),
            ("llama.block_count".into(), Meta::U32(1)),
            ("llama.context_length".into(), Meta::U32(16)),
            ("llama.embedding_length".into(), Meta::U32(64)),
            ("llama.feed_forward_length".into(), Meta::U32(128)),
            ("llama.attention.head_count".into(), Meta::U32(4)),
            ("llama.attention.head_count_kv".into(), Meta::U32(2)),
            (
                "llama.attention.layer_norm_rms_epsilon".into(),
                Meta::F32(1e-5),
            ),
            ("llama.rope.freq_base".into(), Meta::F32(10000.0)),
        ];
        let tensors = vec![
            t("token_embd.weight", vec![64, 32], 1),
            ones("output_norm.weight", 64),
            t("output.weight", vec![64, 32], 2),
            ones("blk.0.attn_norm.weight", 64),
            t("blk.0.attn_q.weight", vec![64, 64], 3),
            t("blk.0.attn_k.weight", vec![64, 32], 4),
            t("blk.0.attn_v.weight", vec![64, 32], 5),
            t("blk.0.attn_output.weight", vec![64, 64], 6),
            ones("blk.0.ffn_norm.weight", 64),
            t("blk.0.ffn_gate.weight", vec![64, 128], 7),
            t("blk.0.ffn_up.weight", vec![64, 128], 8),
            t("blk.0.ffn_down.weight", vec![128, 64], 9),
        ];
        Self { meta, tensors }
    }

    pub fn set_meta(&mut self, key: &str, v: Meta) {
        match self.meta.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = v,
            None => self.meta.push((key.into(), v)),
        }
    }

    pub fn tensor_mut(&mut self, name: &str) -> &mut (String, Vec<usize>, Vec<f32>) {
        self.tensors
            .iter_mut()
            .find(|t| t.0 == name)
            .expect("tensor")
    }
}

/// GPT-2's byte-level alphabet: the character each byte stands for in a vocabulary's pieces.
pub fn byte_level_chars() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut next = 256;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            }
        })
        .collect()
}
