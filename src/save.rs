//! Writes a model as a Hugging Face directory with bitsandbytes 4-bit (nf4) linears: what
//! transformers saves for a model loaded with `load_in_4bit`, so that transformers +
//! bitsandbytes read it, and decodev2 reads it back with no re-quantization
//! (src/load/hf/bnb.rs). A GGUF or 16-bit model is converted once and loads fast afterwards.
//!
//! The linears keep their NF4 codes byte for byte and their block scales (f16, src/nf4.rs)
//! exactly, as the f32 bitsandbytes stores (blocksize 64, no nested quantization); their quant
//! state, the compute dtype and `torch_dtype` say float32, so that transformers computes with
//! the values decodev2 holds, not bf16 roundings of them. The embedding and an untied
//! lm_head, which transformers keeps in 16 bits, are written as the f32 values of their NF4
//! codes: exact, and re-quantized by decodev2 to the same codes and scales (each block's
//! largest value is its f16 scale times ±1). Norms are bf16,
//! biases f32. InternLM2's fused wqkv is written as q, k and v (a Llama); the tokenizer is not
//! written (copy tokenizer.json and tokenizer_config.json beside it where the source has them).

use std::collections::BTreeMap;
use std::path::Path;

use half::slice::HalfFloatSliceExt;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use crate::error::{Error, Result};
use crate::model::{internlm_wqkv_rows, HostModel, QkvWeights};
use crate::nf4::{Nf4Matrix, BLOCK, CODEBOOK};
use crate::rope::RopeScaling;

/// A tensor to write: dtype, shape, little-endian bytes.
struct Tensor(Dtype, Vec<usize>, Vec<u8>);

