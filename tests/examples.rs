//! The C and Python examples, built and run against the library this `cargo test` built, on
//! the CPU backend; and the C example under valgrind (no leaks, no invalid accesses).
//! The Python completion example runs on SmolLM2 where .ci/run fetched it.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// These tests rebuild the library with cargo; on a machine that only runs packed test
/// binaries (the GPU machine) there is none, and the examples are run by
/// tests/gpu/run-on-device.sh instead.
fn cargo_missing() -> bool {
    let missing = !Path::new(env!("CARGO")).exists();
    if missing {
        println!("SKIP: no cargo here to build the library and examples");
    }
    missing
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// target/<profile>/, with libdecodev2.so rebuilt from the current sources: `cargo test`
/// links the tests against the rlib and leaves the cdylib as the last `cargo build` made it.
fn lib_dir() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().unwrap();
            let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
            let profile = dir.file_name().unwrap().to_str().unwrap();
            let profile = if profile == "debug" { "dev" } else { profile };
            let target_dir = dir.parent().unwrap();
            run(Command::new(env!("CARGO"))
                .args(["build", "--lib", "--quiet", "--profile", profile])
                .arg("--target-dir")
                .arg(target_dir)
                .current_dir(root()));
            assert!(
                dir.join("libdecodev2.so").exists(),
                "no libdecodev2.so in {}",
                dir.display()
            );
            dir
        })
        .clone()
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

/// The count of prompt ids a `--prompt-cache` run reused, from its "prompt cache: N ..." line
/// (the Python command's and examples_c/chat's).
fn reused_ids(output: &str) -> usize {
    output
        .split("prompt cache: ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no prompt cache line in {output}"))
}

/// examples_c/`name`.c built by its Makefile against the library this run built.
fn make_c_example(name: &str) -> PathBuf {
    let build = lib_dir().join("examples_c");
    run(Command::new("make")
        .arg("-s")
        .arg("-C")
        .arg(root().join("examples_c"))
        .arg(format!("LIBDIR={}", lib_dir().display()))
        .arg(format!("BUILD={}", build.display()))
        .arg(name));
    build.join(name)
}

/// The C gates example, built once per test process: two tests running `make` at once could
/// relink it while the other executes it (ETXTBSY, "Text file busy").
fn build_c_example() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| make_c_example("gates")).clone()
}

fn gates_passed(text: &str) {
    assert!(text.contains("3 cases, 0 failed gates"), "{text}");
}

#[test]
fn c_example_passes_the_gates_on_cpu() {
    if cargo_missing() {
        return;
    }
    let exe = build_c_example();
    let text = run(Command::new(&exe)
        .args(["--backend", "cpu"])
        .current_dir(root()));
    gates_passed(&text);
}

/// A fresh virtual environment with `pip install openai ./python[server]` (the library this
/// test run built bundled through DV2_LIB at build time), made once per test process from that
/// process's own copy of python/ (pip builds in the source tree). Left in the temporary directory.
fn venv() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let scratch = std::env::temp_dir().join(format!("dv2-py-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&scratch);
            // pip builds in the source tree (build/, egg-info, the bundled .so), so a shared
            // python/ raced when nextest ran two of these processes at once.
            let package = scratch.join("python");
            copy_package(&root().join("python"), &package);
            let venv = scratch.join("venv");
            run(Command::new("python3").args(["-m", "venv"]).arg(&venv));
            run(Command::new(venv.join("bin/pip"))
                .args(["install", "-q", "openai", "llm"])
                .arg(format!("{}[server]", package.display()))
                .env("DV2_LIB", lib_dir().join("libdecodev2.so")));
            venv
        })
        .clone()
}

