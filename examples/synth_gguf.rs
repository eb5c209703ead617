//! Writes a preset's synthetic model as a GGUF file the way llama.cpp lays one out: Q4_0
//! linears and embedding, F32 norms and biases, the architecture's metadata keys. For
//! load-time measurements of the GGUF path (parse, Q4_0 dequantization, re-quantization to
//! NF4) where no model hub is reachable. No tokenizer is written.
//!
//!     cargo run --release --example synth_gguf -- PRESET SEED OUT.gguf
//!
//! The weights are the synthetic NF4 model's, dequantized and quantized again to Q4_0
//! (llama.cpp's `quantize_row_q4_0_ref`), so the file decodes close to, not exactly as,
//! `Engine::load_synthetic(PRESET, SEED)`.

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufWriter, Write};

use decodev2::arch::{preset, Family};
use decodev2::load::ggml::GgmlType;
use decodev2::model::QkvWeights;
use decodev2::nf4::Nf4Matrix;
use decodev2::synth;
use half::f16;

/// ggml's type ids of the two types written (the reader's `GgmlType::from_id`).
const F32_ID: u32 = 0;
const Q4_0_ID: u32 = 2;
/// Elements per Q4_0 block (an f16 scale, then 16 bytes of nibbles).
const QK: usize = GgmlType::Q4_0.block().0;
const ALIGN: usize = 32;

enum Data<'a> {
    Matrix(Cow<'a, Nf4Matrix>),
    Floats(Vec<f32>),
}

impl Data<'_> {
    /// ggml dims (the fastest first) and type.
    fn dims_and_type(&self) -> (Vec<usize>, u32) {
        match self {
            Data::Matrix(m) => (vec![m.cols, m.rows], Q4_0_ID),
            Data::Floats(v) => (vec![v.len()], F32_ID),
        }
    }

    fn bytes(&self) -> usize {
        let (ty, n) = match self {
            Data::Matrix(m) => (GgmlType::Q4_0, m.rows * m.cols),
            Data::Floats(v) => (GgmlType::F32, v.len()),
        };
        ty.bytes(n)
            .expect("whole blocks: NF4 rows are multiples of 64")
    }

    fn write(&self, out: &mut impl Write) -> std::io::Result<()> {
        match self {
            Data::Matrix(m) => {
                let mut row = vec![0f32; m.cols];
                let mut bytes = Vec::new();
                for r in 0..m.rows {
                    m.dequantize_row(r, &mut row);
                    bytes.clear();
                    row.chunks_exact(QK).for_each(|b| q4_0_block(b, &mut bytes));
                    out.write_all(&bytes)?;
                }
                Ok(())
            }
            Data::Floats(v) => v.iter().try_for_each(|x| out.write_all(&x.to_le_bytes())),
        }
    }
}

