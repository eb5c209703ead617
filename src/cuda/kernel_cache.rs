//! The on-disk cubin cache: one NVRTC compile of a kernel unit however many engines of a
//! process, or processes, load it at once.
//!
//! Why: a compile of the decode unit takes NVRTC every core for 10–30 s. Engines that start
//! together on a cold cache (a server's workers, a test binary's threads, several programs
//! after an upgrade) used to compile the same unit each, side by side: N compiles sharing the
//! cores, every one N times slower. Now the first to miss compiles while the others wait for
//! its file: in the process on a mutex, across processes on an advisory lock on the cache
//! directory's `compile.lock`. The wait is bounded: past it (a holder stopped or stuck) the
//! waiter compiles for itself, so a load never hangs on another process.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::Result;

/// How long a load waits for another process's compile before it compiles for itself: a cold
/// compile of every unit on a small machine, with room.
pub(super) const OTHERS_COMPILE_WAIT: Duration = Duration::from_secs(180);

/// Compiles in this process one at a time: NVRTC already takes every core for one.
static COMPILING: Mutex<()> = Mutex::new(());

/// The bytes cached at `path`, or `compile`'s, written there for the next load. `path` None (no
/// cache directory) compiles. A cache that cannot be read, locked or written costs a compile,
/// never an error.
pub(super) fn cached_or_compile(
    path: Option<&Path>,
    wait_for_others: Duration,
    compile: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    let Some(path) = path else { return compile() };
    if let Ok(bytes) = std::fs::read(path) {
        return Ok(bytes);
    }
    // A thread that panicked while holding it left nothing half done that matters here.
    let _in_process = COMPILING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = path.parent().unwrap_or(Path::new("."));
    let _ = std::fs::create_dir_all(dir);
    let _across_processes = lock_within(&dir.join("compile.lock"), wait_for_others);
    // Whoever held either lock may have written it meanwhile.
    if let Ok(bytes) = std::fs::read(path) {
        return Ok(bytes);
    }
    let cubin = compile()?;
    // Written whole under another name, then renamed: a reader sees all of it or none.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, &cubin)
        .and_then(|()| std::fs::rename(&tmp, path))
        .is_err()
    {
        let _ = std::fs::remove_file(&tmp);
    }
    Ok(cubin)
}

/// `lock_path` opened and exclusively locked (released when the file is dropped), polling
/// until `wait` has passed; None where it cannot be opened or locked in that time.
fn lock_within(lock_path: &Path, wait: Duration) -> Option<File> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(lock_path)
        .ok()?;
    let deadline = Instant::now() + wait;
    loop {
        match file.try_lock() {
            Ok(()) => return Some(file),
            Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(_) => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn empty_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("dv2-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn threads_missing_together_compile_once_and_read_the_same_bytes() {
        let dir = empty_dir("threads");
        let path = dir.join("unit-sm_90-0123.cubin");
        let compiles = Arc::new(AtomicUsize::new(0));
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let (path, compiles) = (path.clone(), compiles.clone());
                std::thread::spawn(move || {
                    cached_or_compile(Some(&path), OTHERS_COMPILE_WAIT, || {
                        compiles.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(200));
                        Ok(vec![7u8; 1000])
                    })
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap().unwrap(), vec![7u8; 1000]);
        }
        assert_eq!(compiles.load(Ordering::SeqCst), 1);
        assert_eq!(std::fs::read(&path).unwrap(), vec![7u8; 1000]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_lock_held_elsewhere_is_waited_for_only_so_long() {
        let dir = empty_dir("held");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("unit-sm_90-4567.cubin");
        // Held as another process would hold it (a lock on another open file is exclusive
        // of ours on Linux even in one process).
        let other = File::create(dir.join("compile.lock")).unwrap();
        other.lock().unwrap();
        let started = Instant::now();
        let bytes = cached_or_compile(Some(&path), Duration::from_millis(300), || Ok(vec![1, 2]));
        assert_eq!(bytes.unwrap(), vec![1, 2]);
        assert!(started.elapsed() >= Duration::from_millis(300));
        drop(other);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failed_compile_is_the_callers_error_and_caches_nothing() {
        let dir = empty_dir("failed");
        let path = dir.join("unit-sm_90-89ab.cubin");
        let failed = cached_or_compile(Some(&path), OTHERS_COMPILE_WAIT, || {
            Err(crate::error::Error::Cuda("nvrtc: syntax".into()))
        });
        assert!(failed.is_err());
        assert!(!path.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
