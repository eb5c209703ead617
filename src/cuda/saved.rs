//! A request's ids and KV slots to and from the host, for [`crate::state`]'s files.

use cudarc::driver::CudaSlice;

use super::budget::kv_stride;
use super::device::driver_error;
use super::step::CudaBackend;
use crate::backend::Backend;
use crate::error::{host_buffer, Result};
use crate::state::{KvValues, SavedState};

impl CudaBackend {
    /// The history's ids at positions 0..len and their keys and values (bf16), each cache
    /// `[layer][slot][kv_dim]` without the slots past `len`.
    pub(super) fn saved_state(&mut self, len: usize) -> Result<SavedState> {
        if len == 0 {
            let none = || KvValues::Bf16(Vec::new());
            let (ids, keys, values) = (Vec::new(), none(), none());
            return Ok(SavedState { ids, keys, values });
        }
        let (layers, kv_dim) = (self.spec.n_layers, self.spec.kv_dim());
        let (per_layer, stride) = (len * kv_dim, kv_stride(self.max_seq) * kv_dim);
        let stream = &self.ops.gpu.stream;
        let copy = |cache: &CudaSlice<u16>| -> Result<Vec<u16>> {
            let mut out = host_buffer::<u16>(layers * per_layer, "saved KV values")?;
            for l in 0..layers {
                let first = l * stride;
                stream
                    .memcpy_dtoh(
                        &cache.slice(first..first + per_layer),
                        &mut out[l * per_layer..(l + 1) * per_layer],
                    )
                    .map_err(driver_error("KV download"))?;
            }
            Ok(out)
        };
        let keys = copy(&self.k_cache)?;
        let values = copy(&self.v_cache)?;
        let mut ids = vec![0i32; len];
        stream
            .memcpy_dtoh(&self.sampler.history.slice(..len), &mut ids)
            .map_err(driver_error("history download"))?;
        self.ops.gpu.sync()?;
        Ok(SavedState {
            ids: ids.into_iter().map(|id| id as u32).collect(),
            keys: KvValues::Bf16(keys),
            values: KvValues::Bf16(values),
        })
    }

    /// Uploads `state`'s ids into the history and its keys and values (as bf16) into slots
    /// 0..n of each layer, then rewinds to n.
    pub(super) fn load_saved_state(&mut self, state: &SavedState) -> Result<()> {
        let n = state.ids.len();
        if n > 0 {
            let (layers, kv_dim) = (self.spec.n_layers, self.spec.kv_dim());
            let (per_layer, stride) = (n * kv_dim, kv_stride(self.max_seq) * kv_dim);
            let stream = &self.ops.gpu.stream;
            for (cache, src) in [
                (&mut self.k_cache, state.keys.bf16s()),
                (&mut self.v_cache, state.values.bf16s()),
            ] {
                for l in 0..layers {
                    let first = l * stride;
                    stream
                        .memcpy_htod(
                            &src[l * per_layer..(l + 1) * per_layer],
                            &mut cache.slice_mut(first..first + per_layer),
                        )
                        .map_err(driver_error("KV upload"))?;
                }
            }
            let ids: Vec<i32> = state.ids.iter().map(|&id| id as i32).collect();
            stream
                .memcpy_htod(&ids, &mut self.sampler.history.slice_mut(..n))
                .map_err(driver_error("history upload"))?;
        }
        // rewind synchronizes the stream: the host's copies above are read by then.
        self.rewind(n)
    }
}
