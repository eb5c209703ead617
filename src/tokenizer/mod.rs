//! The model's own tokenizer: text to ids and ids back to bytes, built from what the model file
//! carries — a GGUF's `tokenizer.ggml.*` metadata (byte-level BPE, `tokenizer.ggml.model` =
//! gpt2, split the way `tokenizer.ggml.pre` names, run by the `tokenizers` crate; or
//! SentencePiece BPE, `llama`, in `spm`) or a Hugging Face directory's `tokenizer.json`
//! (the `tokenizers` crate).
//!
//! Pieces are raw bytes: a byte-level token can end inside a UTF-8 character, so a streaming
//! host appends each piece's bytes to a buffer and prints the longest valid UTF-8 prefix
//! (`detokenize` of the whole sequence is the concatenation of its pieces).

use std::collections::HashMap;
use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::chat::{ChatTemplate, Message};
use crate::error::{Error, Result};
use crate::load::gguf::{Gguf, Value};

/// GPT-2's split of text into words before BPE (the `tokenizers` ByteLevel regex).
const GPT2_SPLIT: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Qwen2's split (llama.cpp `qwen2`, Qwen2's tokenizer.json): digits one by one.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split (llama.cpp `llama-bpe`): digits in runs of up to three.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's Tekken split (llama.cpp `tekken`, Mistral Nemo's tokenizer.json, whose Unicode
/// classes this is; llama.cpp's regex engine takes an approximation of them): words broken
/// at a lower-to-upper case change, digits one by one.
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Control tokens that end a turn in the families llama.cpp knows, whatever the file calls
/// its EOS (llama.cpp's end-of-generation set).
const EOG_TEXTS: [&str; 7] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
];

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// Special ids a model file names (each absent when the file does not say).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub pad: Option<u32>,
}

mod spm;
mod spm_model;

/// A SentencePiece vocabulary: its pieces, their scores and types (SentencePiece's: 1 normal,
/// 2 unknown, 3 control, 4 user-defined, 6 byte), the unknown piece and whether text gets a
/// space prefix.
struct SpmVocab {
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i64>,
    unk: u32,
    space_prefix: bool,
}

/// What a Hugging Face directory's tokenizer_config.json (and config.json, for ids it names
/// only by number) says of its tokenizer.
struct HfSettings {
    special: SpecialIds,
    add_bos: Option<bool>,
    chat_template: Option<String>,
}

impl HfSettings {
    /// `token_id` maps a token's text to its id; ids past `size` are dropped.
    fn read(dir: &Path, size: usize, token_id: impl Fn(&str) -> Option<u32>) -> Self {
        let config = |name: &str| -> serde_json::Value {
            crate::load::read_text(&dir.join(name))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or(serde_json::Value::Null)
        };
        let (tok_config, model_config) = (config("tokenizer_config.json"), config("config.json"));
        let id_of = |key: &str| -> Option<u32> {
            let named = match &tok_config[key] {
                serde_json::Value::String(s) => Some(s.clone()),
                v => v["content"].as_str().map(str::to_string),
            };
            named
                .and_then(|t| token_id(&t))
                .or_else(|| {
                    model_config[format!("{key}_id")]
                        .as_u64()
                        .and_then(|v| u32::try_from(v).ok())
                })
                .filter(|v| (*v as usize) < size)
        };
        // A string, or named templates of which "default" is the chat one.
        let chat_template = match &tok_config["chat_template"] {
            serde_json::Value::String(t) => Some(t.clone()),
            serde_json::Value::Array(named) => named
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(str::to_string),
            _ => None,
        };
        Self {
            special: SpecialIds {
                bos: id_of("bos_token"),
                eos: id_of("eos_token"),
                eot: None,
                pad: id_of("pad_token"),
            },
            add_bos: tok_config["add_bos_token"].as_bool(),
            chat_template,
        }
    }
}

