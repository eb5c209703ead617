//! Hugging Face model directories: `config.json` plus `*.safetensors` (one file, or shards
//! listed by `model.safetensors.index.json`), bf16 / f16 / f32, memory-mapped and re-quantized
//! to NF4 row by row on every core; or bitsandbytes 4-bit (nf4) linears, whose codes are
//! decodev2's layout and are taken as they are (`load::bnb`).
//!
//! Architectures: `LlamaForCausalLM`, `MistralForCausalLM` (no biases) and `Qwen2ForCausalLM`
//! (q/k/v biases). Hugging Face stores q and k in the rotate-half layout decodev2 uses, so no
//! permutation is undone here (unlike GGUF).

mod bnb;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::arch::{ArchSpec, Family};
use crate::error::{Error, Result};
use crate::model::{HostModel, Layer, Linear, QkvWeights};
use crate::nf4::{Codes, MappedBytes, Nf4Matrix};
use crate::rope::{yarn_mscale, RopeScaling};

/// Where a tensor lives: its file (index into `Shards::maps`), dtype, shape and bytes.
struct TensorEntry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: std::ops::Range<usize>,
}

/// The memory maps of a directory's safetensors files and where each tensor lives (each
/// file's header parsed once, at open).
struct Shards {
    maps: Vec<(PathBuf, Arc<memmap2::Mmap>)>,
    index: HashMap<String, TensorEntry>,
}

fn file_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::ModelFile(format!("{}: {e}", path.display()))
}

