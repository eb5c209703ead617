//! Model files: recognises the format of a path and yields a [`HostModel`].
//!
//! Formats are recognised by content (GGUF magic) or layout (a directory with `config.json`),
//! never by file name. One file per format: [`gguf`] (with [`ggml`] for its tensor types).
//! [`hf`] reads Hugging Face directories.

pub mod ggml;
pub mod gguf;
pub mod hf;

use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};
use crate::model::HostModel;
use crate::tokenizer::Tokenizer;

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

/// Opens `path` for reading, refusing anything but a regular file: the open itself cannot block
/// (a FIFO's would wait for a writer; O_NONBLOCK, which regular files ignore), and the
/// opened file is checked before anything reads it.
pub(crate) fn open_regular(path: &Path) -> Result<File> {
    let shown = path.display();
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NONBLOCK);
    let file = options
        .open(path)
        .map_err(|e| Error::Io(format!("{shown}: {e}")))?;
    let meta = file
        .metadata()
        .map_err(|e| Error::Io(format!("{shown}: {e}")))?;
    if !meta.is_file() {
        return Err(Error::ModelFile(format!(
            "{shown}: not a regular file (nor a model directory)"
        )));
    }
    Ok(file)
}

/// The text of a regular file (see [`open_regular`]).
pub(crate) fn read_text(path: &Path) -> Result<String> {
    let mut text = String::new();
    open_regular(path)?
        .read_to_string(&mut text)
        .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    Ok(text)
}

/// Norm weights as decodev2 keeps them.
fn to_bf16(values: Vec<f32>) -> Vec<half::bf16> {
    values.into_iter().map(half::bf16::from_f32).collect()
}

pub fn load(path: &Path) -> Result<HostModel> {
    load_with_tokenizer(path).map(|(model, _)| model)
}

/// [`load`], and the tokenizer the file or directory carries (its own result: a model whose
/// tokenizer cannot be read still loads, and says why when asked for text).
pub fn load_with_tokenizer(path: &Path) -> Result<(HostModel, Result<Tokenizer>)> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| Error::Io(format!("{shown}: {e}")))?;
    if meta.is_dir() {
        if path.join("config.json").exists() {
            let tokenizer = if path.join("tokenizer.json").exists() {
                Tokenizer::from_hf_dir(path)
            } else {
                Err(Error::Unsupported(format!(
                    "{shown}: no tokenizer.json in the model directory"
                )))
            };
            return Ok((hf::load(path)?, tokenizer));
        }
        return Err(Error::ModelFile(format!(
            "{shown}: a directory without config.json"
        )));
    }
    let mut magic = [0u8; 4];
    let mut file = open_regular(path)?;
    let got = file
        .read(&mut magic)
        .map_err(|e| Error::Io(format!("{shown}: {e}")))?;
    if got == 4 && &magic == b"GGUF" {
        let file = gguf::Gguf::open(path)?;
        return Ok((file.model()?, Tokenizer::from_gguf(&file)));
    }
    Err(Error::ModelFile(format!(
        "{shown}: not a model file (neither GGUF magic nor a directory with config.json)"
    )))
}
