//! Model architecture: the hyper-parameters a backend needs, their invariants, and the presets.

use crate::error::{Error, Result};

/// How a layer's attention projections are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Separate q, k, v, o, gate, up, down (Llama, Mistral, Qwen2/2.5).
    LlamaSwiglu,
    /// One fused `wqkv` in InternLM2's grouped packing, then o, gate, up, down.
    /// See [`crate::model::internlm_wqkv_rows`] for the packing.
    InternlmGqa,
}

/// The shape and numerics of a llama-style decoder.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ArchSpec {
    pub family: Family,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_q_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    /// KV capacity in tokens: positions 0..max_seq-1 exist.
    pub max_seq: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// q/k/v projections carry a bias (Qwen2/2.5).
    pub qkv_bias: bool,
    /// lm_head shares the embedding matrix.
    pub tied_embed: bool,
}

/// NF4 blocks run along K in groups of this many elements.
pub const NF4_GROUP: usize = crate::nf4::BLOCK;

impl ArchSpec {
    /// Rows of the q, k and v projections together.
    pub fn qkv_rows(&self) -> usize {
        (self.n_q_heads + 2 * self.n_kv_heads) * self.head_dim
    }

    /// Width of q and of the attention's output (all q heads): `hidden` in most models; not in
    /// those whose heads are set apart from it (Mistral Nemo: 32 heads of 128 over hidden 5,120).
    pub fn q_dim(&self) -> usize {
        self.n_q_heads * self.head_dim
    }

