//! The CUDA backend: decode state, KV cache and activation arena on the device, and the
//! launch sequence of one step. Everything is allocated in `new`; a step allocates nothing,
//! reads nothing back and never synchronises with the host.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

use super::budget::{self, attn_splits, kv_stride};
use super::device::{driver_error, Gpu};
use super::kernels::{Kernels, ATTN_THREADS, GEMV_THREADS, GEMV_WARPS, MAX_HEAD_DIM};
use super::weights::{self, DeviceMatrix, DeviceModel, Nf4Ref};
use crate::arch::ArchSpec;
use crate::engine::Backend;
use crate::error::{Error, Result};
use crate::model::HostModel;
use crate::rope::RopeTable;

/// Indices into the int32 state buffer (kernels/decode.cu `STATE_*`; 0 is the token).
const STATE_POSITION: usize = 1;
const STATE_VALID_LEN: usize = 2;
const STATE_NEXT_TOKEN: usize = 3;
const STATE_FINISHED: usize = 4;
const STATE_LEN: usize = 8;

/// bf16 bit pattern written into the KV guard slots (a NaN no kernel produces).
const KV_POISON: u16 = 0x7fa5;

/// kernels/decode.cu `QkvArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
struct QkvArgs {
    m: [Nf4Ref; 3],
    bias: [u64; 3],
    rows: [i32; 3],
}
// SAFETY: plain old data matching the kernel's struct (pointers as u64, ints as i32).
unsafe impl DeviceRepr for QkvArgs {}

/// kernels/decode.cu `AttnArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
struct AttnArgs {
    qkv: u64,
    k_cache: u64,
    v_cache: u64,
    rope_cos: u64,
    rope_sin: u64,
    state: u64,
    part_acc: u64,
    part_ml: u64,
    n_q: i32,
    n_kv: i32,
    head_dim: i32,
    max_seq: i32,
    n_splits: i32,
    scale: f32,
}
// SAFETY: plain old data matching the kernel's struct.
unsafe impl DeviceRepr for AttnArgs {}

/// Activations and logits, allocated once at load.
struct Arena {
    x: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    act: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    prompt: CudaSlice<i32>,
}

/// Launches `$f` on the backend's stream with the named locals as arguments, in order.
/// Arguments must be locals (they have to outlive the builder).
macro_rules! launch {
    ($self:expr, $f:expr, $cfg:expr; $($arg:ident),* $(,)?) => {{
        let mut builder = $self.gpu.stream.launch_builder($f);
        $( builder.arg(&$arg); )*
        // SAFETY: every launch site passes the argument list its kernel declares (types and
        // order checked against kernels/decode.cu), with device addresses of live buffers
        // sized at load for this model's shapes.
        unsafe { builder.launch($cfg) }.map(|_| ()).map_err(driver_error("kernel launch"))
    }};
}

pub struct CudaBackend {
    gpu: Gpu,
    k: Kernels,
    spec: ArchSpec,
    max_seq: usize,
    eos: i32,
    model: DeviceModel,
    state: CudaSlice<i32>,
    k_cache: CudaSlice<u16>,
    v_cache: CudaSlice<u16>,
    rope_cos: CudaSlice<f32>,
    rope_sin: CudaSlice<f32>,
    arena: Arena,
    n_splits: usize,
}

/// Warps splitting one row's K: `DV2_GEMV_NR` (rows per CTA: 1, 2, 4 or 8) when set, else
/// one warp per row for tall matrices (lm_head, SwiGLU) and more for short ones, so the grid
/// still fills the device.
fn gemv_kparts(rows: usize) -> u32 {
    if let Some(nr) = std::env::var("DV2_GEMV_NR")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    {
        if matches!(nr, 1 | 2 | 4 | 8) {
            return GEMV_WARPS / nr;
        }
    }
    match rows {
        r if r >= 4096 => 1,
        r if r >= 1024 => 2,
        _ => 8,
    }
}