/// What turns text into ids.
enum Encoder {
    /// The `tokenizers` crate: one copy where special-token text in the input becomes the
    /// special id, one where it is ordinary text.
    Hf {
        parse_special: Box<tokenizers::Tokenizer>,
        literal: Box<tokenizers::Tokenizer>,
    },
    /// SentencePiece BPE, with the texts of the tokens matched whole where special text is
    /// parsed (control tokens) or always (user-defined ones).
    Spm {
        spm: Box<spm::Spm>,
        control: Vec<(String, u32)>,
        user_defined: Vec<(String, u32)>,
    },
}

pub struct Tokenizer {
    encoder: Encoder,
    /// The bytes each id stands for.
    pieces: Vec<Vec<u8>>,
    /// Control tokens (BOS, EOS, chat markers): left out by `detokenize` on request.
    control: Vec<bool>,
    pub special: SpecialIds,
    /// The file asks for BOS before a prompt.
    add_bos: bool,
    /// The model's chat template (Jinja), where the file has one.
    pub chat_template: Option<String>,
    /// SentencePiece's dummy prefix: a space before the text when encoding, dropped from the
    /// first text piece when decoding.
    space_prefix: bool,
}

/// GPT-2's reversible map from bytes to printable characters, inverted: the byte each
/// character of a byte-level token stands for.
fn byte_level_bytes() -> HashMap<char, u8> {
    let mut map = HashMap::new();
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            b as u32
        } else {
            extra += 1;
            255 + extra
        };
        map.insert(char::from_u32(c).expect("a valid char"), b);
    }
    map
}

