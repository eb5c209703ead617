//! bitsandbytes 4-bit directories (issue 31): a model written by decodev2's writer loads back
//! with the same codes and the same logits; the nested (double-quantized) scales decode as
//! bitsandbytes decodes them; fp4, other block sizes, another codebook and other quantization
//! methods are refused naming what was found. transformers + bitsandbytes read and write the
//! same directories in tests/gpu/bnb-check.py (the GPU machine; docs/lab.md).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use decodev2::arch::{preset, TINY_LLAMA};
use decodev2::engine::{BackendKind, Engine, EngineOptions};
use decodev2::load::load;
use decodev2::model::{HostModel, QkvWeights};
use decodev2::nf4::Codes;
use decodev2::oracle::{step_logits, KvCache};
use decodev2::rope::RopeScaling;
use decodev2::save::write_bnb_dir;
use decodev2::{synth, Error};
use half::f16;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir()
        .join(format!("dv2-bnb-{}", std::process::id()))
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The oracle's logits at every position of a fixed prompt.
fn logits(model: &HostModel) -> Vec<Vec<f32>> {
    let prompt = synth::prompt(model.spec.vocab, 6, 3);
    let mut kv = KvCache::new(&model.spec, model.spec.max_seq).unwrap();
    step_logits(model, &mut kv, &prompt, 0).unwrap()
}

/// Written and read back: every linear's codes and scales byte for byte (InternLM2's wqkv as
/// q, k and v), the embedding and lm_head re-quantized to the same codes, norms and biases
/// equal, so the oracle's logits are bit for bit the same.
#[test]
fn a_written_directory_loads_back_with_the_same_codes() {
    let mut qwen_like = TINY_LLAMA;
    qwen_like.qkv_bias = true;
    qwen_like.tied_embed = true;
    // Heads set apart from hidden / heads (Mistral Nemo's form): q and o 128 wide over 64.
    let mut wide_heads = TINY_LLAMA;
    wide_heads.head_dim = 32;
    let cases = [
        ("tiny_llama", preset("tiny_llama").unwrap()),
        ("tiny_internlm", preset("tiny_internlm").unwrap()),
        ("medium_llama", preset("medium_llama").unwrap()),
        ("qwen_like", qwen_like),
        ("wide_heads", wide_heads),
    ];
    for (name, spec) in cases {
        let model = synth::build(&spec, 7).unwrap();
        let d = dir(name);
        write_bnb_dir(&model, &d).unwrap();
        let back = load(&d).unwrap();
        assert_eq!(back.embed, model.embed, "{name}: embedding");
        assert_eq!(back.lm_head, model.lm_head, "{name}: lm_head");
        assert_eq!(back.final_norm, model.final_norm, "{name}: final norm");
        for (l, (a, b)) in back.layers.iter().zip(&model.layers).enumerate() {
            assert_eq!(
                (&a.o, &a.gate, &a.up, &a.down),
                (&b.o, &b.gate, &b.up, &b.down),
                "{name} layer {l}"
            );
            assert_eq!(
                (&a.attn_norm, &a.ffn_norm),
                (&b.attn_norm, &b.ffn_norm),
                "{name} layer {l}"
            );
            match (&a.qkv, &b.qkv) {
                (
                    QkvWeights::Separate { q, k, v },
                    QkvWeights::Separate {
                        q: q2,
                        k: k2,
                        v: v2,
                    },
                ) => {
                    for (x, y) in [(q, q2), (k, k2), (v, v2)] {
                        assert_eq!(x.weight, y.weight, "{name} layer {l}");
                        assert_eq!(x.bias, y.bias, "{name} layer {l}");
                    }
                }
                (QkvWeights::Separate { .. }, QkvWeights::InternlmFused { .. }) => {}
                _ => panic!("{name}: a fused wqkv read back"),
            }
        }
        assert_eq!(logits(&back), logits(&model), "{name}: logits");
    }
}