    /// Width of one KV row (all KV heads of one position).
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Checks every invariant the backends rely on; the error names the first broken one.
    pub fn validate(&self) -> Result<()> {
        let fail = |what: String| Err(Error::InvalidSpec(what));
        let positive = [
            ("n_layers", self.n_layers),
            ("hidden", self.hidden),
            ("n_q_heads", self.n_q_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate", self.intermediate),
            ("vocab", self.vocab),
            ("max_seq", self.max_seq),
        ];
        for (name, value) in positive {
            if value == 0 {
                return fail(format!("{name} must be > 0"));
            }
        }
        // Bounds far past any llama-style model (Llama 3.1 405B: 126 layers, hidden 16,384,
        // intermediate 53,248, vocab 128,256), checked before anything is sized by them: a
        // count read from a file must not size an allocation that aborts the host.
        let bounded = [
            ("n_layers", self.n_layers, 1 << 12),
            ("hidden", self.hidden, 1 << 17),
            ("n_q_heads", self.n_q_heads, 1 << 12),
            ("n_kv_heads", self.n_kv_heads, 1 << 12),
            ("head_dim", self.head_dim, 1 << 12),
            ("intermediate", self.intermediate, 1 << 20),
            ("vocab", self.vocab, 1 << 23),
        ];
        for (name, value, max) in bounded {
            if value > max {
                return fail(format!(
                    "{name} ({value}) is past the largest taken ({max})"
                ));
            }
        }
        if !self.n_q_heads.is_multiple_of(self.n_kv_heads) {
            return fail(format!(
                "n_q_heads ({}) is not a multiple of n_kv_heads ({})",
                self.n_q_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return fail(format!(
                "head_dim ({}) must be even for RoPE",
                self.head_dim
            ));
        }
        if !self.hidden.is_multiple_of(NF4_GROUP) {
            return fail(format!(
                "hidden ({}) is not a multiple of {NF4_GROUP}",
                self.hidden
            ));
        }
        if !self.intermediate.is_multiple_of(NF4_GROUP) {
            return fail(format!(
                "intermediate ({}) is not a multiple of {NF4_GROUP}",
                self.intermediate
            ));
        }
        if !self.q_dim().is_multiple_of(NF4_GROUP) {
            return fail(format!(
                "n_q_heads ({}) * head_dim ({}) is not a multiple of {NF4_GROUP}",
                self.n_q_heads, self.head_dim
            ));
        }
        if self.vocab > i32::MAX as usize {
            return fail(format!(
                "vocab ({}) does not fit int32 token ids",
                self.vocab
            ));
        }
        if self.max_seq > i32::MAX as usize {
            return fail(format!("max_seq ({}) does not fit int32", self.max_seq));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return fail(format!("rms_eps ({}) must be finite and > 0", self.rms_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return fail(format!(
                "rope_theta ({}) must be finite and > 1",
                self.rope_theta
            ));
        }
        if self.family == Family::InternlmGqa && self.qkv_bias {
            return fail("internlm_gqa with qkv_bias is not supported".into());
        }
        if self.family == Family::InternlmGqa && self.hidden != self.q_dim() {
            return fail(format!(
                "internlm_gqa with hidden ({}) != n_q_heads ({}) * head_dim ({})",
                self.hidden, self.n_q_heads, self.head_dim
            ));
        }
        Ok(())
    }
}

/// Seed spec §2 correctness shape: 2 layers, hidden 64, 4/2/16 heads.
pub const TINY_LLAMA: ArchSpec = ArchSpec {
    family: Family::LlamaSwiglu,
    n_layers: 2,
    hidden: 64,
    n_q_heads: 4,
    n_kv_heads: 2,
    head_dim: 16,
    intermediate: 128,
    vocab: 32,
    max_seq: 16,
    rms_eps: 1e-5,
    rope_theta: 10000.0,
    qkv_bias: false,
    tied_embed: false,
};

/// TINY_LLAMA's shape with InternLM2's fused wqkv.
pub const TINY_INTERNLM: ArchSpec = ArchSpec {
    family: Family::InternlmGqa,
    ..TINY_LLAMA
};

/// Seed spec §2 timing toy: 4 layers, hidden 512, 8/2/64 heads.
pub const MEDIUM_LLAMA: ArchSpec = ArchSpec {
    family: Family::LlamaSwiglu,
    n_layers: 4,
    hidden: 512,
    n_q_heads: 8,
    n_kv_heads: 2,
    head_dim: 64,
    intermediate: 1024,
    vocab: 128,
    max_seq: 32,
    rms_eps: 1e-5,
    rope_theta: 10000.0,
    qkv_bias: false,
    tied_embed: false,
};

/// The Qwen2.5-3B shape (synthetic weights; for timing and large-shape gates).
pub const QWEN25_3B: ArchSpec = ArchSpec {
    family: Family::LlamaSwiglu,
    n_layers: 36,
    hidden: 2048,
    n_q_heads: 16,
    n_kv_heads: 2,
    head_dim: 128,
    intermediate: 11008,
    vocab: 151936,
    max_seq: 2048,
    rms_eps: 1e-6,
    rope_theta: 1_000_000.0,
    qkv_bias: true,
    tied_embed: true,
};

/// The Qwen2.5-32B shape (synthetic weights; the large-model timing shape): down's K =
/// 27,648 is past GEMV v2's limit, lm_head is untied. 18.4 GB of NF4.
pub const QWEN25_32B: ArchSpec = ArchSpec {
    family: Family::LlamaSwiglu,
    n_layers: 64,
    hidden: 5120,
    n_q_heads: 40,
    n_kv_heads: 8,
    head_dim: 128,
    intermediate: 27648,
    vocab: 152064,
    max_seq: 2048,
    rms_eps: 1e-6,
    rope_theta: 1_000_000.0,
    qkv_bias: true,
    tied_embed: false,
};

/// Every preset by the name the C ABI and the examples use.
pub const PRESETS: [(&str, ArchSpec); 5] = [
    ("tiny_llama", TINY_LLAMA),
    ("tiny_internlm", TINY_INTERNLM),
    ("medium_llama", MEDIUM_LLAMA),
    ("qwen25_3b", QWEN25_3B),
    ("qwen25_32b", QWEN25_32B),
];

/// Looks a preset up by name (case-insensitive).
pub fn preset(name: &str) -> Result<ArchSpec> {
    PRESETS
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, spec)| *spec)
        .ok_or_else(|| {
            let known: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
            Error::UnknownPreset(format!("'{name}' (known: {})", known.join(", ")))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid() {
        for (name, spec) in PRESETS {
            spec.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn each_broken_invariant_is_named() {
        type Breaker = fn(&mut ArchSpec);
        let cases: [(Breaker, &str); 8] = [
            (|s| s.hidden = 65, "hidden (65) is not a multiple of 64"),
            (
                |s| s.head_dim = 8,
                "n_q_heads (4) * head_dim (8) is not a multiple of 64",
            ),
            (
                |s| {
                    s.family = Family::InternlmGqa;
                    s.hidden = 128
                },
                "internlm_gqa with hidden (128) != n_q_heads (4) * head_dim (16)",
            ),
            (|s| s.n_kv_heads = 3, "not a multiple of n_kv_heads"),
            (|s| s.intermediate = 100, "intermediate (100)"),
            (|s| s.vocab = 0, "vocab must be > 0"),
            (|s| s.rms_eps = f32::NAN, "rms_eps"),
            (|s| s.rope_theta = 0.5, "rope_theta"),
        ];
        for (breaker, expected) in cases {
            let mut spec = TINY_LLAMA;
            breaker(&mut spec);
            let err = spec.validate().unwrap_err().to_string();
            assert!(
                err.contains(expected),
                "{err:?} should mention {expected:?}"
            );
        }
    }

    #[test]
    fn unknown_preset_lists_the_known_ones() {
        let err = preset("nope").unwrap_err().to_string();
        assert!(
            err.contains("tiny_llama") && err.contains("'nope'"),
            "{err}"
        );
        assert_eq!(preset("TINY_LLAMA").unwrap(), TINY_LLAMA);
    }
}