impl Shards {
    fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index_path.is_file() {
            let text = super::read_text(&index_path)?;
            let json: Value = serde_json::from_str(&text).map_err(|e| file_err(&index_path, e))?;
            let map = json["weight_map"]
                .as_object()
                .ok_or_else(|| file_err(&index_path, "no weight_map object"))?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(String::from))
                .collect();
            files.sort();
            files.dedup();
            files
        } else if dir.join("model.safetensors").is_file() {
            vec!["model.safetensors".into()]
        } else {
            return Err(Error::ModelFile(format!(
                "{}: no model.safetensors or model.safetensors.index.json",
                dir.display()
            )));
        };
        let mut maps = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for (i, name) in files.iter().enumerate() {
            let path = dir.join(name);
            let file = super::open_regular(&path)?;
            // SAFETY: a read-only map; see load::gguf for the caveat on files changed while mapped.
            let map = unsafe { memmap2::Mmap::map(&file) }
                .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| file_err(&path, e))?;
            for (name, view) in st.tensors() {
                // The view's data is a slice of the map: keep its offsets, not the borrow.
                let start = view.data().as_ptr() as usize - map.as_ptr() as usize;
                let entry = TensorEntry {
                    file: i,
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    bytes: start..start + view.data().len(),
                };
                index.insert(name, entry);
            }
            maps.push((path, Arc::new(map)));
        }
        Ok(Self { maps, index })
    }

    /// The tensor's dtype, shape and bytes.
    fn get(&self, name: &str) -> Result<(Dtype, Vec<usize>, &[u8], &Path)> {
        let t = self
            .index
            .get(name)
            .ok_or_else(|| Error::ModelFile(format!("tensor {name} is missing")))?;
        let (path, map) = &self.maps[t.file];
        Ok((t.dtype, t.shape.clone(), &map[t.bytes.clone()], path))
    }

    /// The tensor's bytes where they lie in its file's map (the map stays open as long as
    /// they are held).
    fn mapped(&self, name: &str) -> Result<Codes> {
        let t = self
            .index
            .get(name)
            .ok_or_else(|| Error::ModelFile(format!("tensor {name} is missing")))?;
        Ok(Codes::Mapped(Arc::new(MappedBytes {
            map: self.maps[t.file].1.clone(),
            bytes: t.bytes.clone(),
        })))
    }

    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Every tensor of the directory must be one [`load`] takes for `spec` under its family's
    /// `names` (with a bitsandbytes
    /// linear's quant state beside it, and the `rotary_emb.inv_freq` buffers old checkpoints
    /// carry, which config.json determines): one it would pass over (an o-projection or MLP
    /// bias, a q/k norm, a layer past num_hidden_layers) changes the model's output, so the
    /// directory is refused naming it.
    fn every_tensor_is_read(&self, dir: &Path, spec: &ArchSpec, names: &Names) -> Result<()> {
        const QUANT_STATE: [&str; 5] = [
            "absmax",
            "quant_map",
            "nested_absmax",
            "nested_quant_map",
            "quant_state.bitsandbytes__nf4",
        ];
        let linears = names.linears();
        let biased: &[&str] = match (&names.qkv, spec.qkv_bias) {
            (QkvNames::Separate(qkv), true) => qkv,
            _ => &[],
        };
        let in_layer = |rest: &str| {
            let linear = rest.split_once(".weight").is_some_and(|(linear, part)| {
                linears.contains(&linear)
                    && (part.is_empty()
                        || part
                            .strip_prefix('.')
                            .is_some_and(|s| QUANT_STATE.contains(&s)))
            });
            let bias = rest
                .strip_suffix(".bias")
                .is_some_and(|l| biased.contains(&l));
            linear
                || bias
                || rest == names.attn_norm
                || rest == names.ffn_norm
                || matches!(
                    rest,
                    "self_attn.rotary_emb.inv_freq" | "attention.rotary_emb.inv_freq"
                )
        };
        let read = |name: &str| match name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
        {
            Some((layer, rest)) => {
                layer.parse::<usize>().is_ok_and(|l| l < spec.n_layers) && in_layer(rest)
            }
            None => {
                name == names.embed
                    || name == "model.norm.weight"
                    || name == "model.rotary_emb.inv_freq"
                    || (name == names.lm_head && !spec.tied_embed)
            }
        };
        super::refuse_unread(&dir.display().to_string(), self.index.keys(), read)
    }

    /// Checks shape `[rows, cols]` (rows = 0: a vector of cols) and dtype; returns a row reader.
    fn rows(&self, name: &str, rows: usize, cols: usize) -> Result<RowReader<'_>> {
        let (dtype, shape, data, path) = self.get(name)?;
        let want: Vec<usize> = if rows == 0 {
            vec![cols]
        } else {
            vec![rows, cols]
        };
        if shape != want {
            return Err(file_err(
                path,
                format!("tensor {name} has shape {shape:?}, config.json says {want:?}"),
            ));
        }
        let elem = match dtype {
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            other => {
                return Err(Error::Unsupported(format!(
                    "{}: tensor {name} has dtype {other:?} (bf16, f16, f32 are read)",
                    path.display()
                )))
            }
        };
        Ok(RowReader {
            path,
            dtype,
            data,
            row_bytes: cols * elem,
        })
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let r = self.rows(name, 0, len)?;
        let mut out = vec![0f32; len];
        r.read(0, &mut out);
        super::finite(&r.path.display().to_string(), name, out)
    }

    fn norm(&self, name: &str, len: usize) -> Result<Vec<bf16>> {
        Ok(super::to_bf16(self.vector(name, len)?))
    }

    /// A weight matrix as NF4: bitsandbytes' codes as they are where it is a bitsandbytes
    /// 4-bit weight ([`bnb`]), else its 16- or 32-bit values re-quantized.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Nf4Matrix> {
        if let Some(m) = bnb::matrix(self, name, rows, cols)? {
            return Ok(m);
        }
        let r = self.rows(name, rows, cols)?;
        Nf4Matrix::quantize_with(rows, cols, |row, out| r.read(row, out))
            .map_err(|e| Error::ModelFile(format!("tensor {name}: {e}")))
    }
}

struct RowReader<'a> {
    path: &'a Path,
    dtype: Dtype,
    data: &'a [u8],
    row_bytes: usize,
}

