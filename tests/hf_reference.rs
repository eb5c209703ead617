//! decodev2 against Hugging Face transformers, on model directories and references that
//! tests/hf/make_reference.py wrote (run it on a machine with torch + transformers, then
//! point DV2_HF_REF_DIR at its output). Without DV2_HF_REF_DIR: SKIP.
//!
//! For each model: greedy ids after the prompt equal transformers' (all of them, or the
//! reference's `compare_steps` first ones); the CPU backend's teacher-forced logits of each
//! recorded position are within the reference's cap of transformers', and CUDA's within the
//! oracle gates' cap of the CPU's (of transformers' where the CPU does not run). A reference with a `model` key (a GGUF file, from
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

/// The logit cap of a GPU backend against the CPU oracle's math (the oracle gates' cap).
const ORACLE_CAP: f32 = 0.05;

/// max |a - b| over every value of the rows.
fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// One backend's run of a model: whether its greedy ids are transformers' (a failure
/// description if not), and its teacher-forced logits at the reference's positions, or None
/// where the backend is absent (SKIP printed).
fn run_model(
    dir: &Path,
    reference: &serde_json::Value,
    backend: BackendKind,
) -> Option<(Option<String>, Vec<Vec<f32>>)> {
    let (prompt, greedy, seq) = (
        ids(&reference["prompt"]),
        ids(&reference["greedy"]),
        ids(&reference["sequence"]),
    );
    let (positions, vocab) = (
        reference["positions"].as_u64().unwrap() as usize,
        reference["vocab"].as_u64().unwrap() as usize,
    );
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
    let mut logits = Vec::with_capacity(positions);
    for id in seq.iter().take(positions) {
        e.prefill(&[*id]).unwrap();
        let mut row = vec![0f32; vocab];
        e.logits(&mut row).unwrap();
        logits.push(row);
    }
    let name = dir.file_name().unwrap().to_string_lossy();
    let same = got.iter().zip(&greedy).take_while(|(a, b)| a == b).count();
    print!(
        "{name} [{}]: load {load_s:.2} s, greedy ids equal for {same}/{} steps",
        e.backend_name(),
        greedy.len()
    );
    let ids_differ = (same < compare).then(|| {
        format!(
            "{name} [{backend:?}]: greedy ids differ from transformers at step {same} (need {compare})"
        )
    });
    Some((ids_differ, logits))
}

/// Checks one model: each backend's greedy ids are transformers', and the CPU backend (the
/// oracle's math) is within the reference's cap of transformers' logits. CUDA is held to the
/// CPU backend's logits within the oracle gates' cap, as every gate holds it; where the CPU
/// does not run (the 3B shape), to transformers' within the reference's cap. Returns the
/// failures.
fn check_model(dir: &Path) -> Vec<String> {
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let (positions, vocab, cap) = (
        reference["positions"].as_u64().unwrap() as usize,
        reference["vocab"].as_u64().unwrap() as usize,
        reference["cap"].as_f64().unwrap() as f32,
    );
    let transformers: Vec<Vec<f32>> = std::fs::read(dir.join("logits.f32"))
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect::<Vec<f32>>()
        .chunks_exact(vocab)
        .take(positions)
        .map(<[f32]>::to_vec)
        .collect();
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    let mut failures = Vec::new();
    let check = |what: &str, err: f32, cap: f32| {
        println!(", max |logit - {what}| over {positions} positions = {err:.4} (cap {cap})");
        (err > cap).then(|| format!("{name}: logit error {err} against {what} over cap {cap}"))
    };
    let large = name.contains("3b");
    let cpu = if large {
        None
    } else {
        run_model(dir, &reference, BackendKind::Cpu)
    };
    if let Some((ids_differ, logits)) = &cpu {
        failures.extend(check("transformers", max_diff(logits, &transformers), cap));
        failures.extend(ids_differ.clone());
    }
    if let Some((ids_differ, logits)) = run_model(dir, &reference, BackendKind::Cuda) {
        let failed = match &cpu {
            Some((_, cpu_logits)) => {
                print!(
                    ", max |logit - transformers| {:.4}",
                    max_diff(&logits, &transformers)
                );
                check("cpu", max_diff(&logits, cpu_logits), ORACLE_CAP)
            }
            None => check("transformers", max_diff(&logits, &transformers), cap),
        };
        failures.extend(failed);
        failures.extend(ids_differ);
    }
    failures
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
    let failures: Vec<String> = dirs.iter().flat_map(|dir| check_model(dir)).collect();
    assert!(failures.is_empty(), "{failures:#?}");
}