/// python/'s files, less what a build leaves there (build/, *.egg-info, the bundled .so).
fn copy_package(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        let built = ["build", "libdecodev2.so", "__pycache__"]
            .iter()
            .any(|b| name == *b)
            || name.to_string_lossy().ends_with(".egg-info");
        if built {
            continue;
        }
        let target = to.join(&name);
        if entry.file_type().unwrap().is_dir() {
            copy_package(&entry.path(), &target);
        } else {
            std::fs::create_dir_all(to).unwrap();
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// Each failing call raises its status's class (all of them Dv2Error).
const TYPED_ERRORS: &str = r#"
import decodev2 as d
try:
    d.Engine.synthetic("no_such_preset", backend="cpu")
except d.InvalidArgumentError as err:
    assert isinstance(err, d.Dv2Error) and isinstance(err, ValueError)
    print("preset", err.status)
e = d.Engine.synthetic("tiny_llama", backend="cpu")
try:
    e.step()
except d.InvalidStateError as err:
    print("state", err.status)
try:
    next(e.generate([1, 2, 3], max_tokens=2))
except d.UnsupportedError as err:
    print("text", err.status)
try:
    d.Engine.load("/nonexistent/model.gguf", backend="cpu")
except d.ModelFileError as err:
    assert isinstance(err, OSError)
    print("file", err.status)
"#;

/// `Engine.start` keeps the KV cache of the prefix a prompt shares with the last request's
/// ids (its prompt and what it decoded, batched or a step at a time) and prefills the rest:
/// the same ids as a fresh prefill, on the CPU bit for bit; `reuse=False`, a rewind past the
/// position, and a prompt equal to the last one's ids (one id prefilled again) too. An id or a
/// position past int32 is a ValueError, not its low 32 bits.
const START_REUSES_THE_PREFIX: &str = r#"
import decodev2 as d
e = d.Engine.synthetic("medium_llama", seed=1, backend="cpu", max_seq=64)
a = [3, 1, 4, 1, 5, 9, 2, 6]
first = e.start(a)
decoded = [first] + e.step_n(4) + [e.step()]
b = a + decoded[:4] + [7, 7]
got = [e.start(b)] + e.step_n(5)
reused = e.reused
e.reset()
want = [e.prefill(b)] + e.step_n(5)
assert got == want, (got, want)
assert reused >= len(a) + 4, reused
again = [e.start(b)] + e.step_n(5)
assert again == want and e.reused == len(b) - 1, (again, e.reused)
cold = [e.start(b, reuse=False)] + e.step_n(5)
assert cold == want and e.reused == 0, (cold, e.reused)
try:
    e.rewind(e.position() + 1)
except d.Dv2Error as err:
    print("rewind", err.status)
# An id past int32 is refused, not fed as its low 32 bits (id 5).
for call in (lambda: e.prefill([(1 << 32) + 5]), lambda: e.rewind((1 << 32) + 1), lambda: e.piece(-(1 << 40)),
             lambda: e.set_sampling(temperature=1.0, top_k=(1 << 32) + 1), lambda: e.set_sampling(seed=-1),
             lambda: d.Engine.synthetic("tiny_llama", backend="cpu", max_seq=(1 << 32) + 8),
             lambda: d.Engine.synthetic("tiny_llama", seed=-1, backend="cpu")):
    try:
        call()
        raise AssertionError("an int past int32 went through")
    except ValueError as err:
        assert "outside" in str(err), err
print("reused", reused, len(b) - 1)
"#;

/// `Engine.generate` (ids decoded in dv2_step_n batches) against the loop it ran before, a step a
/// call with the same checks, on SmolLM2 (CPU): the same text where the reply ends at the model's
/// end of generation (EOS on: the engine stops there; ~18 ids), at max_tokens (10, EOS off: the
/// engine decodes on past it) and at max_seq (48 slots: 12 ids after the chat prompt's 37).
const GENERATE_IN_BATCHES: &str = r#"
import sys, decodev2 as d
def by_steps(e, prompt, max_tokens):
    ids = e.tokenize(e.chat(prompt), add_special=True, parse_special=True)
    e.reset()
    nxt, stream, text = e.prefill(ids), d.TextStream(), ""
    for n in range(max_tokens):
        if e.finished() or e._ends(nxt):
            break
        text += stream.push(e.piece(nxt))
        if n + 1 == max_tokens or e.position() >= e.info.max_seq:
            break
        nxt = e.step()
    return text
d.BURST_S = 60.0  # batches of up to MAX_BATCH ids on a CPU too, where a step takes ~0.1 s
batches, step_n = [], d.Engine.step_n
def counted(e, n):
    ids = step_n(e, n)
    batches.append(len(ids))
    return ids
d.Engine.step_n = counted
prompt = [{"role": "user", "content": "What is the capital of France?"}]
for eos_id, max_seq, max_tokens in [(-2, 0, 40), (-1, 0, 10), (-1, 48, 40)]:
    e = d.Engine.load(sys.argv[1], backend="cpu", eos_id=eos_id, max_seq=max_seq)
    want = by_steps(e, prompt, max_tokens)
    batches.clear()
    got = "".join(e.generate(prompt, max_tokens=max_tokens, chat=True))
    assert got == want, (eos_id, max_seq, max_tokens, got, want)
    print(max(batches), end=" ")
# Stop strings: the reply ends before the earliest one reached, and nothing of it is yielded.
word = want.split()[len(want.split()) // 2]
for stop in ([word], [want[-3:], word], "never in the reply"):
    pieces = list(e.generate(prompt, max_tokens=40, chat=True, stop=stop))
    stops = [stop] if isinstance(stop, str) else stop
    cut = min((want.find(s) for s in stops if s in want), default=len(want))
    assert "".join(pieces) == want[:cut], (stop, pieces, want)
"#;

/// A request saved by `save_state` and loaded by another engine of the model with `load_state`:
/// the ids it holds come back, and `start` reuses all of them, choosing the ids the saving
/// engine chooses; another model's engine refuses the file with StateFileError.
const SAVED_STATE: &str = r#"
import os, tempfile, decodev2 as d
path = os.path.join(tempfile.mkdtemp(), "request.dv2state")
e = d.Engine.synthetic("medium_llama", seed=1, backend="cpu", max_seq=64)
a = [3, 1, 4, 1, 5, 9, 2, 6]
decoded = [e.start(a)] + e.step_n(4)
assert e.save_state(path) == len(a) + 4
b = a + decoded[:4] + [7, 7]
want = [e.start(b)] + e.step_n(5)
f = d.Engine.synthetic("medium_llama", seed=1, backend="cpu", max_seq=64)
held = f.load_state(path)
assert held == a + decoded[:4], held
got = [f.start(b)] + f.step_n(5)
assert got == want and f.reused == len(held), (got, want, f.reused)
# In memory: the file's bytes, and loaded from them the same continuation.
data = open(path, "rb").read()
h = d.Engine.synthetic("medium_llama", seed=1, backend="cpu", max_seq=64)
assert h.load_state_bytes(data) == held and h.state_bytes() == data
assert h.state_size() == len(data) and isinstance(h.state_bytes(), bytearray)
# Any buffer loads where it lies: a bytearray, a view of one, a read-only view (copied).
for buf in (bytearray(data), memoryview(bytearray(data)), memoryview(data)):
    assert h.load_state_bytes(buf) == held, type(buf)
assert [h.start(b)] + h.step_n(5) == want
try:
    h.load_state_bytes(data[:-1])
    raise AssertionError("a cut state loaded")
except d.StateFileError as err:
    assert "truncated" in str(err), err
g = d.Engine.synthetic("medium_llama", seed=2, backend="cpu", max_seq=64)
try:
    g.load_state(path)
    raise AssertionError("another model's state loaded")
except d.StateFileError as err:
    assert isinstance(err, OSError) and "another model" in str(err), err
    print("other model", err.status)
print("state ok")
"#;

/// `StateCache` on a synthetic model (CPU), room for two states of a 64-id conversation: what
/// the engine holds is kept before another conversation replaces it, the least recently used
/// goes first, a state that extends a kept one replaces it, a request inside what the engine
/// holds keeps nothing, and the bytes kept never pass the limit (a state past it is not even
/// saved); a conversation started from a kept state decodes what it decodes from a whole prefill.
const STATE_CACHE: &str = r#"
import decodev2 as d
e = d.Engine.synthetic("medium_llama", seed=1, backend="cpu", max_seq=256)
conv = {c: [c * 31 % 200 + 1] + [(c * 7 + i) % 200 for i in range(63)] for c in (1, 2, 3)}
e.start(conv[1])
one = len(e.state_bytes())  # a state of 64 ids
cache = d.StateCache(2 * one + one // 2)
def turn(ids):
    cache.start(e, ids)
    assert cache.size <= cache.limit and cache.size == sum(map(len, cache.entries.values()))
    return e.reused
def kept():
    return [next(c for c in conv if tuple(conv[c]) == key[:64]) for key in cache.entries]
e.reset()
turn(conv[1])
turn(conv[2])
turn(conv[3])
assert kept() == [1, 2], kept()
# 3 kept, 1 out (the least recently used), 2 loaded.
assert turn(conv[2] + [5, 6]) == 64 and kept() == [3, 2], kept()
# Inside what the engine holds: nothing kept.
assert turn(conv[2] + [5, 6, 7]) == 66 and kept() == [3, 2], kept()
# 2's 67 ids replace its 64.
assert turn(conv[1] + [9]) == 0 and kept() == [3, 2] and len(list(cache.entries)[1]) == 67
f = d.Engine.synthetic("medium_llama", seed=1, backend="cpu", max_seq=256)
ids = conv[2] + [5, 6, 7, 8]
want = [f.start(ids, reuse=False)] + f.step_n(6)
got = [cache.start(e, ids)] + e.step_n(6)
assert e.reused == 67 and kept() == [1, 2] and got == want, (e.reused, kept(), got, want)
# A state past the limit is neither kept nor saved (its size asked first).
small = d.StateCache(one // 2)
e.reset()
small.start(e, conv[1])
def refuse():
    raise AssertionError("a state past the limit saved")
e.state_bytes = refuse
small.start(e, conv[2])
del e.state_bytes
assert not small.entries and small.size == 0
print("state cache ok")
"#;

/// `StopText` over pieces that split the stop strings: the text before the first one, released
/// as soon as no stop string can begin in it.
const STOP_TEXT: &str = r#"
import decodev2 as d
s = d.StopText(["</s>", "||"])  # the last 3 characters held back
out = [(s.add(p), s.release()) for p in ["ab", "c<", "/", "x|", "y<", "/s"]]
assert out == [(False, ""), (False, "a"), (False, "b"), (False, "c<"), (False, "/x"), (False, "|y")], out
assert s.add(">z") and s.text == "abc</x|y" and s.release(final=True) == "", (s.text, s.sent)
s = d.StopText(["||"])
assert s.add("a|") is False and s.add("|b") is True and s.release(final=True) == "a", s.text
t = d.StopText([])
assert not t.add("anything") and t.release() == "anything"
for bad in ([""], [3]):
    try:
        d.StopText(bad)
        raise AssertionError("a bad stop string went through")
    except ValueError:
        pass
print("stop text ok")
"#;

/// `pip install ./python` into a fresh virtual environment ([`venv`]), then `import decodev2`
/// and the `decodev2` command from another directory, with no path set.
#[test]
fn python_package_installs_into_a_fresh_venv() {
    if cargo_missing() {
        return;
    }
    let venv = venv();
    let version = run(Command::new(venv.join("bin/python"))
        .args([
            "-c",
            "import decodev2; print(decodev2.version(), decodev2.__file__)",
        ])
        .current_dir(std::env::temp_dir())
        .env_remove("DV2_LIB"));
    assert!(version.starts_with(env!("CARGO_PKG_VERSION")), "{version}");
    assert!(
        version.contains(venv.to_str().unwrap()),
        "imported from the venv: {version}"
    );
    // The log callback: the library's lines reach Python, and stop when it is cleared.
    let logged = run(Command::new(venv.join("bin/python"))
        .args([
            "-c",
            "import decodev2 as d\n\
             lines = []\n\
             d.set_log_callback(lambda level, msg: lines.append((level, msg)))\n\
             d.Engine.synthetic('tiny_llama', backend='cpu').close()\n\
             d.set_log_callback(None)\n\
             d.Engine.synthetic('tiny_llama', backend='cpu').close()\n\
             print(len(lines), lines[0])",
        ])
        .current_dir(std::env::temp_dir()));
    assert!(
        logged.starts_with("1 ('info', 'loaded preset tiny_llama"),
        "{logged}"
    );
    // Typed errors, and generate() on a synthetic model (it has no tokenizer, so its text is
    // refused by type).
    let typed = run(Command::new(venv.join("bin/python"))
        .args(["-c", TYPED_ERRORS])
        .current_dir(std::env::temp_dir()));
    assert_eq!(
        typed.trim(),
        "preset DV2_ERR_UNKNOWN_PRESET
state DV2_ERR_INVALID_STATE
text DV2_ERR_UNSUPPORTED
file DV2_ERR_IO",
        "{typed}"
    );
    // The server's API key and /health (tests/server/api_key.py; no model file needed).
    let key = run(Command::new(venv.join("bin/python"))
        .arg(root().join("tests/server/api_key.py"))
        .current_dir(std::env::temp_dir()));
    assert!(key.trim_end().ends_with("api key ok"), "{key}");
    let state = run(Command::new(venv.join("bin/python"))
        .args(["-c", SAVED_STATE])
        .current_dir(std::env::temp_dir()));
    assert_eq!(
        state.trim(),
        "other model DV2_ERR_STATE_FILE\nstate ok",
        "{state}"
    );
    let cache = run(Command::new(venv.join("bin/python"))
        .args(["-c", STATE_CACHE])
        .current_dir(std::env::temp_dir()));
    assert_eq!(cache.trim(), "state cache ok", "{cache}");
    let stop = run(Command::new(venv.join("bin/python"))
        .args(["-c", STOP_TEXT])
        .current_dir(std::env::temp_dir()));
    assert_eq!(stop.trim(), "stop text ok");
    let reuse = run(Command::new(venv.join("bin/python"))
        .args(["-c", START_REUSES_THE_PREFIX])
        .current_dir(std::env::temp_dir()));
    assert!(
        reuse.starts_with("rewind DV2_ERR_INVALID_ARGUMENT\nreused "),
        "{reuse}"
    );
    if let Some(model) = common::smollm2_path() {
        let text = run(Command::new(venv.join("bin/decodev2"))
            .arg("generate")
            .arg(&model)
            .args(["--prompt", "The capital of France is", "--tokens", "4"])
            .args(["--backend", "cpu"])
            .current_dir(std::env::temp_dir())
            .env_remove("DV2_LIB"));
        assert!(text.starts_with("The capital of France is Paris"), "{text}");
        let stopped = run(Command::new(venv.join("bin/decodev2"))
            .arg("generate")
            .arg(&model)
            .args(["--prompt", "The capital of France is", "--tokens", "4"])
            .args(["--backend", "cpu", "--stop", "xyz", "--stop", " Paris"])
            .current_dir(std::env::temp_dir())
            .env_remove("DV2_LIB"));
        assert_eq!(stopped, "The capital of France is\n");
        // --prompt-cache: the second run's prompt is the first's ids and more; it prefills
        // only the new ones, and its text is the uncached run's.
        let cache = std::env::temp_dir().join(format!("dv2-cache-{}", std::process::id()));
        let cached = |prompt: &str| {
            run(Command::new(venv.join("bin/decodev2"))
                .arg("generate")
                .arg(&model)
                .args(["--prompt", prompt, "--tokens", "4", "--backend", "cpu"])
                .arg("--prompt-cache")
                .arg(&cache)
                .current_dir(std::env::temp_dir())
                .env_remove("DV2_LIB"))
        };
        let first = cached("The capital of France is");
        assert!(
            first.contains("prompt cache: 0 prompt ids reused"),
            "{first}"
        );
        let second = cached("The capital of France is Paris. The capital of Italy is");
        assert!(reused_ids(&second) > 0, "{second}");
        let uncached = run(Command::new(venv.join("bin/decodev2"))
            .arg("generate")
            .arg(&model)
            .args([
                "--prompt",
                "The capital of France is Paris. The capital of Italy is",
            ])
            .args(["--tokens", "4", "--backend", "cpu"])
            .current_dir(std::env::temp_dir())
            .env_remove("DV2_LIB"));
        assert_eq!(second.lines().next(), uncached.lines().next(), "{second}");
        std::fs::remove_file(&cache).unwrap();
        // A conversation on stdin, after a system message.
        let question = std::env::temp_dir().join(format!("dv2-question-{}", std::process::id()));
        std::fs::write(&question, "What is the capital of France?\n").unwrap();
        // With a prompt cache, a second conversation's system message is not prefilled again.
        let chat = || {
            run(Command::new(venv.join("bin/decodev2"))
                .arg("chat")
                .arg(&model)
                .args([
                    "--system",
                    "You are a geography teacher. Answer in one sentence.",
                ])
                .args(["--tokens", "24", "--backend", "cpu", "--prompt-cache"])
                .arg(&cache)
                .stdin(std::fs::File::open(&question).unwrap())
                .current_dir(std::env::temp_dir())
                .env_remove("DV2_LIB"))
        };
        let answer = chat();
        assert!(answer.contains("Paris"), "{answer}");
        assert!(
            answer.contains("prompt cache: 0 prompt ids reused"),
            "{answer}"
        );
        let again = chat();
        assert!(
            reused_ids(&again) > 10,
            "the system message reused: {again}"
        );
        std::fs::remove_file(&question).unwrap();
        std::fs::remove_file(&cache).unwrap();
        let batches = run(Command::new(venv.join("bin/python"))
            .args(["-c", GENERATE_IN_BATCHES])
            .arg(&model)
            .current_dir(std::env::temp_dir())
            .env_remove("DV2_LIB"));
        // Each reply's largest batch: one id first, then the rest in one (EOS stops the
        // first reply's inside it).
        let largest: Vec<usize> = batches
            .split_whitespace()
            .map(|c| c.parse().unwrap())
            .collect();
        assert!(
            largest.len() == 3 && largest.iter().all(|&b| b > 1),
            "{largest:?}"
        );
    }
}

/// `decodev2 serve` on SmolLM2 (CPU) from the fresh venv ([`venv`]), driven by real clients:
/// the official `openai` client and raw HTTP (tests/server/openai_clients.py: a chat answer with
/// "Paris", a stream of several chunks, a stop string, seeds, logprobs, logit_bias, 4xx JSON
/// errors); the
/// `llm` command line with the server as an OpenAI-compatible model; then load
/// (tests/server/load_clients.py: 400 sequential requests and two bursts of 10 concurrent
/// clients, the server's RSS flat).
#[test]
fn openai_client_talks_to_the_server() {
    let Some(model) = common::smollm2_path() else {
        return;
    };
    if cargo_missing() {
        return;
    }
    let venv = venv();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut server = Command::new(venv.join("bin/decodev2"))
        .arg("serve")
        .arg(&model)
        .args(["--backend", "cpu", "--port", &port.to_string()])
        .env_remove("DV2_LIB")
        .spawn()
        .unwrap();
    let up = (0..600).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(100));
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let base = format!("http://127.0.0.1:{port}");
    let llm_home = std::env::temp_dir().join(format!("dv2-llm-{}", std::process::id()));
    std::fs::create_dir_all(&llm_home).unwrap();
    let served = model.file_name().unwrap().to_string_lossy().into_owned();
    std::fs::write(
        llm_home.join("extra-openai-models.yaml"),
        format!("- model_id: decodev2\n  model_name: {served}\n  api_base: \"{base}/v1\"\n"),
    )
    .unwrap();
    let output = |cmd: &mut Command| {
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        println!("{text}");
        (out.status.success(), text)
    };
    let result = up.then(|| {
        let clients = output(
            Command::new(venv.join("bin/python"))
                .arg(root().join("tests/server/openai_clients.py"))
                .arg(&base)
                .arg(&model),
        );
        let llm = output(
            Command::new(venv.join("bin/llm"))
                .args(["-m", "decodev2", "What is the capital of France?"])
                .args(["-o", "max_tokens", "30", "-o", "temperature", "0"])
                .env("LLM_USER_PATH", &llm_home)
                .env("OPENAI_API_KEY", "unused"),
        );
        let load = output(
            Command::new(venv.join("bin/python"))
                .arg(root().join("tests/server/load_clients.py"))
                .arg(&base)
                .arg(server.id().to_string()),
        );
        (clients, llm, load)
    });
    server.kill().unwrap();
    server.wait().unwrap();
    let _ = std::fs::remove_dir_all(&llm_home);
    let (clients, llm, load) = result.expect("the server did not listen within 60 s");
    assert!(
        clients.0 && clients.1.contains("all checks passed"),
        "{}",
        clients.1
    );
    assert!(llm.0 && llm.1.contains("Paris"), "llm: {}", llm.1);
    assert!(
        load.0 && load.1.contains("all load checks passed"),
        "{}",
        load.1
    );
}

/// `make install-files` into a fresh prefix, then a C and a C++ host (install/host_check.c)
/// built with the pkg-config flags alone (-Wall -Wextra -Wpedantic -Werror) and run with no
/// LD_LIBRARY_PATH: the header compiles as both languages, the rpath finds the library.
#[test]
fn installed_library_serves_c_and_cpp_hosts() {
    if cargo_missing() {
        return;
    }
    if Command::new("pkg-config")
        .arg("--version")
        .output()
        .is_err()
    {
        println!("SKIP: no pkg-config here");
        return;
    }
    let prefix = std::env::temp_dir().join(format!("dv2-prefix-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&prefix);
    run(Command::new("make")
        .arg("-s")
        .arg("-C")
        .arg(root())
        .arg("install-files")
        .arg(format!("PREFIX={}", prefix.display()))
        .arg(format!(
            "BUILT_LIB={}",
            lib_dir().join("libdecodev2.so").display()
        )));
    let flags = run(Command::new("pkg-config")
        .args(["--cflags", "--libs", "decodev2"])
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")));
    let flags: Vec<&str> = flags.split_whitespace().collect();
    for (compiler, lang) in [
        ("cc", ["-std=c99", "-xc"]),
        ("c++", ["-std=c++17", "-xc++"]),
    ] {
        let exe = prefix.join(format!("host-{compiler}"));
        run(Command::new(compiler)
            .args(lang)
            .args(["-Wall", "-Wextra", "-Wpedantic", "-Werror"])
            .arg(root().join("install/host_check.c"))
            .arg("-xnone")
            .args(&flags)
            .arg("-o")
            .arg(&exe));
        let out = run(Command::new(&exe).env_remove("LD_LIBRARY_PATH"));
        assert!(out.contains("next id"), "{compiler}: {out}");
    }
    std::fs::remove_dir_all(&prefix).unwrap();
}

/// examples_c/chat.c on SmolLM2: a question through the model's chat template and tokenizer,
/// the answer streamed until the model's end of generation (eos_id -2).
#[test]
fn c_chat_answers_and_stops_at_the_end_of_generation() {
    let Some(model) = common::smollm2_path() else {
        return;
    };
    if cargo_missing() {
        return;
    }
    let chat = make_c_example("chat");
    let text = run(Command::new(&chat)
        .arg(&model)
        .arg("What is the capital of France?")
        .args(["--backend", "cpu", "--tokens", "200"]));
    println!("{text}");
    assert!(text.contains("Paris"), "{text}");
    assert!(text.contains("[end of generation]"), "{text}");
    // --prompt-cache: the second question shares the chat template's opening with the first
    // request the file holds, and only the rest is prefilled.
    let cache = std::env::temp_dir().join(format!("dv2-c-chat-{}", std::process::id()));
    let cached = |question: &str| {
        run(Command::new(&chat)
            .arg(&model)
            .arg(question)
            .args(["--backend", "cpu", "--tokens", "24", "--prompt-cache"])
            .arg(&cache))
    };
    let first = cached("What is the capital of France?");
    assert!(first.contains("[prompt cache: 0 of "), "{first}");
    let second = cached("What is the capital of Italy?");
    assert!(reused_ids(&second) > 10, "{second}");
    let uncached = run(Command::new(&chat)
        .arg(&model)
        .arg("What is the capital of Italy?")
        .args(["--backend", "cpu", "--tokens", "24"]));
    assert_eq!(second.lines().next(), uncached.lines().next(), "{second}");
    std::fs::remove_file(&cache).unwrap();
}

/// Text in, streamed text out on SmolLM2 (examples_c/complete.py: the model file's tokenizer
/// through dv2_tokenize and dv2_token_to_piece).
#[test]
fn python_completion_streams_text_on_cpu() {
    let Some(model) = common::smollm2_path() else {
        return;
    };
    if cargo_missing() {
        return;
    }
    let text = run(Command::new("python3")
        .arg(root().join("examples_c/complete.py"))
        .arg(&model)
        .arg("The capital of France is")
        .args(["--tokens", "8", "--backend", "cpu"])
        .env("DV2_LIB", lib_dir().join("libdecodev2.so")));
    println!("{text}");
    assert!(text.starts_with("The capital of France is Paris"), "{text}");
}

#[test]
fn python_example_passes_the_gates_on_cpu() {
    if cargo_missing() {
        return;
    }
    let text = run(Command::new("python3")
        .arg(root().join("examples_c/gates.py"))
        .args(["--backend", "cpu"])
        .env("DV2_LIB", lib_dir().join("libdecodev2.so")));
    gates_passed(&text);
}

#[test]
fn c_example_is_clean_under_valgrind() {
    if cargo_missing() {
        return;
    }
    if Command::new("valgrind").arg("--version").output().is_err() {
        println!("SKIP: valgrind not installed");
        return;
    }
    let exe = build_c_example();
    let text = run(Command::new("valgrind")
        .args([
            "--error-exitcode=3",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite,indirect",
            "--show-leak-kinds=definite,indirect",
        ])
        .arg(Path::new(&exe))
        .args(["--backend", "cpu", "--quiet"])
        .current_dir(root()));
    gates_passed(&text);
    assert!(text.contains("ERROR SUMMARY: 0 errors"), "{text}");
}

/// examples/convert_bnb: a synthetic model converted once into a bitsandbytes 4-bit directory
/// loads from it (InternLM2's fused wqkv written as q, k and v) and decodes the same greedy ids
/// as the model itself, on the CPU.
#[test]
fn converted_bnb_directory_decodes_the_same_ids() {
    use decodev2::engine::{BackendKind, Engine, EngineOptions};
    if cargo_missing() {
        return;
    }
    let out = std::env::temp_dir().join(format!("dv2-convert-{}", std::process::id()));
    let text = run(Command::new(lib_dir().join("examples/convert_bnb"))
        .args(["--synthetic", "tiny_internlm", "5"])
        .arg(&out));
    assert!(text.contains("wrote"), "{text}");
    let opts = EngineOptions {
        backend: BackendKind::Cpu,
        ..EngineOptions::default()
    };
    let mut engines = [
        Engine::load_synthetic("tiny_internlm", 5, &opts).unwrap(),
        Engine::load_file(&out, &opts).unwrap(),
    ];
    let ids: Vec<Vec<u32>> = engines
        .iter_mut()
        .map(|e| {
            let mut ids = vec![e.prefill(&[1, 2, 3]).unwrap(), 0, 0, 0, 0, 0, 0, 0];
            e.step_n(&mut ids[1..]).unwrap();
            ids
        })
        .collect();
    std::fs::remove_dir_all(&out).unwrap();
    assert_eq!(ids[0], ids[1]);
}

/// examples/synth_gguf: a synthetic llama written as a llama.cpp-style Q4_0 GGUF (q and k
/// rows in llama.cpp's order, norms in F32) loads through the GGUF path and decodes exactly as
/// the same model with every matrix put through Q4_0 in memory (ggml's Q4_0 rounding, done
/// here as llama.cpp's quantize_row_q4_0_ref does), on the CPU: the file's layout, metadata
/// and row order are right, and what differs from the NF4 model is Q4_0's rounding alone.
#[test]
fn synthetic_gguf_decodes_as_its_q4_0_round_trip() {
    use decodev2::engine::{BackendKind, Engine, EngineOptions};
    use decodev2::model::QkvWeights;
    use decodev2::nf4::Nf4Matrix;
    if cargo_missing() {
        return;
    }
    let out = std::env::temp_dir().join(format!("dv2-synth-{}.gguf", std::process::id()));
    let text = run(Command::new(lib_dir().join("examples/synth_gguf"))
        .args(["medium_llama", "4"])
        .arg(&out));
    assert!(text.contains("wrote"), "{text}");
    let q4_0 = |m: &Nf4Matrix| {
        let mut values = m.dequantize();
        for block in values.chunks_exact_mut(32) {
            let max = block
                .iter()
                .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            let d = max / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let stored = half::f16::from_f32(d).to_f32();
            for v in block {
                let q = ((*v * id + 8.5) as i8).min(15);
                *v = (q - 8) as f32 * stored;
            }
        }
        Nf4Matrix::quantize(m.rows, m.cols, &values).unwrap()
    };
    let mut model =
        decodev2::synth::build(&decodev2::arch::preset("medium_llama").unwrap(), 4).unwrap();
    model.embed = q4_0(&model.embed);
    model.lm_head = model.lm_head.as_ref().map(q4_0);
    for l in &mut model.layers {
        let QkvWeights::Separate { q, k, v } = &mut l.qkv else {
            unreachable!("medium_llama has separate q, k, v")
        };
        for m in [
            &mut q.weight,
            &mut k.weight,
            &mut v.weight,
            &mut l.o,
            &mut l.gate,
            &mut l.up,
            &mut l.down,
        ] {
            *m = q4_0(m);
        }
    }
    let opts = EngineOptions {
        backend: BackendKind::Cpu,
        max_seq: 64,
        ..EngineOptions::default()
    };
    let mut engines = [
        Engine::new(model, &opts).unwrap(),
        Engine::load_file(&out, &opts).unwrap(),
    ];
    std::fs::remove_file(&out).unwrap();
    let runs: Vec<(Vec<u32>, Vec<f32>)> = engines
        .iter_mut()
        .map(|e| {
            let mut ids = vec![e.prefill(&[5, 1, 9, 2, 7]).unwrap(), 0, 0, 0, 0, 0, 0, 0];
            let mut logits = vec![0f32; e.spec().vocab];
            e.logits(&mut logits).unwrap();
            e.step_n(&mut ids[1..]).unwrap();
            (ids, logits)
        })
        .collect();
    assert_eq!(runs[0].0, runs[1].0);
    assert_eq!(runs[0].1, runs[1].1, "the first logits differ");
}