impl RowReader<'_> {
    fn read(&self, row: usize, out: &mut [f32]) {
        let src = &self.data[row * self.row_bytes..(row + 1) * self.row_bytes];
        match self.dtype {
            Dtype::BF16 => src
                .chunks_exact(2)
                .zip(out)
                .for_each(|(b, o)| *o = bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            Dtype::F16 => src
                .chunks_exact(2)
                .zip(out)
                .for_each(|(b, o)| *o = f16::from_le_bytes([b[0], b[1]]).to_f32()),
            _ => src
                .chunks_exact(4)
                .zip(out)
                .for_each(|(b, o)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        }
    }
}

/// config.json's fields as text: strings as they are, anything else as JSON (arrays longer than
/// [`super::META_ARRAY_MAX`] hold their length instead).
pub fn metadata(dir: &Path) -> Result<super::Metadata> {
    let path = dir.join("config.json");
    let c: Value =
        serde_json::from_str(&super::read_text(&path)?).map_err(|e| file_err(&path, e))?;
    let Value::Object(fields) = c else {
        return Err(Error::ModelFile(format!(
            "{}: not a JSON object",
            path.display()
        )));
    };
    Ok(fields
        .into_iter()
        .map(|(k, v)| {
            let value = match v {
                Value::String(s) => Ok(s),
                Value::Array(a) if a.len() > super::META_ARRAY_MAX => Err(a.len()),
                v => Ok(v.to_string()),
            };
            (k, value)
        })
        .collect())
}

/// RoPE's theta and scaling. transformers 4.x writes `rope_theta` and `rope_scaling`, 5.x one
/// `rope_parameters` that holds both; a scaling names its kind in `rope_type` (older files:
/// `type`), and its parameters are those transformers' `ROPE_INIT_FUNCTIONS` read.
fn rope_from_config(c: &Value, path: &Path) -> Result<(f64, RopeScaling)> {
    let theta = c["rope_parameters"]["rope_theta"]
        .as_f64()
        .or(c["rope_theta"].as_f64())
        .unwrap_or(10000.0);
    // transformers rotates only this share of each head where a config sets it below 1.
    let partial = c["rope_parameters"]["partial_rotary_factor"]
        .as_f64()
        .or(c["partial_rotary_factor"].as_f64());
    if let Some(share) = partial.filter(|share| *share != 1.0) {
        return Err(Error::Unsupported(format!(
            "{}: partial_rotary_factor {share} (RoPE over part of each head)",
            path.display()
        )));
    }
    let (key, params) = match &c["rope_scaling"] {
        Value::Null => ("rope_parameters", &c["rope_parameters"]),
        scaling => ("rope_scaling", scaling),
    };
    if !(params.is_null() || params.is_object()) {
        return Err(file_err(path, format!("{key} {params} is not an object")));
    }
    let kind = params["rope_type"]
        .as_str()
        .or(params["type"].as_str())
        .unwrap_or("default");
    let number = |name: &str| {
        params[name].as_f64().map(|v| v as f32).ok_or_else(|| {
            file_err(
                path,
                format!("{key} {kind}: {name} is missing or not a number"),
            )
        })
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: number("factor")?,
        },
        "dynamic" => RopeScaling::DynamicNtk {
            factor: number("factor")?,
            max_position: c["max_position_embeddings"].as_u64().ok_or_else(|| {
                file_err(path, "rope scaling dynamic without max_position_embeddings")
            })? as usize,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_position: number("original_max_position_embeddings")?,
        },
        "yarn" => {
            let factor = number("factor")?;
            let optional = |name: &str| params[name].as_f64().filter(|v| *v != 0.0);
            // transformers: the factor's mscale, or the ratio of two where both are given.
            let attention_factor = optional("attention_factor").unwrap_or_else(|| {
                let f = factor as f64;
                match (optional("mscale"), optional("mscale_all_dim")) {
                    (Some(m), Some(all)) => yarn_mscale(f, m) / yarn_mscale(f, all),
                    _ => yarn_mscale(f, 1.0),
                }
            });
            RopeScaling::Yarn {
                factor,
                original_max_position: params["original_max_position_embeddings"]
                    .as_f64()
                    .or(c["max_position_embeddings"].as_f64())
                    .unwrap_or(0.0) as f32,
                beta_fast: optional("beta_fast").unwrap_or(32.0) as f32,
                beta_slow: optional("beta_slow").unwrap_or(1.0) as f32,
                truncate: params["truncate"].as_bool().unwrap_or(true),
                attention_factor: attention_factor as f32,
            }
        }
        other => {
            return Err(Error::Unsupported(format!(
                "{}: {key} of type {other} (default, linear, llama3, yarn and dynamic are read)",
                path.display()
            )))
        }
    };
    Ok((theta, scaling))
}

