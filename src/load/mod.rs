//! Model files: recognises the format of a path and yields a [`HostModel`].
//!
//! Formats are recognised by content (GGUF magic) or layout (a directory with `config.json`),
//! never by file name. One file per format: [`gguf`] (with [`ggml`] for its tensor types).
//! [`hf`] reads Hugging Face directories.

pub mod ggml;
pub mod gguf;
pub mod hf;

use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};
use crate::model::HostModel;

/// A dequantized vector tensor, refused when it holds NaN or infinity.
fn finite(file: &str, tensor: &str, values: Vec<f32>) -> Result<Vec<f32>> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(Error::ModelFile(format!(
            "{file}: tensor {tensor} holds {} at {i}",
            values[i]
        ))),
        None => Ok(values),
    }
}

/// Norm weights as decodev2 keeps them.
fn to_bf16(values: Vec<f32>) -> Vec<half::bf16> {
    values.into_iter().map(half::bf16::from_f32).collect()
}

pub fn load(path: &Path) -> Result<HostModel> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| Error::Io(format!("{shown}: {e}")))?;
    if meta.is_dir() {
        if path.join("config.json").is_file() {
            return hf::load(path);
        }
        return Err(Error::ModelFile(format!(
            "{shown}: a directory without config.json"
        )));
    }
    let mut magic = [0u8; 4];
    let mut file = std::fs::File::open(path).map_err(|e| Error::Io(format!("{shown}: {e}")))?;
    let got = file
        .read(&mut magic)
        .map_err(|e| Error::Io(format!("{shown}: {e}")))?;
    if got == 4 && &magic == b"GGUF" {
        return gguf::Gguf::open(path)?.model();
    }
    Err(Error::ModelFile(format!(
        "{shown}: not a model file (neither GGUF magic nor a directory with config.json)"
    )))
}