/// A model's RoPE scaling is written as config.json's `rope_scaling` and read back the same
/// (its logits too); per-pair divisors that no `rope_scaling` expresses are refused before
/// anything is written.
#[test]
fn rope_scaling_is_written_and_read_back() {
    let mut model = synth::build(&TINY_LLAMA, 7).unwrap();
    for (name, scaling) in [
        (
            "llama3",
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 32.0,
            },
        ),
        ("linear", RopeScaling::Linear { factor: 2.5 }),
        (
            "dynamic",
            RopeScaling::DynamicNtk {
                factor: 2.0,
                max_position: TINY_LLAMA.max_seq,
            },
        ),
        (
            "yarn",
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_position: 8.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                truncate: false,
                attention_factor: 1.2,
            },
        ),
        ("one-factor", RopeScaling::Divisors(vec![3.0f32; 8].into())),
    ] {
        model.rope_scaling = scaling;
        let d = dir(name);
        write_bnb_dir(&model, &d).unwrap();
        let back = load(&d).unwrap();
        let want = match &model.rope_scaling {
            RopeScaling::Divisors(_) => RopeScaling::Linear { factor: 3.0 },
            other => other.clone(),
        };
        assert_eq!(back.rope_scaling, want, "{name}");
        assert_eq!(logits(&back), logits(&model), "{name}: logits");
    }
    model.rope_scaling = RopeScaling::Divisors((1..=8).map(|d| d as f32).collect());
    let d = dir("divisors");
    let err = write_bnb_dir(&model, &d).unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported(m) if m.contains("rope_freqs")),
        "{err}"
    );
    assert!(!d.join("model.safetensors").exists());
}

/// The tensors of a safetensors file, to edit and write again.
type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

/// A linear's codes are read where they lie in the file's map, with no copy at load; an engine
/// on the CPU, which keeps the model past the load, holds its own copy: the file truncated
/// after the load (as replacing a download in place would) changes nothing it decodes.
#[test]
fn codes_come_from_the_map_and_a_cpu_engine_owns_its_copy() {
    let model = synth::build(&TINY_LLAMA, 7).unwrap();
    let d = dir("mapped");
    write_bnb_dir(&model, &d).unwrap();
    let back = load(&d).unwrap();
    assert!(
        matches!(back.layers[0].gate.packed, Codes::Mapped(_)),
        "{:?}",
        back.layers[0].gate.packed
    );
    assert_eq!(back.layers[0].gate, model.layers[0].gate);
    drop(back);
    let opts = EngineOptions {
        backend: BackendKind::Cpu,
        ..EngineOptions::default()
    };
    let decode = |e: &mut Engine| -> Vec<u32> {
        let first = e.prefill(&synth::prompt(TINY_LLAMA.vocab, 6, 3)).unwrap();
        std::iter::once(first)
            .chain((0..8).map(|_| e.step().unwrap()))
            .collect()
    };
    let mut loaded = Engine::load_file(&d, &opts).unwrap();
    let want = decode(&mut Engine::new(model, &opts).unwrap());
    std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("model.safetensors"))
        .unwrap()
        .set_len(0)
        .unwrap();
    assert_eq!(decode(&mut loaded), want);
}