/// Reads `config.json` into a spec and its RoPE scaling, refusing what decodev2 does not
/// compute.
fn spec_from_config(dir: &Path) -> Result<(ArchSpec, RopeScaling)> {
    let path = dir.join("config.json");
    let text = super::read_text(&path)?;
    let c: Value = serde_json::from_str(&text).map_err(|e| file_err(&path, e))?;
    let arch = c["architectures"][0].as_str().unwrap_or("");
    // InternLM2's `bias` covers wqkv and wo together: its spec check refuses it.
    let (family, qkv_bias) = match arch {
        "LlamaForCausalLM" | "MistralForCausalLM" => (Family::LlamaSwiglu, false),
        "Qwen2ForCausalLM" => (Family::LlamaSwiglu, true),
        "InternLM2ForCausalLM" => (Family::InternlmGqa, c["bias"].as_bool().unwrap_or(false)),
        other => {
            return Err(Error::Unsupported(format!(
                "{}: architecture {other:?} (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, InternLM2ForCausalLM are read)",
                path.display()
            )))
        }
    };
    let count = |key: &str| -> Result<usize> {
        c[key]
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| file_err(&path, format!("{key} is missing or not a count")))
    };
    let (rope_theta, rope_scaling) = rope_from_config(&c, &path)?;
    let quant = &c["quantization_config"];
    if !quant.is_null() {
        let method = quant["quant_method"].as_str().unwrap_or("none");
        let nf4 = quant["bnb_4bit_quant_type"].as_str().unwrap_or("fp4") == "nf4";
        if method != "bitsandbytes" || quant["load_in_4bit"].as_bool() != Some(true) || !nf4 {
            return Err(Error::Unsupported(format!(
                "{}: quantization_config {quant} (bitsandbytes 4-bit nf4 is read)",
                path.display()
            )));
        }
    }
    if c["use_sliding_window"].as_bool() == Some(true) {
        return Err(Error::Unsupported(format!(
            "{}: use_sliding_window",
            path.display()
        )));
    }
    // Mistral's sliding window is exact attention for sequences no longer than it: cap the
    // capacity there.
    let window = if arch == "MistralForCausalLM" {
        c["sliding_window"].as_u64().map(|w| w as usize)
    } else {
        None
    };
    if c["attention_bias"].as_bool() == Some(true) || c["mlp_bias"].as_bool() == Some(true) {
        return Err(Error::Unsupported(format!(
            "{}: attention_bias / mlp_bias on o_proj or the MLP",
            path.display()
        )));
    }
    if let Some(act) = c["hidden_act"].as_str() {
        if act != "silu" {
            return Err(Error::Unsupported(format!(
                "{}: hidden_act {act}",
                path.display()
            )));
        }
    }
    let hidden = count("hidden_size")?;
    let n_q_heads = count("num_attention_heads")?;
    let n_kv_heads = c["num_key_value_heads"]
        .as_u64()
        .map_or(n_q_heads, |v| v as usize);
    // Most configs leave head_dim to hidden_size / heads; some set it apart (Mistral Nemo).
    let head_dim = match c["head_dim"].as_u64() {
        Some(hd) => hd as usize,
        None => hidden.checked_div(n_q_heads).unwrap_or(0),
    };
    let spec = ArchSpec {
        family,
        n_layers: count("num_hidden_layers")?,
        hidden,
        n_q_heads,
        n_kv_heads,
        head_dim,
        intermediate: count("intermediate_size")?,
        vocab: count("vocab_size")?,
        max_seq: count("max_position_embeddings")?.min(window.unwrap_or(usize::MAX)),
        rms_eps: c["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
        rope_theta: rope_theta as f32,
        qkv_bias,
        tied_embed: c["tie_word_embeddings"].as_bool().unwrap_or(false),
    };
    let invalid = |e: Error| match e {
        Error::InvalidSpec(m) => Error::Unsupported(format!("{}: {m}", path.display())),
        other => other,
    };
    spec.validate().map_err(invalid)?;
    rope_scaling
        .divisors(head_dim, spec.rope_theta)
        .map_err(invalid)?;
    Ok((spec, rope_scaling))
}

