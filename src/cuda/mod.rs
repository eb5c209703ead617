//! The CUDA backend: weights, KV cache, activations and decode state resident on the device.
//!
//! - [`device`]: driver probe, context and stream, allocation helpers.
//! - [`kernels`]: NVRTC compilation of `kernels/*.cu` (cached on disk) and the function table;
//!   `kernel_cache`: that cache, one compile of a unit however many loads miss it at once.
//! - [`ops`]: every kernel launch and its launch shape, by kernel family.
//! - [`weights`]: the model uploaded as packed NF4.
//! - [`budget`]: the VRAM estimate checked before anything is allocated.
//! - [`mod@bench`]: microbenchmarks (streaming-read floor, GEMV shapes, attention).
//! - [`step`]: the backend itself: arena, state, KV, and the launch sequence of one step.
//! - [`prefill`]: the chunked prefill's launch sequence.
//! - [`profile`]: measuring tools (stage events, the CTA timeline).

/// Launches kernel `$f` on `$gpu`'s stream with the named locals as arguments, in order.
/// Arguments must be locals: the driver reads them through their addresses at the launch.
macro_rules! launch {
    ($gpu:expr, $f:expr, $cfg:expr; $($arg:ident),* $(,)?) => {{
        let mut args = [$($crate::cuda::device::kernel_arg(&$arg)),*];
        // SAFETY: every launch site passes the argument list its kernel declares (types and
        // order checked against kernels/*.cu), with device addresses of live buffers sized
        // for the shapes it passes.
        unsafe { $gpu.launch($f, $cfg, &mut args) }
    }};
    ($gpu:expr, $f:expr, $cfg:expr, cluster = $c:expr; $($arg:ident),* $(,)?) => {{
        let mut args = [$($crate::cuda::device::kernel_arg(&$arg)),*];
        // SAFETY: as above; the kernel takes clusters of `$c` CTAs (x, y, z).
        unsafe { $gpu.launch_in_clusters($f, $cfg, $c, &mut args) }
    }};
    ($gpu:expr, $f:expr, $cfg:expr, cooperative; $($arg:ident),* $(,)?) => {{
        let mut args = [$($crate::cuda::device::kernel_arg(&$arg)),*];
        // SAFETY: as above; the grid fits the device at once.
        unsafe { $gpu.launch_cooperative($f, $cfg, &mut args) }
    }};
}

pub mod bench;
pub mod budget;
pub mod device;
pub mod draft;
mod kernel_cache;
pub mod kernels;
pub mod ops;
pub mod prefill;
pub mod profile;
pub mod sample;
mod saved;
pub mod staging;
pub mod step;
pub mod weights;

pub use step::CudaBackend;
