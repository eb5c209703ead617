//! Sampling (issue 34), the CPU reference: draws match the exact truncated, renormalized
//! distribution (chi-square); the same seed gives the same ids whatever the batching;
//! temperature 0 is the greedy decode.

mod common;

use decodev2::engine::{BackendKind, Engine, EngineOptions};
use decodev2::sampling::Sampling;

const LOGITS: [f32; 12] = [
    2.0, 1.5, 1.4, 0.3, -0.2, 0.0, 1.0, -1.0, 0.7, 0.9, -3.0, 0.2,
];

/// The distribution the settings define over LOGITS, written out independently of the
/// library: temperature, then top-k, top-p, min-p over the ids by decreasing logit.
fn expected(s: &Sampling) -> Vec<f64> {
    let mut order: Vec<usize> = (0..LOGITS.len()).collect();
    order.sort_by(|&a, &b| LOGITS[b].partial_cmp(&LOGITS[a]).unwrap().then(a.cmp(&b)));
    if s.top_k > 0 {
        order.truncate(s.top_k as usize);
    }
    let w: Vec<f64> = order
        .iter()
        .map(|&i| ((LOGITS[i] - LOGITS[order[0]]) as f64 / s.temperature as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut p: Vec<f64> = w.iter().map(|v| v / total).collect();
    let mut acc = 0.0;
    let mut keep = p.len();
    for (i, v) in p.iter().enumerate() {
        acc += v;
        if acc >= s.top_p as f64 {
            keep = i + 1;
            break;
        }
    }
    p.truncate(keep);
    let floor = p[0] * s.min_p as f64;
    let mut out = vec![0.0; LOGITS.len()];
    for (rank, v) in p.iter().enumerate() {
        if *v >= floor {
            out[order[rank]] = *v;
        }
    }
    let total: f64 = out.iter().sum();
    out.iter().map(|v| v / total).collect()
}

/// The chi-square critical value at p = 0.001 for `df` degrees of freedom (Wilson-Hilferty).
fn chi2_critical(df: f64) -> f64 {
    let z = 3.090; // the normal quantile of 0.999
    let a = 2.0 / (9.0 * df);
    df * (1.0 - a + z * a.sqrt()).powi(3)
}

#[test]
fn draws_match_the_truncated_distribution() {
    const DRAWS: usize = 200_000;
    let base = Sampling {
        temperature: 1.0,
        seed: 42,
        ..Sampling::default()
    };
    for s in [
        Sampling {
            temperature: 0.7,
            ..base
        },
        Sampling { top_k: 5, ..base },
        Sampling { top_p: 0.8, ..base },
        Sampling { min_p: 0.3, ..base },
        Sampling {
            temperature: 1.3,
            top_k: 8,
            top_p: 0.9,
            min_p: 0.05,
            seed: 9,
            ..base
        },
    ] {
        let want = expected(&s);
        let mut counts = vec![0usize; LOGITS.len()];
        for position in 0..DRAWS {
            counts[s.choose(&LOGITS, &[], position) as usize] += 1;
        }
        let mut chi2 = 0.0;
        let mut df = -1.0;
        for (i, (&c, &p)) in counts.iter().zip(&want).enumerate() {
            if p == 0.0 {
                assert_eq!(c, 0, "{s:?}: id {i} is outside the truncation");
                continue;
            }
            let e = p * DRAWS as f64;
            chi2 += (c as f64 - e).powi(2) / e;
            df += 1.0;
        }
        let critical = chi2_critical(df);
        println!("{s:?}: chi2 {chi2:.1} on {df} df (p = 0.001 at {critical:.1})");
        assert!(chi2 < critical, "{s:?}: chi2 {chi2} >= {critical}");
    }
}

fn cpu_engine() -> Engine {
    let opts = EngineOptions {
        backend: BackendKind::Cpu,
        max_seq: 96,
        ..EngineOptions::default()
    };
    Engine::load_synthetic("medium_llama", 1, &opts).unwrap()
}

fn decode(e: &mut Engine, prompt: &[u32], steps: usize, batched: bool) -> Vec<u32> {
    e.reset().unwrap();
    let mut ids = vec![e.prefill(prompt).unwrap()];
    if batched {
        let mut rest = vec![0u32; steps];
        let n = e.step_n(&mut rest).unwrap();
        ids.extend(&rest[..n]);
    } else {
        ids.extend((0..steps).map(|_| e.step().unwrap()));
    }
    ids
}

#[test]
fn the_same_seed_gives_the_same_ids_whatever_the_batching() {
    let mut e = cpu_engine();
    let prompt = [5, 17, 99, 3, 42];
    let greedy = decode(&mut e, &prompt, 24, true);
    let sampled = Sampling {
        temperature: 1.5,
        top_p: 0.95,
        repeat_penalty: 1.1,
        seed: 7,
        ..Sampling::default()
    };
    e.set_sampling(&sampled).unwrap();
    let a = decode(&mut e, &prompt, 24, true);
    let b = decode(&mut e, &prompt, 24, false);
    assert_eq!(a, b, "step_n(n) and n steps draw the same ids");
    assert_ne!(a, greedy, "sampling at temperature 1.5 changes the ids");
    e.set_sampling(&Sampling { seed: 8, ..sampled }).unwrap();
    assert_ne!(
        decode(&mut e, &prompt, 24, true),
        a,
        "another seed, other ids"
    );
    // Temperature 0 with any seed is the greedy decode, bit for bit.
    e.set_sampling(&Sampling {
        temperature: 0.0,
        ..sampled
    })
    .unwrap();
    let penalized = decode(&mut e, &prompt, 24, true);
    e.set_sampling(&Sampling {
        temperature: 0.0,
        seed: 99,
        top_k: 3,
        ..Sampling::default()
    })
    .unwrap();
    assert_eq!(decode(&mut e, &prompt, 24, true), greedy);
    println!("greedy    {greedy:?}\nsampled   {a:?}\npenalized {penalized:?}");
    // A refused setting leaves the last one in force.
    assert!(e
        .set_sampling(&Sampling {
            top_p: 0.0,
            ..sampled
        })
        .is_err());
    assert_eq!(decode(&mut e, &prompt, 24, true), greedy);
}

/// The CUDA backend samples only once its graph does: anything but greedy is refused there,
/// clearly, and the handle keeps decoding greedily.
#[test]
fn cuda_refuses_sampling_it_does_not_run() {
    let opts = EngineOptions {
        backend: BackendKind::Cuda,
        ..EngineOptions::default()
    };
    let Some(mut e) = common::cuda_or_skip(
        "CUDA engine for tiny_llama",
        Engine::load_synthetic("tiny_llama", 0, &opts),
    ) else {
        return;
    };
    let err = e
        .set_sampling(&Sampling {
            temperature: 0.8,
            ..Sampling::default()
        })
        .unwrap_err();
    assert!(
        err.to_string().contains("sampling on the cuda backend"),
        "{err}"
    );
    e.set_sampling(&Sampling::default()).unwrap();
    e.prefill(&[1, 2, 3]).unwrap();
    e.step().unwrap();
}