fn le_f32(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Writes `model` to the directory `dir` (created if missing): config.json and
/// model.safetensors.
pub fn write_bnb_dir(model: &HostModel, dir: &Path) -> Result<()> {
    model.validate()?;
    // Before any weight is written: a model config.json cannot describe is refused whole.
    let config = config(model)?;
    let s = &model.spec;
    let io = |e: std::io::Error| Error::Io(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut tensors: BTreeMap<String, Tensor> = BTreeMap::new();
    let mut nf4 = |name: String, m: &Nf4Matrix| {
        let state = json!({
            "quant_type": "nf4",
            "blocksize": BLOCK,
            "dtype": "float32",
            "shape": [m.rows, m.cols],
        });
        let state = state.to_string().into_bytes();
        let entries = [
            (
                format!("{name}.quant_state.bitsandbytes__nf4"),
                Tensor(Dtype::U8, vec![state.len()], state),
            ),
            (
                format!("{name}.absmax"),
                Tensor(
                    Dtype::F32,
                    vec![m.absmax.len()],
                    le_f32(&m.absmax.to_f32_vec()),
                ),
            ),
            (
                format!("{name}.quant_map"),
                Tensor(Dtype::F32, vec![CODEBOOK.len()], le_f32(&CODEBOOK)),
            ),
            (
                name,
                Tensor(Dtype::U8, vec![m.packed.len(), 1], m.packed.to_vec()),
            ),
        ];
        tensors.extend(entries);
    };
    for (i, layer) in model.layers.iter().enumerate() {
        let p = |t: &str| format!("model.layers.{i}.{t}");
        match &layer.qkv {
            QkvWeights::Separate { q, k, v } => {
                for (t, linear) in [("q_proj", q), ("k_proj", k), ("v_proj", v)] {
                    nf4(p(&format!("self_attn.{t}.weight")), &linear.weight);
                }
            }
            QkvWeights::InternlmFused { wqkv } => {
                let rows = internlm_wqkv_rows(s);
                let (q, rest) = rows.split_at(s.q_dim());
                let (k, v) = rest.split_at(s.kv_dim());
                for (t, r) in [("q_proj", q), ("k_proj", k), ("v_proj", v)] {
                    nf4(p(&format!("self_attn.{t}.weight")), &wqkv.select_rows(r));
                }
            }
        }
        nf4(p("self_attn.o_proj.weight"), &layer.o);
        nf4(p("mlp.gate_proj.weight"), &layer.gate);
        nf4(p("mlp.up_proj.weight"), &layer.up);
        nf4(p("mlp.down_proj.weight"), &layer.down);
    }
    let bf16_bytes =
        |w: &[half::bf16]| -> Vec<u8> { w.iter().flat_map(|v| v.to_le_bytes()).collect() };
    for (i, layer) in model.layers.iter().enumerate() {
        let p = |t: &str| format!("model.layers.{i}.{t}");
        let norms = [
            ("input_layernorm.weight", &layer.attn_norm),
            ("post_attention_layernorm.weight", &layer.ffn_norm),
        ];
        for (t, w) in norms {
            tensors.insert(p(t), Tensor(Dtype::BF16, vec![w.len()], bf16_bytes(w)));
        }
        if let QkvWeights::Separate { q, k, v } = &layer.qkv {
            for (t, linear) in [("q_proj", q), ("k_proj", k), ("v_proj", v)] {
                if let Some(b) = &linear.bias {
                    let name = p(&format!("self_attn.{t}.bias"));
                    tensors.insert(name, Tensor(Dtype::F32, vec![b.len()], le_f32(b)));
                }
            }
        }
    }
    let dense = |m: &Nf4Matrix| {
        let mut values = vec![0f32; m.rows * m.cols];
        for (r, row) in values.chunks_exact_mut(m.cols).enumerate() {
            m.dequantize_row(r, row);
        }
        Tensor(Dtype::F32, vec![m.rows, m.cols], le_f32(&values))
    };
    tensors.insert("model.embed_tokens.weight".into(), dense(&model.embed));
    if let Some(head) = &model.lm_head {
        tensors.insert("lm_head.weight".into(), dense(head));
    }
    let w = &model.final_norm;
    tensors.insert(
        "model.norm.weight".into(),
        Tensor(Dtype::BF16, vec![w.len()], bf16_bytes(w)),
    );

    let views = tensors
        .iter()
        .map(|(name, Tensor(dtype, shape, bytes))| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| Error::Internal(format!("tensor {name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = Some([("format".to_string(), "pt".to_string())].into());
    safetensors::serialize_to_file(views, metadata, &dir.join("model.safetensors"))
        .map_err(|e| Error::Io(format!("{}: {e}", dir.display())))?;
    std::fs::write(dir.join("config.json"), config.to_string()).map_err(io)
}

/// An integer where `v` is one, as transformers' validation expects of a length.
fn whole(v: f32) -> serde_json::Value {
    if v.fract() == 0.0 {
        json!(v as u64)
    } else {
        json!(v)
    }
}

/// config.json's `rope_scaling` for `scaling`, in the form transformers reads. A GGUF's
/// per-pair divisors have none unless they are all one factor (linear).
fn rope_scaling(scaling: &RopeScaling) -> Result<serde_json::Value> {
    Ok(match scaling {
        RopeScaling::None => serde_json::Value::Null,
        // Plain frequencies up to max_position_embeddings (config() writes the model's
        // max_seq there, at most the horizon read); transformers raises the base only past it.
        RopeScaling::DynamicNtk { factor, .. } => json!({"rope_type": "dynamic", "factor": factor}),
        RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": whole(*original_max_position),
        }),
        RopeScaling::Yarn {
            factor,
            original_max_position,
            beta_fast,
            beta_slow,
            truncate,
            attention_factor,
        } => json!({
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": whole(*original_max_position),
            "beta_fast": beta_fast,
            "beta_slow": beta_slow,
            "truncate": truncate,
            "attention_factor": attention_factor,
        }),
        RopeScaling::Divisors(d) => match d.first() {
            Some(&factor) if d.iter().all(|&v| v == factor) => {
                json!({"rope_type": "linear", "factor": factor})
            }
            _ => {
                return Err(Error::Unsupported(
                    "RoPE divisors a frequency pair (a GGUF's rope_freqs.weight) have no \
                     config.json form: convert the Hugging Face checkpoint instead"
                        .into(),
                ))
            }
        },
    })
}

/// config.json for `model`: Qwen2 where it has q/k/v biases, else Llama.
fn config(model: &HostModel) -> Result<serde_json::Value> {
    let s = &model.spec;
    let (arch, model_type) = if s.qkv_bias {
        ("Qwen2ForCausalLM", "qwen2")
    } else {
        ("LlamaForCausalLM", "llama")
    };
    Ok(json!({
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.n_layers,
        "num_attention_heads": s.n_q_heads,
        "num_key_value_heads": s.n_kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab,
        "max_position_embeddings": s.max_seq,
        "rms_norm_eps": s.rms_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": rope_scaling(&model.rope_scaling)?,
        "tie_word_embeddings": s.tied_embed,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": "float32",
        "quantization_config": {
            "quant_method": "bitsandbytes",
            "load_in_4bit": true,
            "load_in_8bit": false,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": false,
            "bnb_4bit_compute_dtype": "float32",
            "bnb_4bit_quant_storage": "uint8",
            "llm_int8_skip_modules": ["lm_head"],
        },
    }))
}