fn gemv_grid(rows: usize, kparts: u32) -> LaunchConfig {
    let rows_per_cta = (GEMV_WARPS / kparts) as usize;
    LaunchConfig {
        grid_dim: (rows.div_ceil(rows_per_cta) as u32, 1, 1),
        block_dim: (GEMV_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn one_cta(threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    pub fn new(host: &HostModel, max_seq: usize, eos: Option<u32>, device: usize) -> Result<Self> {
        let s = host.spec;
        if s.head_dim > MAX_HEAD_DIM || s.head_dim % 2 != 0 {
            return Err(Error::Unsupported(format!(
                "head_dim {} (the CUDA attention kernel takes even head_dim <= {MAX_HEAD_DIM})",
                s.head_dim
            )));
        }
        let gpu = Gpu::open(device)?;
        let (free, total) = gpu.memory()?;
        budget::estimate(host, max_seq).check(free, total)?;
        let k = Kernels::load(&gpu)?;
        let model = weights::upload(&gpu, host)?;
        let rope = RopeTable::new(max_seq, s.head_dim, s.rope_theta);
        let n_splits = attn_splits(max_seq);
        let kv_len = s.n_layers * kv_stride(max_seq) * s.kv_dim();
        // Every slot starts poisoned: the guard slots stay so (checked by kv_guard_intact),
        // and a kernel that read an unwritten slot would turn the logits into NaN.
        let poison = vec![KV_POISON; kv_len];
        let arena = Arena {
            x: gpu.zeros(s.hidden)?,
            xn: gpu.zeros(s.hidden)?,
            qkv: gpu.zeros(s.qkv_rows())?,
            attn: gpu.zeros(s.hidden)?,
            act: gpu.zeros(s.intermediate)?,
            logits: gpu.zeros(s.vocab)?,
            part_acc: gpu.zeros(s.n_q_heads * n_splits * s.head_dim)?,
            part_ml: gpu.zeros(s.n_q_heads * n_splits * 2)?,
            prompt: gpu.zeros(max_seq)?,
        };
        let backend = Self {
            k_cache: gpu.upload(&poison)?,
            v_cache: gpu.upload(&poison)?,
            rope_cos: gpu.upload(&rope.cos)?,
            rope_sin: gpu.upload(&rope.sin)?,
            state: gpu.zeros(STATE_LEN)?,
            arena,
            gpu,
            k,
            spec: s,
            max_seq,
            eos: eos.map_or(-1, |e| e as i32),
            model,
            n_splits,
        };
        backend.gpu.sync()?;
        Ok(backend)
    }

    /// Device name, for logs.
    pub fn device_name(&self) -> String {
        self.gpu.name()
    }

    fn ptr<T>(&self, buf: &CudaSlice<T>) -> u64 {
        self.gpu.ptr(buf)
    }

    fn rms(&self, x: u64, w: &CudaSlice<u16>, out: u64) -> Result<()> {
        let (w, n, eps) = (self.ptr(w), self.spec.hidden as i32, self.spec.rms_eps);
        launch!(self, &self.k.rms_norm, one_cta(512); x, w, out, n, eps)
    }

    /// `y = W x` (`accumulate`: `y += W x`).
    fn gemv(&self, m: &DeviceMatrix, x: u64, y: u64, accumulate: bool) -> Result<()> {
        let kparts = gemv_kparts(m.rows);
        let (mref, bias, rows, cols, kp, acc) = (
            m.as_ref(&self.gpu),
            0u64,
            m.rows as i32,
            m.cols as i32,
            kparts as i32,
            accumulate as i32,
        );
        launch!(self, &self.k.gemv_nf4, gemv_grid(m.rows, kparts); mref, x, y, bias, rows, cols, kp, acc)
    }

    /// One forward pass for the token in the state buffer at its position: KV slot written;
    /// with `logits`, the logits and next_token too.
    fn forward(&self, logits: bool) -> Result<()> {
        let s = &self.spec;
        let a = &self.arena;
        let (x, xn, qkv, attn, act) = (
            self.ptr(&a.x),
            self.ptr(&a.xn),
            self.ptr(&a.qkv),
            self.ptr(&a.attn),
            self.ptr(&a.act),
        );
        let state = self.ptr(&self.state);
        let (hidden, vocab) = (s.hidden as i32, s.vocab as i32);
        let embed = self.model.embed.as_ref(&self.gpu);
        launch!(self, &self.k.embed_row, one_cta(256); state, embed, x, hidden, vocab)?;
        let layer_elems = (kv_stride(self.max_seq) * s.kv_dim()) as u64;
        let qkv_rows = s.qkv_rows();
        let qkv_kparts = gemv_kparts(qkv_rows);
        for (l, layer) in self.model.layers.iter().enumerate() {
            self.rms(x, &layer.attn_norm, xn)?;
            let args = QkvArgs {
                m: [
                    layer.qkv[0].as_ref(&self.gpu),
                    layer.qkv[1].as_ref(&self.gpu),
                    layer.qkv[2].as_ref(&self.gpu),
                ],
                bias: [0, 1, 2].map(|i| layer.qkv_bias[i].as_ref().map_or(0, |b| self.ptr(b))),
                rows: [0, 1, 2].map(|i| layer.qkv[i].rows as i32),
            };
            let kp = qkv_kparts as i32;
            launch!(self, &self.k.gemv_qkv, gemv_grid(qkv_rows, qkv_kparts); args, xn, qkv, hidden, kp)?;
            let attn_args = AttnArgs {
                qkv,
                k_cache: self.ptr(&self.k_cache) + 2 * l as u64 * layer_elems,
                v_cache: self.ptr(&self.v_cache) + 2 * l as u64 * layer_elems,
                rope_cos: self.ptr(&self.rope_cos),
                rope_sin: self.ptr(&self.rope_sin),
                state,
                part_acc: self.ptr(&a.part_acc),
                part_ml: self.ptr(&a.part_ml),
                n_q: s.n_q_heads as i32,
                n_kv: s.n_kv_heads as i32,
                head_dim: s.head_dim as i32,
                max_seq: self.max_seq as i32,
                n_splits: self.n_splits as i32,
                scale: 1.0 / (s.head_dim as f32).sqrt(),
            };
            let cfg = LaunchConfig {
                grid_dim: (s.n_q_heads as u32, self.n_splits as u32, 1),
                block_dim: (ATTN_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(self, &self.k.attn_decode, cfg; attn_args)?;
            let merge = LaunchConfig {
                grid_dim: (s.n_q_heads as u32, 1, 1),
                block_dim: ((s.head_dim as u32).next_multiple_of(32), 1, 1),
                shared_mem_bytes: 0,
            };
            let (pa, pm, hd, ns, ms) = (
                attn_args.part_acc,
                attn_args.part_ml,
                attn_args.head_dim,
                attn_args.n_splits,
                attn_args.max_seq,
            );
            launch!(self, &self.k.attn_merge, merge; pa, pm, state, attn, hd, ns, ms)?;
            self.gemv(&layer.o, attn, x, true)?;
            self.rms(x, &layer.ffn_norm, xn)?;
            let kparts = gemv_kparts(s.intermediate);
            let (g, u, rows, kp) = (
                layer.gate.as_ref(&self.gpu),
                layer.up.as_ref(&self.gpu),
                s.intermediate as i32,
                kparts as i32,
            );
            launch!(self, &self.k.gemv_swiglu, gemv_grid(s.intermediate, kparts); g, u, xn, act, rows, hidden, kp)?;
            self.gemv(&layer.down, act, x, true)?;
        }
        if logits {
            self.rms(x, &self.model.final_norm, xn)?;
            let out = self.ptr(&a.logits);
            self.gemv(self.model.lm_head(), xn, out, false)?;
            launch!(self, &self.k.argmax_logits, one_cta(1024); out, vocab, state)?;
        }
        Ok(())
    }

    fn read_state(&self) -> Result<[i32; STATE_LEN]> {
        let v = self.gpu.download(&self.state, STATE_LEN)?;
        Ok(v.try_into().expect("state length"))
    }

    /// True while every KV guard slot (one past max_seq-1 in each layer) holds its poison:
    /// nothing was ever written past the last valid slot.
    pub fn kv_guard_intact(&self) -> Result<bool> {
        let s = &self.spec;
        let per_layer = kv_stride(self.max_seq) * s.kv_dim();
        for cache in [&self.k_cache, &self.v_cache] {
            let all = self.gpu.download(cache, s.n_layers * per_layer)?;
            for l in 0..s.n_layers {
                let guard = &all[l * per_layer + self.max_seq * s.kv_dim()..(l + 1) * per_layer];
                if guard.iter().any(|v| *v != KV_POISON) {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn reset(&mut self) -> Result<()> {
        // position = valid_len = 0, finished = 0; the KV cache keeps its (dirty) contents.
        let zeros = [0i32; STATE_LEN];
        self.gpu
            .stream
            .memcpy_htod(&zeros, &mut self.state)
            .map_err(driver_error("state reset"))?;
        self.gpu.sync()
    }

    fn prefill(&mut self, ids: &[u32]) -> Result<()> {
        let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        self.gpu
            .stream
            .memcpy_htod(&ids, &mut self.arena.prompt.slice_mut(..ids.len()))
            .map_err(driver_error("prompt upload"))?;
        let (state, prompt) = (self.ptr(&self.state), self.ptr(&self.arena.prompt));
        for i in 0..ids.len() {
            let i32_i = i as i32;
            launch!(self, &self.k.load_token, one_cta(1); state, prompt, i32_i)?;
            self.forward(i + 1 == ids.len())?;
            launch!(self, &self.k.advance, one_cta(1); state)?;
        }
        let eos = self.eos;
        launch!(self, &self.k.finish_prefill, one_cta(1); state, eos)?;
        self.gpu.sync()
    }

    fn step_n(&mut self, out: &mut [u32]) -> Result<usize> {
        let (state, eos) = (self.ptr(&self.state), self.eos);
        for (i, slot) in out.iter_mut().enumerate() {
            self.forward(true)?;
            launch!(self, &self.k.commit_step, one_cta(1); state, eos)?;
            let st = self.read_state()?;
            *slot = st[STATE_NEXT_TOKEN] as u32;
            if st[STATE_FINISHED] != 0 {
                return Ok(i + 1);
            }
        }
        Ok(out.len())
    }

    fn next_token(&mut self) -> Result<u32> {
        Ok(self.read_state()?[STATE_NEXT_TOKEN] as u32)
    }

    fn logits(&mut self, out: &mut [f32]) -> Result<()> {
        let v = self.gpu.download(&self.arena.logits, self.spec.vocab)?;
        out.copy_from_slice(&v);
        Ok(())
    }

    fn position(&mut self) -> Result<usize> {
        let st = self.read_state()?;
        debug_assert_eq!(st[STATE_POSITION], st[STATE_VALID_LEN]);
        Ok(st[STATE_POSITION] as usize)
    }

    fn finished(&mut self) -> Result<bool> {
        Ok(self.read_state()?[STATE_FINISHED] != 0)
    }

    fn kv_guard_intact(&mut self) -> Result<bool> {
        CudaBackend::kv_guard_intact(self)
    }
}
