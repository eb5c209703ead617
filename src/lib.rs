//! decodev2: batch-1 greedy decoding of llama-style LLMs with NF4 weights, behind a C ABI.
//!
//! The host passes token ids; the engine ([`engine::Engine`]) runs the model on a backend
//! (CPU reference, or CUDA with everything resident on the device). The CPU f32 oracle
//! ([`oracle`]) defines what every backend must compute.

pub mod arch;
pub mod backend;
pub mod chat;
pub mod config;
mod cpu;
pub mod cuda;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod load;
pub mod model;
pub mod nf4;
pub mod oracle;
mod panics;
pub(crate) mod par;
pub mod rope;
pub mod sampling;
pub mod save;
pub mod speculate;
pub mod state;
pub mod synth;
pub mod tokenizer;

pub use error::{Error, Result};
