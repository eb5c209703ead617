//! Model files: recognises the format of a path and yields a [`HostModel`].
//!
//! Formats are recognised by content (GGUF magic) or layout (a directory with `config.json`),
//! never by file name. One file per format: [`gguf`] (with [`ggml`] for its tensor types).
//! [`hf`] reads Hugging Face directories.

pub mod ggml;
pub mod gguf;
pub mod hf;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::arch::ArchSpec;
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

/// Refuses a model file holding tensors its reader would pass over (`read` false for the
/// name): each would change the model's output. The error names the first in sorted order
/// and how many there are.
fn refuse_unread<'a>(
    file: &str,
    names: impl Iterator<Item = &'a String>,
    read: impl Fn(&str) -> bool,
) -> Result<()> {
    let mut unread: Vec<&String> = names.filter(|n| !read(n)).collect();
    unread.sort();
    match unread.first() {
        None => Ok(()),
        Some(first) => Err(Error::Unsupported(format!(
            "{file}: tensor {first} ({} unread in all) is not one decodev2 reads, and would change \
             the model's output",
            unread.len()
        ))),
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
    load_all(path).map(|loaded| loaded.model)
}

/// A judge of a model's shape, called before any weight is read (the engine's check of the
/// backend's limits and memory: a refused model fails before the slow part of a load).
pub type Admit<'a> = &'a dyn Fn(&ArchSpec) -> Result<()>;

/// The file's metadata as text by key: a GGUF's key/value pairs, a Hugging Face directory's
/// config.json fields. Arrays longer than [`META_ARRAY_MAX`] hold their length instead.
pub type Metadata = BTreeMap<String, std::result::Result<String, usize>>;

/// The longest metadata array given as text (a vocabulary's tokens are not).
pub const META_ARRAY_MAX: usize = 1024;

/// What a model file holds besides the weights.
pub struct Loaded {
    pub model: HostModel,
    /// The tokenizer it carries (its own result: a model whose tokenizer cannot be read still
    /// loads, and says why when asked for text).
    pub tokenizer: Result<Tokenizer>,
    pub meta: Metadata,
}

/// [`load`], with the file's tokenizer and metadata.
pub fn load_all(path: &Path) -> Result<Loaded> {
    load_admitted(path, &|_| Ok(()))
}

/// [`load_all`], with `admit` judging the shape before any weight is read.
pub fn load_admitted(path: &Path, admit: Admit) -> Result<Loaded> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| Error::Io(format!("{shown}: {e}")))?;
    if meta.is_dir() {
        if path.join("config.json").exists() {
            let tokenizer = Tokenizer::from_hf_dir(path);
            return Ok(Loaded {
                model: hf::load(path, admit)?,
                tokenizer,
                meta: hf::metadata(path)?,
            });
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
        return Ok(Loaded {
            model: file.model_admitted(admit)?,
            tokenizer: Tokenizer::from_gguf(&file),
            meta: file.metadata(),
        });
    }
    Err(Error::ModelFile(format!(
        "{shown}: not a model file (neither GGUF magic nor a directory with config.json)"
    )))
}
