//! decodev2 against Hugging Face transformers, on model directories and references that
//! tests/hf/make_reference.py wrote (run it on a machine with torch + transformers, then
//! point DV2_HF_REF_DIR at its output). Without DV2_HF_REF_DIR: SKIP.
//!
//! For each model: greedy ids after the prompt equal transformers' (all of them, or the
//! reference's `compare_steps` first ones), and the teacher-forced logits of each recorded
//! position are within the reference's cap. A reference with a `model` key (a GGUF file, from
//! tests/hf/gguf_reference.py) loads that file instead of the directory.

use std::path::Path;

use decodev2::engine::{BackendKind, Engine, EngineOptions};
use decodev2::Error;

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Compares one model; returns a failure description, or None when it passes or skips.
fn check_model(dir: &Path, backend: BackendKind) -> Option<String> {
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let (prompt, greedy, seq) = (
        ids(&reference["prompt"]),
        ids(&reference["greedy"]),
        ids(&reference["sequence"]),
    );
    let (positions, vocab, cap) = (
        reference["positions"].as_u64().unwrap() as usize,
        reference["vocab"].as_u64().unwrap() as usize,
        reference["cap"].as_f64().unwrap() as f32,
    );
    let want_logits: Vec<f32> = std::fs::read(dir.join("logits.f32"))
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let compare = reference["compare_steps"]
        .as_u64()
        .map_or(greedy.len(), |n| n as usize);
    let model_path = reference["model"]
        .as_str()
        .map_or(dir.to_path_buf(), std::path::PathBuf::from);
    let opts = EngineOptions {
        backend,
        max_seq: 64,
        ..EngineOptions::default()
    };
    let t = std::time::Instant::now();
    let mut e = match Engine::load_file(&model_path, &opts) {
        Ok(e) => e,
        Err(Error::BackendUnavailable(why)) if std::env::var_os("DV2_REQUIRE_CUDA").is_none() => {
            println!("SKIP: {why}");
            return None;
        }
        Err(err) => panic!("{}: {err}", dir.display()),
    };
    let load_s = t.elapsed().as_secs_f64();
    let mut got = vec![e.prefill(&prompt).unwrap()];
    let mut rest = vec![0u32; greedy.len() - 1];
    e.step_n(&mut rest).unwrap();
    got.extend(rest);
    e.reset().unwrap();
    let mut err = 0f32;
    let mut logits = vec![0f32; vocab];
    for (p, id) in seq.iter().take(positions).enumerate() {
        e.prefill(&[*id]).unwrap();
        e.logits(&mut logits).unwrap();
        let want = &want_logits[p * vocab..(p + 1) * vocab];
        err = err.max(
            logits
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max),
        );
    }
    let name = dir.file_name().unwrap().to_string_lossy();
    let same = got.iter().zip(&greedy).take_while(|(a, b)| a == b).count();
    println!(
        "{name} [{}]: load {load_s:.2} s, greedy ids equal for {same}/{} steps, max |logit - transformers| over {positions} positions = {err:.4} (cap {cap})",
        e.backend_name(),
        greedy.len()
    );
    if same < compare {
        return Some(format!(
            "{name} [{backend:?}]: greedy ids differ from transformers at step {same} (need {compare})"
        ));
    }
    (err > cap).then(|| format!("{name} [{backend:?}]: logit error {err} over cap {cap}"))
}

#[test]
fn models_match_transformers() {
    let Some(root) = std::env::var_os("DV2_HF_REF_DIR") else {
        println!("SKIP: DV2_HF_REF_DIR not set (see tests/hf/make_reference.py)");
        return;
    };
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|d| d.unwrap().path())
        .filter(|p| p.join("reference.json").exists())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no references under {root:?}");
    let mut failures = Vec::new();
    for dir in dirs {
        let large = dir.to_string_lossy().contains("3b");
        failures.extend(check_model(&dir, BackendKind::Cuda));
        if !large {
            failures.extend(check_model(&dir, BackendKind::Cpu));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