/// A byte-level token's bytes (characters outside the byte alphabet as their UTF-8).
fn byte_level_piece(token: &str, bytes: &HashMap<char, u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(token.len());
    for c in token.chars() {
        match bytes.get(&c) {
            Some(b) => out.push(*b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out
}

/// A SentencePiece-style token's bytes: `▁` is a space, `<0xAB>` one byte.
fn metaspace_piece(token: &str) -> Vec<u8> {
    match spm::byte_piece(token) {
        Some(b) => vec![b],
        None => token.replace('\u{2581}', " ").into_bytes(),
    }
}

fn tk_error(what: &str) -> impl Fn(tokenizers::Error) -> Error + '_ {
    move |e| Error::ModelFile(format!("{what}: {e}"))
}

/// A call into the `tokenizers` crate, whose panics on a tokenizer it does not expect (at load,
/// or at encode where the file's parts run) become a model-file error, `what` first.
fn contained<T>(what: &str, call: impl FnOnce() -> T) -> Result<T> {
    crate::panics::catch(call).map_err(|panic| {
        Error::ModelFile(format!("{what}: the tokenizers crate panicked: {panic}"))
    })
}

fn split(pattern: &str) -> Result<PreTokenizerWrapper> {
    let split = Split::new(
        SplitPattern::Regex(pattern.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(tk_error("pre-tokenizer"))?;
    Ok(split.into())
}

/// The pre-tokenizer for a GGUF's `tokenizer.ggml.pre`: the regex split llama.cpp applies for
/// it, then the byte-level map. Names it does not know are refused rather than guessed.
fn gguf_pre_tokenizer(pre: Option<&str>) -> Result<PreTokenizerWrapper> {
    let byte_level = |use_regex| ByteLevel::new(false, true, use_regex).into();
    let steps: Vec<PreTokenizerWrapper> = match pre.unwrap_or("default") {
        "default" | "gpt-2" | "gpt2" => vec![byte_level(true)],
        // SmolLM: digits one by one, then GPT-2's split.
        "smollm" => vec![split(r"\p{N}")?, split(GPT2_SPLIT)?, byte_level(false)],
        "qwen2" | "deepseek-r1-qwen" => vec![split(QWEN2_SPLIT)?, byte_level(false)],
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" => {
            vec![split(LLAMA3_SPLIT)?, byte_level(false)]
        }
        "tekken" => vec![split(TEKKEN_SPLIT)?, byte_level(false)],
        other => {
            return Err(Error::Unsupported(format!(
                "tokenizer.ggml.pre = {other} (default, gpt-2, smollm, qwen2, llama-bpe, tekken are read)"
            )))
        }
    };
    Ok(Sequence::new(steps).into())
}

impl Tokenizer {
    /// The tokenizer a GGUF file carries: byte-level BPE (`tokenizer.ggml.model` = gpt2) or
    /// SentencePiece BPE (`llama`).
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let model = g.str("tokenizer.ggml.model").ok_or_else(|| {
            Error::Unsupported("the file carries no tokenizer (tokenizer.ggml.model)".into())
        })?;
        let tokens = g.tokens();
        let types: Vec<i64> = match g.meta.get("tokenizer.ggml.token_type") {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| if let Value::Int(t) = v { *t } else { 1 })
                .collect(),
            _ => Vec::new(),
        };
        if tokens.is_empty() {
            return Err(Error::ModelFile("tokenizer.ggml.tokens is empty".into()));
        }
        let id = |key: &str| match g.meta.get(key) {
            Some(Value::Int(v)) => u32::try_from(*v)
                .ok()
                .filter(|v| (*v as usize) < tokens.len()),
            _ => None,
        };
        let special = SpecialIds {
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            eot: id("tokenizer.ggml.eot_token_id"),
            pad: id("tokenizer.ggml.padding_token_id"),
        };
        let flag = |key: &str| match g.meta.get(key) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        };
        let chat_template = g.str("tokenizer.chat_template").map(str::to_string);
        if model == "llama" {
            let scores: Vec<f32> = match g.meta.get("tokenizer.ggml.scores") {
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| match v {
                        Value::Float(f) => *f as f32,
                        Value::Int(i) => *i as f32,
                        _ => 0.0,
                    })
                    .collect(),
                _ => vec![0.0; tokens.len()],
            };
            let unk = id("tokenizer.ggml.unknown_token_id").unwrap_or(0);
            let mut types = types;
            types.resize(tokens.len(), 1);
            // llama.cpp's defaults for a SentencePiece vocabulary: BOS first, a space prefix.
            return Ok(Self::sentencepiece(
                SpmVocab {
                    tokens,
                    scores,
                    types,
                    unk,
                    space_prefix: flag("tokenizer.ggml.add_space_prefix").unwrap_or(true),
                },
                special,
                flag("tokenizer.ggml.add_bos_token").unwrap_or(true),
                chat_template,
            ));
        }
        if model != "gpt2" {
            return Err(Error::Unsupported(format!(
                "tokenizer.ggml.model = {model} (gpt2, byte-level BPE, and llama, SentencePiece BPE, are read)"
            )));
        }
        let merges = g.merges();
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| Error::ModelFile(format!("merge {m:?} is not two tokens")))
            })
            .collect::<Result<Vec<_>>>()?;
        // llama.cpp's Llama 3 and Tekken vocabularies take a pre-token that is a token whole
        // before any merge (their tokenizer.json say so too: "ignore_merges": true), and put
        // BOS first unless the file says otherwise.
        let pre = g.str("tokenizer.ggml.pre");
        let whole_first = matches!(pre, Some("llama3" | "llama-v3" | "llama-bpe" | "tekken"));
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(whole_first)
            .build()
            .map_err(tk_error("BPE"))?;
        let mut tk = tokenizers::Tokenizer::new(bpe);
        tk.with_pre_tokenizer(Some(gguf_pre_tokenizer(pre)?));
        tk.with_decoder(Some(ByteLevelDecoder::default()));
        // Control tokens are special (matched whole where special text is parsed); user-defined
        // ones are matched whole always, as llama.cpp does.
        let typed = |want: i64, special: bool| -> Vec<AddedToken> {
            tokens
                .iter()
                .zip(&types)
                .filter(|(_, t)| **t == want)
                .map(|(tok, _)| AddedToken::from(tok.clone(), special))
                .collect()
        };
        tk.add_special_tokens(&typed(TOKEN_CONTROL, true));
        tk.add_tokens(&typed(TOKEN_USER_DEFINED, false));
        let bytes = byte_level_bytes();
        let pieces = tokens.iter().map(|t| byte_level_piece(t, &bytes)).collect();
        let control = (0..tokens.len())
            .map(|i| types.get(i) == Some(&TOKEN_CONTROL))
            .collect();
        let add_bos = flag("tokenizer.ggml.add_bos_token").unwrap_or(whole_first);
        Self::with_modes(tk, pieces, control, special, add_bos, chat_template)
    }

    /// A Hugging Face directory's tokenizer: its `tokenizer.json`, or where it has none its
    /// SentencePiece `tokenizer.model`; with the special ids, the BOS rule and the chat template
    /// of its `tokenizer_config.json` and `config.json` where they say.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        if dir.join("tokenizer.json").exists() {
            return Self::from_hf_json(dir);
        }
        let path = dir.join("tokenizer.model");
        if !path.exists() {
            return Err(Error::Unsupported(format!(
                "{}: no tokenizer.json or tokenizer.model in the model directory",
                dir.display()
            )));
        }
        let bytes =
            std::fs::read(&path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        let vocab = spm_model::read(&bytes)?;
        let index: HashMap<&str, u32> = vocab
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_str(), i as u32))
            .collect();
        let settings = HfSettings::read(dir, vocab.tokens.len(), |t| index.get(t).copied());
        // transformers' LlamaTokenizer puts BOS first unless the config says otherwise.
        let add_bos = settings.add_bos.unwrap_or(true);
        let (special, chat_template) = (settings.special, settings.chat_template);
        Ok(Self::sentencepiece(vocab, special, add_bos, chat_template))
    }

    fn from_hf_json(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let text = crate::load::read_text(&path)?;
        let shown = path.display().to_string();
        // JSON first: the tokenizers crate panics on some malformed JSON (a syntax error inside
        // "decoder", found by fuzz/src/bin/hf_tokenizer.rs), and on some well-formed files too
        // (huggingface/tokenizers#2151), caught below.
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::ModelFile(format!("{shown}: {e}")))?;
        let tk = contained(&shown, || {
            tokenizers::Tokenizer::from_bytes(text.as_bytes())
        })?
        .map_err(tk_error(&shown))?;
        let byte_level = json["decoder"]["type"] == "ByteLevel"
            || json["pre_tokenizer"]["type"] == "ByteLevel"
            || json["pre_tokenizer"]["pretokenizers"]
                .as_array()
                .is_some_and(|p| p.iter().any(|s| s["type"] == "ByteLevel"));
        let size = tk.get_vocab_size(true);
        let bytes = byte_level_bytes();
        let pieces = (0..size as u32)
            .map(|id| {
                let token = tk.id_to_token(id).unwrap_or_default();
                if byte_level {
                    byte_level_piece(&token, &bytes)
                } else {
                    metaspace_piece(&token)
                }
            })
            .collect();
        let special_ids: Vec<u32> = tk
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| *id)
            .collect();
        let control = (0..size as u32)
            .map(|id| special_ids.contains(&id))
            .collect();
        let settings = HfSettings::read(dir, size, |t| tk.token_to_id(t));
        let add_bos = settings.add_bos.unwrap_or(false);
        // The file's post-processor (BOS templates) is replaced by add_bos, applied the same
        // way for every format.
        let mut tk = tk;
        tk.with_post_processor(None::<tokenizers::PostProcessorWrapper>);
        let (special, chat_template) = (settings.special, settings.chat_template);
        Self::with_modes(tk, pieces, control, special, add_bos, chat_template)
    }

    /// A SentencePiece BPE vocabulary's tokenizer (a GGUF's `llama` model, or a directory's
    /// tokenizer.model).
    fn sentencepiece(
        vocab: SpmVocab,
        special: SpecialIds,
        add_bos: bool,
        chat_template: Option<String>,
    ) -> Self {
        let SpmVocab {
            tokens,
            scores,
            types,
            unk,
            space_prefix,
        } = vocab;
        let control: Vec<bool> = types.iter().map(|t| *t == TOKEN_CONTROL).collect();
        let typed = |want: i64| -> Vec<(String, u32)> {
            let mut list: Vec<(String, u32)> = tokens
                .iter()
                .zip(&types)
                .enumerate()
                .filter(|(_, (t, ty))| **ty == want && !t.is_empty())
                .map(|(i, (t, _))| (t.clone(), i as u32))
                .collect();
            // The longest text first where two start alike.
            list.sort_by_key(|(t, _)| std::cmp::Reverse(t.len()));
            list
        };
        let pieces = tokens
            .iter()
            .zip(&control)
            .map(|(t, control)| {
                if *control {
                    t.clone().into_bytes()
                } else {
                    metaspace_piece(t)
                }
            })
            .collect();
        let encoder = Encoder::Spm {
            spm: Box::new(spm::Spm::new(&tokens, &scores, unk)),
            control: typed(TOKEN_CONTROL),
            user_defined: typed(TOKEN_USER_DEFINED),
        };
        Self {
            encoder,
            pieces,
            control,
            special,
            add_bos,
            chat_template,
            space_prefix,
        }
    }

    fn with_modes(
        tk: tokenizers::Tokenizer,
        pieces: Vec<Vec<u8>>,
        control: Vec<bool>,
        special: SpecialIds,
        add_bos: bool,
        chat_template: Option<String>,
    ) -> Result<Self> {
        let mut literal = tk.clone();
        literal.set_encode_special_tokens(true);
        Ok(Self {
            encoder: Encoder::Hf {
                parse_special: Box::new(tk),
                literal: Box::new(literal),
            },
            pieces,
            control,
            special,
            add_bos,
            chat_template,
            space_prefix: false,
        })
    }

    /// Ids of the tokenizer's vocabulary (added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// The ids of `text`. `add_special`: BOS first where the model file asks for it;
    /// `parse_special`: special-token text (e.g. `<|im_start|>`) becomes its id, else it is
    /// ordinary text.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            ids.extend(self.special.bos);
        }
        match &self.encoder {
            Encoder::Hf {
                parse_special: parsing,
                literal,
            } => {
                let tk = if parse_special { parsing } else { literal };
                let encoding = contained("tokenize", || tk.encode_fast(text, false))?
                    .map_err(|e| Error::InvalidArgument(format!("tokenize: {e}")))?;
                ids.extend_from_slice(encoding.get_ids());
            }
            Encoder::Spm {
                spm,
                control,
                user_defined,
            } => {
                // Split at the texts matched whole; the space prefix goes before the text's
                // start only.
                let mut rest = text;
                let mut at_start = true;
                while !rest.is_empty() {
                    let whole = |tail: &str, list: &[(String, u32)]| {
                        list.iter()
                            .find(|(t, _)| tail.starts_with(t.as_str()))
                            .map(|(t, id)| (t.len(), *id))
                    };
                    let found = rest.char_indices().find_map(|(i, _)| {
                        let tail = &rest[i..];
                        let hit = if parse_special {
                            whole(tail, control)
                        } else {
                            None
                        };
                        hit.or_else(|| whole(tail, user_defined))
                            .map(|(len, id)| (i, len, id))
                    });
                    let (plain, next) = match found {
                        Some((i, len, id)) => (&rest[..i], Some((i + len, id))),
                        None => (rest, None),
                    };
                    spm.encode(plain, self.space_prefix && at_start, &mut ids);
                    at_start = false;
                    match next {
                        Some((end, id)) => {
                            ids.push(id);
                            rest = &rest[end..];
                        }
                        None => break,
                    }
                }
            }
        }
        Ok(ids)
    }

    /// The bytes id `id` stands for (a byte-level piece may hold part of a UTF-8 character).
    pub fn piece(&self, id: u32) -> Result<&[u8]> {
        self.pieces
            .get(id as usize)
            .map(Vec::as_slice)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "id {id} is out of the tokenizer's range (0 to {})",
                    self.pieces.len().saturating_sub(1)
                ))
            })
    }

    /// `messages` through the model's chat template (see [`crate::chat`]), with the BOS and EOS
    /// texts it may use; `add_generation_prompt` opens the assistant's turn.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let source = self
            .chat_template
            .as_deref()
            .ok_or_else(|| Error::Unsupported("the model file has no chat template".into()))?;
        let text = |id: Option<u32>| {
            id.and_then(|id| self.pieces.get(id as usize))
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .unwrap_or_default()
        };
        ChatTemplate::new(source, &text(self.special.bos), &text(self.special.eos))?
            .render(messages, add_generation_prompt)
    }

    /// Whether generating `id` ends the model's turn: its EOS or end-of-turn id, or a control
    /// token whose text ends a turn in a known family (`<|im_end|>`, `<|eot_id|>`, ...).
    pub fn is_eog(&self, id: u32) -> bool {
        Some(id) == self.special.eos
            || Some(id) == self.special.eot
            || (self.is_control(id)
                && self
                    .pieces
                    .get(id as usize)
                    .is_some_and(|p| EOG_TEXTS.iter().any(|t| t.as_bytes() == p.as_slice())))
    }

    /// Whether `id` is a control token (BOS, EOS, chat markers).
    pub fn is_control(&self, id: u32) -> bool {
        self.control.get(id as usize).copied().unwrap_or(false)
    }

    /// The bytes of `ids`, the pieces one after another; `skip_control` leaves control tokens
    /// out.
    /// SentencePiece's dummy prefix comes off the first text piece.
    pub fn decode(&self, ids: &[u32], skip_control: bool) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut first_text = self.space_prefix;
        for &id in ids {
            let mut piece = self.piece(id)?;
            let control = self.is_control(id);
            if skip_control && control {
                continue;
            }
            if first_text && !control {
                first_text = false;
                piece = piece.strip_prefix(b" ").unwrap_or(piece);
            }
            out.extend_from_slice(piece);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_map_is_a_bijection_over_bytes() {
        let map = byte_level_bytes();
        assert_eq!(map.len(), 256);
        let mut seen = [false; 256];
        map.values().for_each(|b| seen[*b as usize] = true);
        assert!(seen.iter().all(|s| *s));
        assert_eq!(map[&'\u{120}'], b' '); // GPT-2's 'Ġ'
        assert_eq!(map[&'\u{10a}'], b'\n'); // 'Ċ'
        assert_eq!(
            byte_level_piece("\u{120}caf\u{c3}\u{a9}", &map),
            " café".as_bytes()
        );
    }

    #[test]
    fn metaspace_pieces_are_bytes() {
        assert_eq!(metaspace_piece("\u{2581}Paris"), b" Paris");
        assert_eq!(metaspace_piece("<0x0A>"), b"\n");
        assert_eq!(metaspace_piece("<0x0>"), b"<0x0>");
    }

    #[test]
    fn unknown_pre_tokenizers_are_refused() {
        let err = gguf_pre_tokenizer(Some("no-such-split")).expect_err("refused");
        assert!(err.to_string().contains("no-such-split"), "{err}");
        for pre in [
            None,
            Some("smollm"),
            Some("qwen2"),
            Some("llama-bpe"),
            Some("tekken"),
        ] {
            assert!(gguf_pre_tokenizer(pre).is_ok(), "{pre:?}");
        }
    }
}
