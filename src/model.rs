//! The host-side model every backend takes: NF4 linears, bf16 norm weights, f32 biases.

use half::bf16;

use crate::arch::{ArchSpec, Family};
use crate::error::{Error, Result};
use crate::nf4::Nf4Matrix;
use crate::rope::RopeScaling;

/// An NF4 projection `y = W x (+ b)`, `W: [out, in]`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: Nf4Matrix,
    pub bias: Option<Vec<f32>>,
}

/// A layer's q/k/v projections, as the file or generator stored them.
#[derive(Clone, Debug)]
pub enum QkvWeights {
    /// Llama / Mistral / Qwen2: three matrices.
    Separate { q: Linear, k: Linear, v: Linear },
    /// InternLM2: one `wqkv` of `qkv_rows` rows in grouped packing ([`internlm_wqkv_rows`]).
    InternlmFused { wqkv: Nf4Matrix },
}

#[derive(Clone, Debug)]
pub struct Layer {
    pub attn_norm: Vec<bf16>,
    pub qkv: QkvWeights,
    pub o: Nf4Matrix,
    pub ffn_norm: Vec<bf16>,
    pub gate: Nf4Matrix,
    pub up: Nf4Matrix,
    pub down: Nf4Matrix,
}

/// A whole decoder on the host.
#[derive(Clone, Debug)]
pub struct HostModel {
    pub spec: ArchSpec,
    /// `[vocab, hidden]` packed NF4 rows; a step dequantizes only the row it needs.
    pub embed: Nf4Matrix,
    pub layers: Vec<Layer>,
    pub final_norm: Vec<bf16>,
    /// `[vocab, hidden]`; `None` when tied to `embed`.
    pub lm_head: Option<Nf4Matrix>,
    /// How its RoPE frequencies are scaled (Llama 3.1's bands, linear interpolation).
    pub rope_scaling: RopeScaling,
}

impl HostModel {
    /// The model with the codes of every matrix owned ([`crate::nf4::Codes::make_owned`]): what
    /// a backend that keeps the host model past the load holds (the CPU's), so that a model
    /// file changed or truncated later cannot reach it.
    pub fn into_owned(mut self) -> Self {
        let own = |m: &mut Nf4Matrix| m.packed.make_owned();
        own(&mut self.embed);
        if let Some(m) = &mut self.lm_head {
            own(m);
        }
        for layer in &mut self.layers {
            match &mut layer.qkv {
                QkvWeights::Separate { q, k, v } => {
                    for l in [q, k, v] {
                        own(&mut l.weight);
                    }
                }
                QkvWeights::InternlmFused { wqkv } => own(wqkv),
            }
            for m in [
                &mut layer.o,
                &mut layer.gate,
                &mut layer.up,
                &mut layer.down,
            ] {
                own(m);
            }
        }
        self
    }

