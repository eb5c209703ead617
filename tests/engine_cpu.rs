//! Engine semantics on the CPU backend: reset, EOS, capacity limits, bad calls.

mod common;

use common::*;
use decodev2::engine::{BackendKind, Engine, EngineOptions};
use decodev2::Error;

fn tiny_case() -> Case {
    case("tiny_internlm")
}

fn engine(eos: Option<u32>) -> Engine {
    let case = tiny_case();
    let opts = EngineOptions {
        eos,
        ..options(BackendKind::Cpu)
    };
    Engine::load_synthetic(&case.preset, case.seed, &opts).unwrap()
}

#[test]
fn reset_then_second_request_equals_a_fresh_engine() {
    let case = tiny_case();
    let mut used = engine(None);
    // A first, different request fills the KV cache with other content.
    used.prefill(&[9, 8, 7, 6, 5, 4]).unwrap();
    let mut junk = [0u32; 5];
    used.step_n(&mut junk).unwrap();
    let second = run_case(&mut used, &case);
    let fresh = run_case(&mut engine(None), &case);
    assert_eq!(second.greedy, fresh.greedy);
    assert_eq!(second.teacher_logits, fresh.teacher_logits);
    assert_eq!(second.greedy, case.greedy);
}

#[test]
fn eos_sets_finished_and_stops_the_loop() {
    let case = tiny_case();
    // EOS: the first greedy id, from the third on, not produced before (a few steps run first).
    let first = (2..case.greedy.len())
        .find(|&i| !case.greedy[..i].contains(&case.greedy[i]))
        .unwrap();
    let eos = case.greedy[first];
    let mut e = engine(Some(eos));
    let next = e.prefill(&case.prompt[..case.prefill_len]).unwrap();
    assert_eq!(next, case.greedy[0]);
    let mut out = [0u32; 8];
    let n = e.step_n(&mut out).unwrap();
    assert_eq!(n, first, "stops right after the step that produced EOS");
    assert_eq!(&out[..n], &case.greedy[1..=first]);
    assert!(e.finished().unwrap());
    assert_eq!(e.position().unwrap(), case.prefill_len + n);
    assert!(matches!(e.step(), Err(Error::Finished)));
    assert!(matches!(e.step_n(&mut out), Err(Error::Finished)));
    // Still usable: a reset starts over.
    e.reset().unwrap();
    assert!(!e.finished().unwrap());
    assert_eq!(
        e.prefill(&case.prompt[..case.prefill_len]).unwrap(),
        case.greedy[0]
    );
}

#[test]
fn prefill_past_max_seq_is_an_error_and_leaves_the_engine_usable() {
    let case = tiny_case();
    let mut e = engine(None);
    let max_seq = e.max_seq();
    let long: Vec<u32> = (0..max_seq as u32 + 1).map(|i| i % 32).collect();
    let err = e.prefill(&long).unwrap_err();
    assert!(matches!(err, Error::SequenceFull(_)), "{err}");
    assert!(err.to_string().contains("max_seq 16"), "{err}");
    assert_eq!(e.position().unwrap(), 0);
    let run = run_case(&mut e, &case);
    assert_eq!(run.greedy, case.greedy);
}

#[test]
fn stepping_to_max_seq_stops_with_sequence_full() {
    let mut e = engine(None);
    let max_seq = e.max_seq();
    e.prefill(&[1, 2, 3]).unwrap();
    let mut out = vec![0u32; 64];
    // step_n clips to the room left, then the next call is an error.
    assert_eq!(e.step_n(&mut out).unwrap(), max_seq - 3);
    assert_eq!(e.position().unwrap(), max_seq);
    assert!(matches!(e.step(), Err(Error::SequenceFull(_))));
    assert!(matches!(e.prefill(&[1]), Err(Error::SequenceFull(_))));
    e.reset().unwrap();
    assert_eq!(e.position().unwrap(), 0);
    e.prefill(&[1]).unwrap();
}

#[test]
fn a_prompt_of_exactly_max_seq_fits() {
    let mut e = engine(None);
    let ids: Vec<u32> = (0..16).collect();
    e.prefill(&ids).unwrap();
    assert_eq!(e.position().unwrap(), 16);
    assert!(matches!(e.step(), Err(Error::SequenceFull(_))));
}