/// Where a family keeps its tensors in a checkpoint (names after `model.layers.{i}.` for a
/// layer's; a linear's without its `.weight`): Llama's, which Mistral and Qwen2 share, or
/// InternLM2's (its remote code's: one fused wqkv, w1 / w3 / w2 for gate / up / down).
struct Names {
    embed: &'static str,
    lm_head: &'static str,
    attn_norm: &'static str,
    ffn_norm: &'static str,
    qkv: QkvNames,
    /// o, gate, up, down.
    rest: [&'static str; 4],
}

/// q, k and v as three linears, or InternLM2's one wqkv in its grouped packing.
enum QkvNames {
    Separate([&'static str; 3]),
    Fused(&'static str),
}

impl Names {
    fn of(family: Family) -> &'static Self {
        const LLAMA: Names = Names {
            embed: "model.embed_tokens.weight",
            lm_head: "lm_head.weight",
            attn_norm: "input_layernorm.weight",
            ffn_norm: "post_attention_layernorm.weight",
            qkv: QkvNames::Separate(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            rest: [
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            ],
        };
        const INTERNLM2: Names = Names {
            embed: "model.tok_embeddings.weight",
            lm_head: "output.weight",
            attn_norm: "attention_norm.weight",
            ffn_norm: "ffn_norm.weight",
            qkv: QkvNames::Fused("attention.wqkv"),
            rest: [
                "attention.wo",
                "feed_forward.w1",
                "feed_forward.w3",
                "feed_forward.w2",
            ],
        };
        match family {
            Family::LlamaSwiglu => &LLAMA,
            Family::InternlmGqa => &INTERNLM2,
        }
    }

    fn linears(&self) -> Vec<&'static str> {
        let qkv = match self.qkv {
            QkvNames::Separate(three) => three.to_vec(),
            QkvNames::Fused(one) => vec![one],
        };
        qkv.into_iter().chain(self.rest).collect()
    }
}

/// Loads a Hugging Face model directory, with `admit` judging the shape before any weight
/// is read.
pub fn load(dir: &Path, admit: super::Admit) -> Result<HostModel> {
    let (mut spec, rope_scaling) = spec_from_config(dir)?;
    let shards = Shards::open(dir)?;
    let names = Names::of(spec.family);
    let (h, kv, inter, q) = (spec.hidden, spec.kv_dim(), spec.intermediate, spec.q_dim());
    // Some tied checkpoints still ship their lm_head; an untied one must.
    if spec.tied_embed && shards.has(names.lm_head) {
        spec.tied_embed = false;
    }
    shards.every_tensor_is_read(dir, &spec, names)?;
    admit(&spec)?;
    let [o, gate, up, down] = names.rest;
    let mut layers = Vec::with_capacity(spec.n_layers);
    for i in 0..spec.n_layers {
        let p = |t: &str| format!("model.layers.{i}.{t}");
        let weight = |linear: &str, rows: usize, cols: usize| {
            shards.matrix(&p(&format!("{linear}.weight")), rows, cols)
        };
        let linear = |t: &str, rows: usize| -> Result<Linear> {
            Ok(Linear {
                weight: weight(t, rows, h)?,
                bias: if spec.qkv_bias {
                    Some(shards.vector(&p(&format!("{t}.bias")), rows)?)
                } else {
                    None
                },
            })
        };
        let qkv = match names.qkv {
            QkvNames::Separate([q_proj, k_proj, v_proj]) => QkvWeights::Separate {
                q: linear(q_proj, q)?,
                k: linear(k_proj, kv)?,
                v: linear(v_proj, kv)?,
            },
            QkvNames::Fused(wqkv) => QkvWeights::InternlmFused {
                wqkv: weight(wqkv, spec.qkv_rows(), h)?,
            },
        };
        layers.push(Layer {
            attn_norm: shards.norm(&p(names.attn_norm), h)?,
            qkv,
            o: weight(o, h, q)?,
            ffn_norm: shards.norm(&p(names.ffn_norm), h)?,
            gate: weight(gate, inter, h)?,
            up: weight(up, inter, h)?,
            down: weight(down, h, inter)?,
        });
    }
    let model = HostModel {
        spec,
        embed: shards.matrix(names.embed, spec.vocab, h)?,
        layers,
        final_norm: shards.norm("model.norm.weight", h)?,
        lm_head: if spec.tied_embed {
            None
        } else {
            Some(shards.matrix(names.lm_head, spec.vocab, h)?)
        },
        rope_scaling,
    };
    model.validate()?;
    Ok(model)
}
