//! The chunked prefill: a prompt in chunks of up to `chunk` tokens, per layer an RMSNorm, the
//! q/k/v GEMM, RoPE and the KV write, causal attention over the cached prefix and the chunk,
//! the o GEMM with the residual, an RMSNorm, the gate/up GEMM with SwiGLU and the down GEMM
//! with the residual (kernels/gemm.cu, kernels/attention_prefill.cu); logits only for the
//! prompt's last token. `DV2_PREFILL=n1` feeds the prompt one token at a time through the
//! decode step instead.

use cudarc::driver::LaunchConfig;

use super::budget::kv_stride;
use super::ops::{one_cta, Epilogue, GemmMatrix, Ops, PrefillAttnArgs, PrefillSplitRoom, RopeArgs};
use super::step::{Activations, CudaBackend};
use crate::arch::ArchSpec;
use crate::error::{Error, Result};

/// Prompt tokens per prefill chunk when the options leave it open (`DV2_PREFILL_CHUNK`
/// overrides it).
pub const DEFAULT_PREFILL_CHUNK: usize = 1024;

/// The largest chunk the arena may be sized for.
pub const MAX_PREFILL_CHUNK: usize = 1024;

/// The prefill chunk: 0 (the token-at-a-time path) under `DV2_PREFILL=n1` or when no prefill
/// attention kernel takes the model's shape, else `chunk_size` of `requested` and
/// `DV2_PREFILL_CHUNK`.
pub fn prefill_chunk(ops: &Ops, s: &ArchSpec, max_seq: usize, requested: usize) -> Result<usize> {
    if ops.cfg.prefill_by_steps || !ops.attn_prefill_fits(s.n_q_heads / s.n_kv_heads, s.head_dim) {
        return Ok(0);
    }
    chunk_size(requested, ops.cfg.prefill_chunk.as_deref(), max_seq)
}

/// Tokens per chunk: `requested`, or when 0 the environment's value, or the default; 1 to
/// MAX_PREFILL_CHUNK, capped by max_seq.
pub(super) fn chunk_size(requested: usize, env: Option<&str>, max_seq: usize) -> Result<usize> {
    let chunk = match (requested, env) {
        (0, Some(v)) => v
            .parse::<usize>()
            .map_err(|_| Error::InvalidArgument(format!("DV2_PREFILL_CHUNK={v}")))?,
        (0, None) => DEFAULT_PREFILL_CHUNK,
        (n, _) => n,
    };
    if !(1..=MAX_PREFILL_CHUNK).contains(&chunk) {
        return Err(Error::InvalidArgument(format!(
            "prefill chunk {chunk} (1 to {MAX_PREFILL_CHUNK})"
        )));
    }
    Ok(chunk.min(max_seq))
}

impl CudaBackend {
    /// The uploaded prompt of `len` ids, one decode forward per token (`DV2_PREFILL=n1`),
    /// from the state's position.
    pub(super) fn prefill_by_steps(&self, len: usize) -> Result<()> {
        let (state, prompt) = (self.ptr(&self.state), self.ptr(&self.arena.prompt));
        for i in 0..len {
            let i32_i = i as i32;
            launch!(self.ops.gpu, &self.ops.k.load_token, one_cta(1); state, prompt, i32_i)?;
            self.forward(i + 1 == len)?;
            launch!(self.ops.gpu, &self.ops.k.advance, one_cta(1); state)?;
        }
        Ok(())
    }