    /// The output projection (the embedding itself when tied).
    pub fn lm_head(&self) -> &Nf4Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Checks every tensor's shape against the spec; the error names the tensor.
    pub fn validate(&self) -> Result<()> {
        let s = &self.spec;
        s.validate()?;
        self.rope_scaling.divisors(s.head_dim, s.rope_theta)?;
        let mat = |name: String, m: &Nf4Matrix, rows: usize, cols: usize| {
            if m.rows != rows || m.cols != cols {
                return Err(Error::ModelFile(format!(
                    "{name}: shape [{}, {}], expected [{rows}, {cols}]",
                    m.rows, m.cols
                )));
            }
            Ok(())
        };
        let vec_len = |name: String, len: usize, want: usize| {
            if len != want {
                return Err(Error::ModelFile(format!(
                    "{name}: length {len}, expected {want}"
                )));
            }
            Ok(())
        };
        mat("embed".into(), &self.embed, s.vocab, s.hidden)?;
        match (&self.lm_head, s.tied_embed) {
            (Some(head), false) => mat("lm_head".into(), head, s.vocab, s.hidden)?,
            (None, true) => {}
            (Some(_), true) => {
                return Err(Error::ModelFile(
                    "lm_head present but spec says tied".into(),
                ))
            }
            (None, false) => {
                return Err(Error::ModelFile(
                    "lm_head missing and spec says untied".into(),
                ))
            }
        }
        vec_len("final_norm".into(), self.final_norm.len(), s.hidden)?;
        if self.layers.len() != s.n_layers {
            return Err(Error::ModelFile(format!(
                "{} layers, expected {}",
                self.layers.len(),
                s.n_layers
            )));
        }
        let kv = s.kv_dim();
        for (i, l) in self.layers.iter().enumerate() {
            let p = |t: &str| format!("layers.{i}.{t}");
            vec_len(p("attn_norm"), l.attn_norm.len(), s.hidden)?;
            vec_len(p("ffn_norm"), l.ffn_norm.len(), s.hidden)?;
            match (&l.qkv, s.family) {
                (QkvWeights::Separate { q, k, v }, Family::LlamaSwiglu) => {
                    for (name, lin, rows) in [("q", q, s.q_dim()), ("k", k, kv), ("v", v, kv)] {
                        mat(p(name), &lin.weight, rows, s.hidden)?;
                        match (&lin.bias, s.qkv_bias) {
                            (Some(b), true) => vec_len(p(&format!("{name}.bias")), b.len(), rows)?,
                            (None, false) => {}
                            (Some(_), false) => {
                                return Err(Error::ModelFile(format!(
                                    "{}: bias present but spec has none",
                                    p(name)
                                )))
                            }
                            (None, true) => {
                                return Err(Error::ModelFile(format!("{}: bias missing", p(name))))
                            }
                        }
                    }
                }
                (QkvWeights::InternlmFused { wqkv }, Family::InternlmGqa) => {
                    mat(p("wqkv"), wqkv, s.qkv_rows(), s.hidden)?
                }
                _ => {
                    return Err(Error::ModelFile(format!(
                        "{}: q/k/v storage does not match family {:?}",
                        p("attention"),
                        s.family
                    )))
                }
            }
            mat(p("o"), &l.o, s.hidden, s.q_dim())?;
            mat(p("gate"), &l.gate, s.intermediate, s.hidden)?;
            mat(p("up"), &l.up, s.intermediate, s.hidden)?;
            mat(p("down"), &l.down, s.hidden, s.intermediate)?;
        }
        Ok(())
    }
}

/// Rows of InternLM2's fused `wqkv`, listed in `[q heads..., k heads..., v heads...]` order.
///
/// InternLM2 packs `wqkv` per KV group: for each of the `n_kv` groups, `g = n_q / n_kv`
/// query heads, then that group's key head, then its value head, each `head_dim` rows
/// (`rearrange(qkv, "b q (h gs d) -> b q h gs d", gs=2+g)`; q = `[..., :g, :]`,
/// k = `[..., -2, :]`, v = `[..., -1, :]`). Query head `h*g + j` is chunk `j` of group `h`.
///
/// Worked example, n_q = 4, n_kv = 2, head_dim = 16 (g = 2, 128 rows):
/// packed rows `0..16` q0, `16..32` q1, `32..48` k0, `48..64` v0,
/// `64..80` q2, `80..96` q3, `96..112` k1, `112..128` v1;
/// so q = rows 0..32 ++ 64..96, k = 32..48 ++ 96..112, v = 48..64 ++ 112..128.
pub fn internlm_wqkv_rows(spec: &ArchSpec) -> Vec<usize> {
    let (hd, g) = (spec.head_dim, spec.n_q_heads / spec.n_kv_heads);
    let group_rows = (g + 2) * hd;
    let chunk = |h: usize, j: usize| h * group_rows + j * hd..h * group_rows + (j + 1) * hd;
    let q = (0..spec.n_kv_heads).flat_map(|h| (0..g).flat_map(move |j| chunk(h, j)));
    let k = (0..spec.n_kv_heads).flat_map(|h| chunk(h, g));
    let v = (0..spec.n_kv_heads).flat_map(|h| chunk(h, g + 1));
    q.chain(k).chain(v).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::TINY_INTERNLM;

    #[test]
    fn internlm_split_matches_the_worked_example() {
        let rows = internlm_wqkv_rows(&TINY_INTERNLM);
        let want: Vec<usize> = (0..32)
            .chain(64..96)
            .chain(32..48)
            .chain(96..112)
            .chain(48..64)
            .chain(112..128)
            .collect();
        assert_eq!(rows, want);
    }
}