/// llama.cpp's `quantize_row_q4_0_ref` for one block of 32: the scale from the value of the
/// largest magnitude (its sign kept) over -8; element j in the low nibble of byte j, element
/// j + 16 in its high nibble.
fn q4_0_block(x: &[f32], out: &mut Vec<u8>) {
    let max = x
        .iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16::from_f32(d).to_le_bytes());
    for j in 0..QK / 2 {
        let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
        out.push(q(x[j]) | (q(x[j + QK / 2]) << 4));
    }
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, name, seed, path] = &args[..] else {
        eprintln!("usage: synth_gguf PRESET SEED OUT.gguf");
        std::process::exit(2);
    };
    let spec = preset(name).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        spec.family == Family::LlamaSwiglu,
        "{name}: only llama-family presets are written"
    );
    let t = std::time::Instant::now();
    let model = synth::build(&spec, seed.parse().expect("seed")).expect("synthetic model");
    let built_s = t.elapsed().as_secs_f64();
    let arch = if spec.qkv_bias { "qwen2" } else { "llama" };
    let key = |k: &str| format!("{arch}.{k}");
    let u32s = [
        ("block_count", spec.n_layers),
        ("context_length", spec.max_seq),
        ("embedding_length", spec.hidden),
        ("feed_forward_length", spec.intermediate),
        ("attention.head_count", spec.n_q_heads),
        ("attention.head_count_kv", spec.n_kv_heads),
    ];
    let f32s = [
        ("attention.layer_norm_rms_epsilon", spec.rms_eps),
        ("rope.freq_base", spec.rope_theta),
    ];

    let norm = |v: &[half::bf16]| Data::Floats(v.iter().map(|x| x.to_f32()).collect());
    let matrix = |m| Data::Matrix(Cow::Borrowed(m));
    // llama's q and k rows in llama.cpp's order (row i of a head's first half at 2i, of its
    // second half at 2i + 1: the loader undoes it); qwen2's as they are.
    let llama_order = |m: &Nf4Matrix| -> Data<'static> {
        let (hd, half) = (spec.head_dim, spec.head_dim / 2);
        let rows: Vec<usize> = (0..m.rows)
            .map(|r| {
                let (head, j) = (r / hd, r % hd);
                head * hd + if j % 2 == 0 { j / 2 } else { j / 2 + half }
            })
            .collect();
        Data::Matrix(Cow::Owned(m.select_rows(&rows)))
    };
    let mut tensors: Vec<(String, Data)> = vec![
        ("token_embd.weight".into(), matrix(&model.embed)),
        ("output_norm.weight".into(), norm(&model.final_norm)),
    ];
    if let Some(head) = &model.lm_head {
        tensors.push(("output.weight".into(), matrix(head)));
    }
    for (i, layer) in model.layers.iter().enumerate() {
        let p = |t: &str| format!("blk.{i}.{t}");
        let QkvWeights::Separate { q, k, v } = &layer.qkv else {
            panic!("{name}: fused q/k/v are not written")
        };
        tensors.push((p("attn_norm.weight"), norm(&layer.attn_norm)));
        for (t, linear, permuted) in [
            ("attn_q", q, true),
            ("attn_k", k, true),
            ("attn_v", v, false),
        ] {
            let weight = if permuted && arch == "llama" {
                llama_order(&linear.weight)
            } else {
                matrix(&linear.weight)
            };
            tensors.push((p(&format!("{t}.weight")), weight));
            if let Some(bias) = &linear.bias {
                tensors.push((p(&format!("{t}.bias")), Data::Floats(bias.clone())));
            }
        }
        tensors.push((p("attn_output.weight"), matrix(&layer.o)));
        tensors.push((p("ffn_norm.weight"), norm(&layer.ffn_norm)));
        tensors.push((p("ffn_gate.weight"), matrix(&layer.gate)));
        tensors.push((p("ffn_up.weight"), matrix(&layer.up)));
        tensors.push((p("ffn_down.weight"), matrix(&layer.down)));
    }

    // Header, metadata, tensor infos (offsets from the data section's start, each aligned).
    let mut head = b"GGUF".to_vec();
    head.extend(3u32.to_le_bytes());
    head.extend((tensors.len() as u64).to_le_bytes());
    head.extend(((2 + u32s.len() + f32s.len()) as u64).to_le_bytes());
    string(&mut head, "general.architecture");
    head.extend(8u32.to_le_bytes());
    string(&mut head, arch);
    string(&mut head, "general.name");
    head.extend(8u32.to_le_bytes());
    string(&mut head, &format!("decodev2 synthetic {name} seed {seed}"));
    for (k, v) in u32s {
        string(&mut head, &key(k));
        head.extend(4u32.to_le_bytes());
        head.extend((v as u32).to_le_bytes());
    }
    for (k, v) in f32s {
        string(&mut head, &key(k));
        head.extend(6u32.to_le_bytes());
        head.extend(v.to_le_bytes());
    }
    let mut offset = 0usize;
    for (n, data) in &tensors {
        let (dims, ty) = data.dims_and_type();
        string(&mut head, n);
        head.extend((dims.len() as u32).to_le_bytes());
        dims.iter()
            .for_each(|d| head.extend((*d as u64).to_le_bytes()));
        head.extend(ty.to_le_bytes());
        head.extend((offset as u64).to_le_bytes());
        offset += data.bytes().next_multiple_of(ALIGN);
    }
    head.resize(head.len().next_multiple_of(ALIGN), 0);

    let t = std::time::Instant::now();
    let mut out = BufWriter::new(File::create(path)?);
    out.write_all(&head)?;
    for (_, data) in &tensors {
        data.write(&mut out)?;
        out.write_all(&[0u8; ALIGN][..data.bytes().next_multiple_of(ALIGN) - data.bytes()])?;
    }
    out.flush()?;
    println!(
        "built in {built_s:.1} s, wrote {path} ({:.2} GB, {} tensors) in {:.1} s",
        (head.len() + offset) as f64 / 1e9,
        tensors.len(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