    /// Prompt ids `start .. start + n` (uploaded) as one chunk at the state's position (`pos`,
    /// as the host knows it): every layer's KV slots written; with `last`, the logits and
    /// next_token of its last token.
    pub(super) fn prefill_chunk(
        &self,
        start: usize,
        pos: usize,
        n: usize,
        last: bool,
    ) -> Result<()> {
        let gpu = &self.ops.gpu;
        let (s, a, ops) = (&self.spec, &self.arena, &self.ops);
        let Activations {
            x,
            xn,
            qkv,
            attn,
            act,
        } = self.activations();
        let state = self.ptr(&self.state);
        let ids = self.ptr(&a.prompt) + 4 * start as u64;
        let (hidden, vocab, n_i) = (s.hidden as i32, s.vocab as i32, n as i32);
        let embed = self.model.embed.as_ref(gpu);
        // The GEMMs' inputs (normed rows, attention output, SwiGLU output) are written as f16
        // by their producers, which the GEMM reads as is (docs/lab.md, c2ba752).
        let rows = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            ..one_cta(256)
        };
        launch!(gpu, &ops.k.embed_rows, rows; ids, embed, x, hidden, vocab)?;
        let layer_bytes = (2 * kv_stride(self.max_seq) * s.kv_dim()) as u64;
        let matrix = |m: &super::weights::DeviceMatrix, bias: u64| GemmMatrix {
            m: m.as_ref(gpu),
            rows: m.rows,
            bias,
        };
        for (l, layer) in self.model.layers.iter().enumerate() {
            let (k_cache, v_cache) = (
                self.ptr(&self.k_cache) + l as u64 * layer_bytes,
                self.ptr(&self.v_cache) + l as u64 * layer_bytes,
            );
            // In the last layer of the prompt's last chunk only the last token's output is
            // used (every token's K and V are in the cache once RoPE ran): attention, o and
            // the FFN run on that one row (`DV2_PREFILL_TAIL=0`: on all of them).
            let first = if last && ops.cfg.prefill_tail && l + 1 == s.n_layers {
                n - 1
            } else {
                0
            };
            let m = n - first;
            let x_m = x + (first * s.hidden * 4) as u64;
            ops.rms_rows(
                x,
                self.ptr(&layer.attn_norm),
                xn,
                s.hidden,
                s.rms_eps,
                n,
                true,
            )?;
            let qkv_mats = [0, 1, 2].map(|i| {
                let bias = layer.qkv_bias[i].as_ref().map_or(0, |b| self.ptr(b));
                matrix(&layer.qkv[i], bias)
            });
            let ld = s.qkv_rows();
            let (cos, sin, ld_i) = (
                self.ptr(&self.rope_cos),
                self.ptr(&self.rope_sin),
                ld as i32,
            );
            let (n_q, n_kv, hd) = (s.n_q_heads as i32, s.n_kv_heads as i32, s.head_dim as i32);
            let rope = RopeArgs {
                k_cache,
                v_cache,
                cos,
                sin,
                state,
                n_q,
                n_kv,
                head_dim: hd,
                col0: 0,
            };
            if !ops.qkv_rope(&qkv_mats, s.hidden, xn, n, qkv, ld, rope)? {
                ops.gemm(
                    Epilogue::Store,
                    &qkv_mats,
                    s.hidden,
                    xn,
                    n,
                    qkv,
                    ld,
                    0,
                    true,
                )?;
                launch!(gpu, &ops.k.rope_kv_rows, rows; qkv, k_cache, v_cache, cos, sin, state, ld_i, n_q, n_kv, hd)?;
            }
            let room = PrefillSplitRoom {
                pos0: pos + first,
                acc_floats: a.part_acc.len(),
                ml_floats: a.part_ml.len(),
            };
            ops.attn_prefill(
                PrefillAttnArgs {
                    qkv: qkv + (first * ld * 4) as u64,
                    k_cache,
                    v_cache,
                    state,
                    out: attn,
                    n: m as i32,
                    ld: ld_i,
                    n_q,
                    n_kv,
                    head_dim: hd,
                    qb: 0,
                    scale: 1.0 / (s.head_dim as f32).sqrt(),
                    out_f16: 1,
                    first: first as i32,
                    splits: 1,
                    part_acc: self.ptr(&a.part_acc),
                    part_ml: self.ptr(&a.part_ml),
                },
                room,
            )?;
            let o = [matrix(&layer.o, 0)];
            ops.gemm(
                Epilogue::Accumulate,
                &o,
                s.q_dim(),
                attn,
                m,
                x_m,
                s.hidden,
                0,
                true,
            )?;
            ops.rms_rows(
                x_m,
                self.ptr(&layer.ffn_norm),
                xn,
                s.hidden,
                s.rms_eps,
                m,
                true,
            )?;
            let gate_up = [matrix(&layer.gate, 0), matrix(&layer.up, 0)];
            let inter = s.intermediate;
            ops.gemm(
                Epilogue::Swiglu,
                &gate_up,
                s.hidden,
                xn,
                m,
                act,
                inter,
                0,
                true,
            )?;
            let down = [matrix(&layer.down, 0)];
            ops.gemm(
                Epilogue::Accumulate,
                &down,
                inter,
                act,
                m,
                x_m,
                s.hidden,
                0,
                true,
            )?;
        }
        if last {
            self.logits_of(x + ((n - 1) * s.hidden * 4) as u64, 0, None, false)?;
        }
        launch!(gpu, &ops.k.advance_by, one_cta(1); state, n_i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_size_takes_the_option_then_the_environment_then_the_default() {
        assert_eq!(chunk_size(32, Some("64"), 2048).unwrap(), 32);
        assert_eq!(chunk_size(0, Some("64"), 2048).unwrap(), 64);
        assert_eq!(chunk_size(0, None, 4096).unwrap(), DEFAULT_PREFILL_CHUNK);
        assert_eq!(chunk_size(0, None, 16).unwrap(), 16, "capped by max_seq");
        for bad in [
            chunk_size(MAX_PREFILL_CHUNK + 1, None, 1 << 20),
            chunk_size(0, Some("0"), 64),
            chunk_size(0, Some("many"), 64),
        ] {
            assert!(matches!(bad, Err(Error::InvalidArgument(_))), "{bad:?}");
        }
    }
}