fn read_tensors(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn write_tensors(path: &Path, tensors: &Tensors) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

const DOWN: &str = "model.layers.0.mlp.down_proj.weight";

/// tiny_llama written, with `edit` applied to its tensors; the load's result.
fn load_edited(
    name: &str,
    edit: impl FnOnce(&mut Tensors),
) -> (HostModel, decodev2::Result<HostModel>) {
    let model = synth::build(&preset("tiny_llama").unwrap(), 1).unwrap();
    let d = dir(name);
    write_bnb_dir(&model, &d).unwrap();
    let file = d.join("model.safetensors");
    let mut tensors = read_tensors(&file);
    edit(&mut tensors);
    write_tensors(&file, &tensors);
    (model, load(&d))
}

fn set_state(t: &mut Tensors, name: &str, state: serde_json::Value) {
    let bytes = state.to_string().into_bytes();
    t.insert(
        format!("{name}.quant_state.bitsandbytes__nf4"),
        (Dtype::U8, vec![bytes.len()], bytes),
    );
}

/// Nested scales: an 8-bit code per block into a 256-entry map, times its group's scale, plus
/// the offset, in f32 as bitsandbytes computes them, then kept in f16 as every NF4 scale is;
/// groups of 4 blocks here (bitsandbytes uses 256), so that several groups are read.
#[test]
fn nested_scales_decode_as_bitsandbytes_does() {
    let map: Vec<f32> = (0..256).map(|i| (i as f32 - 127.5) / 128.0).collect();
    let (group, offset) = (4usize, 0.375f32);
    let mut want = Vec::new();
    let (_, loaded) = load_edited("nested", |t| {
        let blocks = t[&format!("{DOWN}.absmax")].2.len() / 4;
        let codes: Vec<u8> = (0..blocks).map(|b| (b * 37 % 256) as u8).collect();
        let scales: Vec<f32> = (0..blocks.div_ceil(group))
            .map(|g| 0.5 + g as f32 * 0.25)
            .collect();
        want = codes
            .iter()
            .enumerate()
            .map(|(b, &c)| f16::from_f32(map[c as usize] * scales[b / group] + offset))
            .collect();
        t.insert(format!("{DOWN}.absmax"), (Dtype::U8, vec![blocks], codes));
        t.insert(
            format!("{DOWN}.nested_absmax"),
            (Dtype::F32, vec![scales.len()], f32_bytes(&scales)),
        );
        t.insert(
            format!("{DOWN}.nested_quant_map"),
            (Dtype::F32, vec![256], f32_bytes(&map)),
        );
        let s = TINY_LLAMA;
        set_state(
            t,
            DOWN,
            serde_json::json!({"quant_type": "nf4", "blocksize": 64, "dtype": "float32",
            "shape": [s.hidden, s.intermediate], "nested_blocksize": group, "nested_dtype": "float32",
            "nested_offset": offset}),
        );
    });
    let loaded = loaded.unwrap();
    assert_eq!(loaded.layers[0].down.absmax, want);
}

#[test]
fn what_bitsandbytes_stores_otherwise_is_refused_by_name() {
    const S: decodev2::arch::ArchSpec = TINY_LLAMA;
    let state = |blocksize: usize| {
        serde_json::json!({"quant_type": "nf4", "blocksize": blocksize,
        "dtype": "float32", "shape": [S.hidden, S.intermediate]})
    };
    type Edit = Box<dyn FnOnce(&mut Tensors)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "fp4",
            Box::new(|t: &mut Tensors| {
                let v = t
                    .remove(&format!("{DOWN}.quant_state.bitsandbytes__nf4"))
                    .unwrap();
                t.insert(format!("{DOWN}.quant_state.bitsandbytes__fp4"), v);
            }),
            "fp4",
        ),
        (
            "blocksize",
            Box::new(move |t: &mut Tensors| set_state(t, DOWN, state(128))),
            "blocksize 128",
        ),
        (
            "codebook",
            Box::new(|t: &mut Tensors| {
                let mut map = decodev2::nf4::CODEBOOK;
                map[3] += 0.01;
                t.insert(
                    format!("{DOWN}.quant_map"),
                    (Dtype::F32, vec![16], f32_bytes(&map)),
                );
            }),
            "not the NF4 codebook",
        ),
        (
            "shape",
            Box::new(move |t: &mut Tensors| {
                let mut st = state(64);
                st["shape"] = serde_json::json!([S.intermediate, S.hidden]);
                set_state(t, DOWN, st);
            }),
            "quant_state shape",
        ),
        (
            "codes",
            Box::new(|t: &mut Tensors| {
                let codes = t.get_mut(DOWN).unwrap();
                codes.2.truncate(10);
                codes.1 = vec![10, 1];
            }),
            "bytes of codes",
        ),
        (
            "scale",
            Box::new(|t: &mut Tensors| {
                let absmax = t.get_mut(&format!("{DOWN}.absmax")).unwrap();
                absmax.2[4..8].copy_from_slice(&1.0e6f32.to_le_bytes());
            }),
            "block 1 has scale 1000000, which an f16 scale does not hold",
        ),
    ];
    for (name, edit, expect) in cases {
        let (_, loaded) = load_edited(name, edit);
        let err = loaded.err().unwrap_or_else(|| panic!("{name}: loaded"));
        assert!(err.to_string().contains(expect), "{name}: {err}");
        assert!(
            err.to_string().contains(DOWN) || name == "shape" && err.to_string().contains("down"),
            "{name}: {err}"
        );
    }
}

#[test]
fn other_quantization_methods_are_refused() {
    let model = synth::build(&preset("tiny_llama").unwrap(), 1).unwrap();
    for (name, q) in [
        (
            "gptq",
            serde_json::json!({"quant_method": "gptq", "bits": 4}),
        ),
        (
            "int8",
            serde_json::json!({"quant_method": "bitsandbytes", "load_in_8bit": true}),
        ),
        (
            "fp4",
            serde_json::json!({"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "fp4"}),
        ),
    ] {
        let d = dir(&format!("method-{name}"));
        write_bnb_dir(&model, &d).unwrap();
        let path = d.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config["quantization_config"] = q;
        std::fs::write(&path, config.to_string()).unwrap();
        match load(&d) {
            Err(Error::Unsupported(m)) => assert!(m.contains("quantization_config"), "{name}: {m}"),
            other => panic!("{name}: {:?}", other.map(|_| ())),
        }
    }
}
