//! The CUDA backend: weights, KV cache, activations and decode state resident on the device.
//!
//! - [`device`]: driver probe, context and stream, allocation helpers.
//! - [`kernels`]: NVRTC compilation of `kernels/*.cu` (cached on disk) and the function table.
//! - [`weights`]: the model uploaded as packed NF4.
//! - [`budget`]: the VRAM estimate checked before anything is allocated.
//! - [`step`]: the backend itself: arena, state, KV, and the launch sequence of one step.

pub mod budget;
pub mod device;
pub mod kernels;
pub mod step;
pub mod weights;

pub use step::CudaBackend;