#[test]
fn bad_calls_are_errors_not_panics() {
    let mut e = engine(None);
    assert!(matches!(e.step(), Err(Error::InvalidState(_))));
    assert!(matches!(e.next_token(), Err(Error::InvalidState(_))));
    assert!(matches!(
        e.logits(&mut [0.0; 32]),
        Err(Error::InvalidState(_))
    ));
    assert!(matches!(e.prefill(&[]), Err(Error::InvalidArgument(_))));
    let err = e.prefill(&[1, 32]).unwrap_err().to_string();
    assert!(err.contains("ids[1] = 32"), "{err}");
    e.prefill(&[1]).unwrap();
    assert!(matches!(
        e.logits(&mut [0.0; 31]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(e.step_n(&mut []), Err(Error::InvalidArgument(_))));
    let bad_eos = EngineOptions {
        eos: Some(32),
        ..options(BackendKind::Cpu)
    };
    assert!(matches!(
        Engine::load_synthetic("tiny_llama", 0, &bad_eos),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Engine::load_synthetic("nope", 0, &bad_eos),
        Err(Error::UnknownPreset(_))
    ));
}

#[test]
fn a_smaller_max_seq_option_is_honoured() {
    let opts = EngineOptions {
        max_seq: 6,
        ..options(BackendKind::Cpu)
    };
    let mut e = Engine::load_synthetic("tiny_llama", 0, &opts).unwrap();
    assert_eq!(e.max_seq(), 6);
    e.prefill(&[1, 2, 3, 4]).unwrap();
    let mut out = [0u32; 8];
    assert_eq!(e.step_n(&mut out).unwrap(), 2);
}

#[test]
fn a_max_seq_too_large_for_host_memory_is_an_error_not_an_abort() {
    let opts = EngineOptions {
        max_seq: i32::MAX as usize,
        ..options(BackendKind::Cpu)
    };
    // 2 layers x 2^31 slots x 32 floats x 2 (k, v) = 1 TiB of KV cache.
    let err = Engine::load_synthetic("tiny_llama", 0, &opts)
        .err()
        .expect("must fail");
    assert!(matches!(err, Error::OutOfMemory(_)), "{err:?}");
    assert!(err.to_string().contains("host memory"), "{err}");
}

/// medium_llama (vocab 128) on the CPU with room for the rewind tests' requests.
fn medium_engine() -> Engine {
    let opts = EngineOptions {
        max_seq: 64,
        ..options(BackendKind::Cpu)
    };
    Engine::load_synthetic("medium_llama", 1, &opts).unwrap()
}

/// A request rewound into its prompt, into its generated ids, to its whole position and to 0,
/// then continued, chooses the ids and computes the logits, bit for bit, of a fresh request
/// prefilled with the ids at its positions.
#[test]
fn a_rewound_request_continues_as_a_fresh_prefill_of_its_ids() {
    let mut e = medium_engine();
    let prompt: Vec<u32> = (0..20).map(|i| (i * 13 + 5) % 128).collect();
    let new = [3, 14, 15, 92, 65];
    for keep in [10, 23, 28, 0] {
        let r = decode_after_rewind(&mut e, &prompt, 8, keep, &new, 6);
        e.reset().unwrap();
        let mut ids = vec![e.prefill(&r.context).unwrap()];
        let mut logits = vec![vec![0f32; 128]];
        e.logits(&mut logits[0]).unwrap();
        for _ in 0..6 {
            ids.push(e.step().unwrap());
            let mut row = vec![0f32; 128];
            e.logits(&mut row).unwrap();
            logits.push(row);
        }
        assert_eq!(r.ids, ids, "keep {keep}");
        assert_eq!(r.logits, logits, "keep {keep}");
    }
}

#[test]
fn rewound_draws_follow_the_kept_history_on_the_cpu() {
    assert_eq!(
        rewound_draws_follow_the_kept_history(&mut medium_engine()),
        22
    );
}

#[test]
fn a_logit_bias_steers_the_draw_on_the_cpu() {
    assert_eq!(logit_bias_steers_the_draw(&mut medium_engine()), 18);
}

/// A request saved to a file and loaded by a fresh engine of the same model continues bit for
/// bit as the original does from the same position, penalties over the loaded history
/// included; a bad state file, another model's, or one too long for max_seq is refused and
/// the request goes on where it was.
#[test]
fn a_loaded_state_continues_the_request_bit_for_bit() {
    let dir = scratch("state-cpu");
    let path = dir.join("request.dv2state");
    let (pending, want) = save_a_request(&mut medium_engine(), &path);
    let mut fresh = medium_engine();
    let got = load_a_request(&mut fresh, &path, pending);
    assert_eq!(got.held, want.held);
    assert_eq!(got.logits, want.logits);
    assert_eq!(got.ids, want.ids);
    // The first id is the reference sampler's over the loaded history (the penalties read it).
    let history: Vec<u32> = got.held.iter().chain(&[pending]).copied().collect();
    let first = state_sampling().choose(&got.logits, &history, history.len());
    assert_eq!(got.ids[0], first);

    // The same state from memory: saved again, the file's bytes; continued, the same ids.
    let bytes = std::fs::read(&path).unwrap();
    let mut from_memory = medium_engine();
    let mut state = from_memory.open_state_bytes(&bytes).unwrap();
    from_memory.restore_state(&mut state).unwrap();
    assert_eq!(from_memory.state_size(), bytes.len());
    let mut again = vec![0u8; bytes.len() + 9];
    assert_eq!(
        from_memory.save_state_bytes(&mut again).unwrap(),
        bytes.len()
    );
    assert_eq!(&again[..bytes.len()], &bytes[..]);
    let err = from_memory.save_state_bytes(&mut again[..bytes.len() - 1]);
    assert!(matches!(err, Err(Error::BufferTooSmall(_))), "{err:?}");
    let cont = continue_after_load(&mut from_memory, pending);
    assert_eq!((cont.logits, cont.ids), (want.logits, want.ids));

    let position = fresh.position().unwrap();
    let cases: [(&str, Vec<u8>); 2] = [
        ("truncated", bytes[..bytes.len() - 3].to_vec()),
        ("magic", [b"NOTSTATE", &bytes[8..]].concat()),
    ];
    for (what, broken) in cases {
        let bad = dir.join(format!("{what}.dv2state"));
        std::fs::write(&bad, broken).unwrap();
        let err = fresh.load_state(&bad).unwrap_err();
        assert!(matches!(err, Error::StateFile(_)), "{what}: {err}");
        assert!(err.to_string().contains(what), "{what}: {err}");
    }
    let err = fresh.load_state(&dir.join("missing.dv2state")).unwrap_err();
    assert!(matches!(err, Error::Io(_)), "{err}");
    let mut other = Engine::load_synthetic(
        "medium_llama",
        2,
        &EngineOptions {
            max_seq: 64,
            ..options(BackendKind::Cpu)
        },
    )
    .unwrap();
    let other_path = dir.join("other.dv2state");
    other.prefill(&[1, 2, 3]).unwrap();
    other.save_state(&other_path).unwrap();
    let err = fresh.load_state(&other_path).unwrap_err();
    assert!(err.to_string().contains("another model"), "{err}");
    let mut short = Engine::load_synthetic(
        "medium_llama",
        1,
        &EngineOptions {
            max_seq: want.held.len() - 1,
            ..options(BackendKind::Cpu)
        },
    )
    .unwrap();
    assert!(matches!(
        short.load_state(&path),
        Err(Error::SequenceFull(_))
    ));
    assert_eq!(
        fresh.position().unwrap(),
        position,
        "the request is where it was"
    );
    assert!(fresh.step().is_ok(), "and goes on");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A rewind past the position is refused and changes nothing; a rewind leaves no pending
/// token, and clears finished.
#[test]
fn rewind_errors_leave_the_request_as_it_was() {
    let case = tiny_case();
    let mut e = engine(None);
    e.prefill(&case.prompt[..case.prefill_len]).unwrap();
    let err = e.rewind(case.prefill_len + 1).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(
        err.to_string().contains("past the current position"),
        "{err}"
    );
    assert_eq!(e.position().unwrap(), case.prefill_len);
    assert_eq!(e.step().unwrap(), case.greedy[1], "the request goes on");
    e.rewind(case.prefill_len).unwrap();
    assert!(matches!(e.step(), Err(Error::InvalidState(_))));
    assert_eq!(
        e.prefill(&[case.greedy[0]]).unwrap(),
        case.greedy[1],
        "the pending id fed again"
    );

    let eos = case.greedy[1];
    let mut e = engine(Some(eos));
    e.prefill(&case.prompt[..case.prefill_len]).unwrap();
    e.step().unwrap();
    assert!(e.finished().unwrap());
    e.rewind(2).unwrap();
    assert!(!e.finished().unwrap());
    assert_eq!(e.position().unwrap(), 2);
}

/// Steps `n` ids in calls of `sizes` (cycled) until `n` or the request ends; returns the ids
/// and the logits after the last call.
fn decode_in_calls(e: &mut Engine, n: usize, sizes: &[usize]) -> (Vec<u32>, Vec<f32>) {
    let mut ids = Vec::new();
    for &size in sizes.iter().cycle() {
        if ids.len() >= n || e.finished().unwrap() || e.room() == 0 {
            break;
        }
        let mut out = vec![0u32; size.min(n - ids.len())];
        let done = e.step_n(&mut out).unwrap();
        ids.extend_from_slice(&out[..done]);
    }
    let mut logits = vec![0f32; e.spec().vocab];
    e.logits(&mut logits).unwrap();
    (ids, logits)
}

/// Speculative greedy decoding (`set_speculation`) on the CPU gives the ids and the logits of
/// plain greedy steps to the bit, at every preset, in calls of 1 to 40 ids (a draft cut by the
/// call's room), up to max_seq (a draft cut by the cache's room) and through EOS (a draft
/// that holds it stops there). The synthetic models' greedy output falls into loops, which
/// drafts predict: checks are made and ids accepted, else the test would prove nothing.
#[test]
fn speculative_greedy_equals_greedy_steps_to_the_bit() {
    for name in ["tiny_llama", "tiny_internlm", "medium_llama"] {
        let c = case(name);
        let prompt = &c.prompt[..c.prefill_len];
        let opts = EngineOptions {
            max_seq: 96,
            ..options(BackendKind::Cpu)
        };
        let load = |draft: usize, eos: Option<u32>| {
            let opts = EngineOptions {
                eos,
                ..opts.clone()
            };
            let mut e = Engine::load_synthetic(&c.preset, c.seed, &opts).unwrap();
            e.set_speculation(draft).unwrap();
            e.prefill(prompt).unwrap();
            e
        };
        let steps = 96 - prompt.len();
        let (plain_ids, plain_logits) = decode_in_calls(&mut load(0, None), steps, &[steps]);
        assert_eq!(plain_ids.len(), steps, "{name}: up to max_seq");
        for (draft, sizes) in [(15, vec![steps]), (4, vec![1, 7, 2, 40]), (1, vec![3])] {
            let mut e = load(draft, None);
            let (ids, logits) = decode_in_calls(&mut e, steps, &sizes);
            assert_eq!(ids, plain_ids, "{name}, drafts of {draft}, calls {sizes:?}");
            assert_eq!(
                logits, plain_logits,
                "{name}, drafts of {draft}: last logits"
            );
            assert_eq!(e.position().unwrap(), 96);
            let stats = e.speculation_stats();
            assert!(
                stats.checks > 0 && stats.accepted > 0 && stats.accepted <= stats.drafted,
                "{name}: {stats:?}"
            );
        }
        // EOS: an id the loop produces late; both stop right after it.
        let eos = plain_ids[steps / 2];
        let first = plain_ids.iter().position(|&id| id == eos).unwrap();
        for draft in [0, 8] {
            let mut e = load(draft, Some(eos));
            let (ids, _) = decode_in_calls(&mut e, steps, &[steps]);
            assert_eq!(
                ids,
                plain_ids[..=first],
                "{name}, drafts of {draft}, EOS {eos}"
            );
            assert!(e.finished().unwrap());
            assert_eq!(e.position().unwrap(), prompt.len() + first + 1);
        }
    }
}

/// Drafts are checked only while decoding is plain greedy; a rewind keeps the setting.
#[test]
fn speculation_only_under_plain_greedy_and_its_bounds() {
    let c = case("tiny_llama");
    let mut e = Engine::load_synthetic(&c.preset, c.seed, &options(BackendKind::Cpu)).unwrap();
    assert!(matches!(
        e.set_speculation(decodev2::engine::MAX_DRAFT + 1),
        Err(Error::InvalidArgument(_))
    ));
    e.set_speculation(8).unwrap();
    let prompt = &c.prompt[..c.prefill_len];
    let mut out = [0u32; 32];
    e.set_logit_bias(&[1], &[0.5]).unwrap();
    e.prefill(prompt).unwrap();
    e.step_n(&mut out).unwrap();
    assert_eq!(e.speculation_stats().checks, 0, "a logit bias: steps only");
    e.set_logit_bias(&[], &[]).unwrap();
    e.set_sampling(&decodev2::sampling::Sampling {
        temperature: 0.7,
        seed: 1,
        ..Default::default()
    })
    .unwrap();
    e.rewind(prompt.len()).unwrap();
    e.prefill(&[prompt[0]]).unwrap();
    e.step_n(&mut out).unwrap();
    assert_eq!(e.speculation_stats().checks, 0, "sampling: steps only");
    e.set_sampling(&Default::default()).unwrap();
    e.reset().unwrap();
    e.prefill(prompt).unwrap();
    e.step_n(&mut out).unwrap();
    assert!(e.speculation_stats().checks > 0, "greedy again: drafts");
}

/// A host's own draft (`Engine::step_draft`): the greedy continuation is taken whole with the
/// id after it, a wrong draft gives the one id a step gives, and bad calls are errors that
/// leave the request as it was.
#[test]
fn a_hosts_draft_is_checked_against_greedy_steps() {
    let c = case("medium_llama");
    let prompt = &c.prompt[..c.prefill_len];
    let load = || {
        let mut e = Engine::load_synthetic(&c.preset, c.seed, &options(BackendKind::Cpu)).unwrap();
        e.prefill(prompt).unwrap();
        e
    };
    let mut plain = [0u32; 6];
    load().step_n(&mut plain).unwrap();
    let mut e = load();
    let mut out = [0u32; 6];
    assert_eq!(e.step_draft(&plain[..5], &mut out).unwrap(), 6);
    assert_eq!(out, plain);
    assert_eq!(e.position().unwrap(), prompt.len() + 6);
    let mut e = load();
    let wrong: Vec<u32> = plain[..3].iter().map(|&id| (id + 1) % 16).collect();
    assert_eq!(e.step_draft(&wrong, &mut out).unwrap(), 1);
    assert_eq!(out[0], plain[0]);
    assert_eq!(e.position().unwrap(), prompt.len() + 1);
    // Bad calls: nothing moves.
    let vocab = e.spec().vocab as u32;
    let too_long = [1u32; decodev2::engine::MAX_DRAFT + 1];
    for (draft, room) in [
        (&[][..], 6),
        (&too_long[..], 32),
        (&[vocab][..], 6),
        (&[1, 2][..], 2),
    ] {
        let mut out = vec![0u32; room];
        let err = e.step_draft(draft, &mut out).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(_) | Error::BufferTooSmall(_)),
            "{draft:?}: {err:?}"
        );
        assert_eq!(e.position().unwrap(), prompt.len() + 1);
    }
    e.set_sampling(&decodev2::sampling::Sampling {
        temperature: 0.5,
        ..Default::default()
    })
    .unwrap();
    assert!(matches!(
        e.step_draft(&[1], &mut out),
        Err(Error::InvalidState(_))
    ));
    e.set_sampling(&Default::default()).unwrap();
    assert_eq!(e.step_n(&mut out[..1]).unwrap(), 1);
    assert_eq!(
        out[0], plain[1],
        "the request went on where the wrong draft left it"
    );
}
