//! Panics the library catches, and keeps quiet: those of the C ABI's entries (a bug, returned
//! as `DV2_ERR_INTERNAL`) and those of the `tokenizers` crate on a tokenizer.json it was not
//! written to expect (returned as that file's error; upstream panics on some such files:
//! huggingface/tokenizers#2151). While a caught call runs, on any thread (the library's own
//! worker threads panic on a caller's behalf), the process's panic hook prints nothing: the
//! message reaches the caller as an error instead. The hook is wrapped once, at the first
//! caught call; outside them it behaves as before.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;

static CAUGHT_IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

fn quiet_while_caught() {
    static WRAPPED: Once = Once::new();
    WRAPPED.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if CAUGHT_IN_FLIGHT.load(Ordering::Relaxed) == 0 {
                previous(info);
            }
        }));
    });
}

/// Runs `body`; where it panics, the panic's message. What `body` touched may be left
/// half-done (unwinding runs its destructors): the caller treats it as broken or rebuilds it.
pub(crate) fn catch<T>(body: impl FnOnce() -> T) -> Result<T, String> {
    quiet_while_caught();
    CAUGHT_IN_FLIGHT.fetch_add(1, Ordering::Relaxed);
    let result = catch_unwind(AssertUnwindSafe(body));
    CAUGHT_IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
    result.map_err(|payload| message(payload.as_ref()))
}

fn message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_comes_back_as_its_message() {
        assert_eq!(catch(|| 7), Ok(7));
        assert_eq!(
            catch(|| -> u32 { panic!("bad {}", 1) }),
            Err("bad 1".into())
        );
        assert_eq!(
            catch(|| std::panic::panic_any(3u8)),
            Err("unknown panic".into())
        );
    }
}
