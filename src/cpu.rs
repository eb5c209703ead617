//! The CPU backend: the oracle's math with an f32 KV cache and the device-state semantics of
//! the GPU backend (token, position, valid_len, next_token, finished). It is the reference
//! every other backend is compared with through the same engine API.

use std::sync::Arc;

use crate::backend::Backend;
use crate::error::Result;
use crate::model::HostModel;
use crate::oracle::{argmax, forward_chunk, forward_chunk_rows, KvCache, FORWARD_CHUNK};
use crate::rope::RopeTable;
use crate::sampling::{LogitBias, Sampling};
use crate::state::{file_order, StateReader, StateWriter, ValueType};

pub struct CpuBackend {
    model: Arc<HostModel>,
    rope: RopeTable,
    kv: KvCache,
    eos: Option<u32>,
    token: u32,
    position: usize,
    /// KV prefix length attention reads; always `position` after a forward.
    valid_len: usize,
    next_token: u32,
    finished: bool,
    logits: Vec<f32>,
    /// The first position since the engine last asked whose logits were not all finite.
    non_finite: Option<usize>,
    sampling: Sampling,
    bias: LogitBias,
    /// The request's ids so far, prompt included (the penalties' window).
    history: Vec<u32>,
}

impl CpuBackend {
    pub fn new(model: Arc<HostModel>, max_seq: usize, eos: Option<u32>) -> Result<Self> {
        let s = model.spec;
        // The KV cache first: it is the larger allocation, so an impossible max_seq is refused
        // before the RoPE table spends minutes filling a smaller one that fits.
        let kv = KvCache::new(&s, max_seq)?;
        Ok(Self {
            rope: RopeTable::for_model(&model, max_seq)?,
            kv,
            model,
            eos,
            token: 0,
            position: 0,
            valid_len: 0,
            next_token: 0,
            finished: false,
            logits: vec![0.0; s.vocab],
            non_finite: None,
            sampling: Sampling::default(),
            bias: LogitBias::default(),
            history: Vec::new(),
        })
    }

    /// Feeds `ids` from `position`, writes their KV slots, advances position and valid_len,
    /// keeps the last one's logits; with `choose`, picks next_token (greedy or sampled, for the
    /// slot after).
    fn forward(&mut self, ids: &[u32], choose: bool) -> Result<()> {
        self.logits = forward_chunk(&self.model, &self.rope, &mut self.kv, ids, self.position)?;
        self.history.extend_from_slice(ids);
        self.position += ids.len();
        self.valid_len = self.position;
        if self.non_finite.is_none() && !self.logits.iter().all(|v| v.is_finite()) {
            self.non_finite = Some(self.position - 1);
        }
        if choose {
            self.next_token = if self.bias.is_empty() && self.sampling.is_greedy() {
                argmax(&self.logits)
            } else {
                let logits = self.bias.applied(&self.logits);
                self.sampling.choose(&logits, &self.history, self.position)
            };
        }
        Ok(())
    }

    fn is_eos(&self, id: u32) -> bool {
        self.eos == Some(id)
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn rewind(&mut self, position: usize) -> Result<()> {
        // The KV cache is left dirty on purpose: attention reads only slots < valid_len.
        self.position = position;
        self.valid_len = position;
        self.finished = false;
        self.history.truncate(position);
        Ok(())
    }

    fn prefill(&mut self, ids: &[u32]) -> Result<()> {
        let chunks = ids.len().div_ceil(FORWARD_CHUNK);
        for (i, chunk) in ids.chunks(FORWARD_CHUNK).enumerate() {
            self.forward(chunk, i + 1 == chunks)?;
        }
        self.token = self.next_token;
        self.finished = self.is_eos(self.next_token);
        Ok(())
    }

    fn step_n(&mut self, out: &mut [u32]) -> Result<usize> {
        for (i, slot) in out.iter_mut().enumerate() {
            self.forward(&[self.token], true)?;
            self.token = self.next_token;
            self.finished |= self.is_eos(self.next_token);
            *slot = self.next_token;
            if self.finished {
                return Ok(i + 1);
            }
        }
        Ok(out.len())
    }

    fn step_draft(&mut self, draft: &[u32], out: &mut [u32]) -> Result<usize> {
        let fed: Vec<u32> = std::iter::once(self.token)
            .chain(draft.iter().copied())
            .collect();
        let rows = forward_chunk_rows(&self.model, &self.rope, &mut self.kv, &fed, self.position)?;
        let ids: Vec<u32> = rows.iter().map(|logits| argmax(logits)).collect();
        let kept = crate::speculate::kept_rows(draft, &ids, |id| self.is_eos(id));
        out[..kept].copy_from_slice(&ids[..kept]);
        // The KV slots past the last row kept are left as any rewind leaves them.
        if self.non_finite.is_none() {
            let bad = rows[..kept]
                .iter()
                .position(|l| !l.iter().all(|v| v.is_finite()));
            self.non_finite = bad.map(|i| self.position + i);
        }
        self.history.extend_from_slice(&fed[..kept]);
        self.position += kept;
        self.valid_len = self.position;
        self.logits.clone_from(&rows[kept - 1]);
        self.next_token = out[kept - 1];
        self.token = self.next_token;
        self.finished |= self.is_eos(self.next_token);
        Ok(kept)
    }

    fn draft_room(&self) -> usize {
        FORWARD_CHUNK - 1
    }

    fn set_sampling(&mut self, s: &Sampling) -> Result<()> {
        self.sampling = *s;
        Ok(())
    }

    fn set_logit_bias(&mut self, bias: &LogitBias) -> Result<()> {
        self.bias = bias.clone();
        Ok(())
    }

    fn kv_value_type(&self) -> ValueType {
        ValueType::F32
    }

    fn save_state(&mut self, len: usize, file: &mut StateWriter<'_>) -> Result<()> {
        file.write_ids(&self.history[..len])?;
        for (kv, layer) in file_order(self.model.spec.n_layers) {
            file.write_f32s(self.kv.layer_prefix(kv, layer, len))?;
        }
        Ok(())
    }

    fn load_state(&mut self, file: &mut StateReader<'_>) -> Result<()> {
        let n = file.ids().len();
        for (kv, layer) in file_order(self.model.spec.n_layers) {
            file.read_f32s(self.kv.layer_prefix_mut(kv, layer, n))?;
        }
        self.history = file.ids().to_vec();
        self.rewind(n)
    }

    fn take_non_finite(&mut self) -> Option<usize> {
        self.non_finite.take()
    }

    fn next_token(&mut self) -> Result<u32> {
        Ok(self.next_token)
    }

    fn logits(&mut self, out: &mut [f32]) -> Result<()> {
        out.copy_from_slice(&self.logits);
        Ok(())
    }

    fn position(&mut self) -> Result<usize> {
        debug_assert_eq!(self.position, self.valid_len);
        Ok(self.position)
    }

    fn finished(&mut self) -> Result<bool> {
        Ok(self.finished)
    }
}
