//! Row-parallel loops on every core, with results independent of the thread count.

use std::sync::OnceLock;

/// Worker threads to use: `DV2_THREADS` if set, else the machine's parallelism.
pub fn threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| {
        std::env::var("DV2_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    })
}

/// Rows per thread for `rows` rows of `work_per_row` elements each: one thread below
/// ~256 K elements of work, where spawning costs more than it saves.
pub fn rows_per_thread(rows: usize, work_per_row: usize) -> usize {
    const MIN_WORK_PER_THREAD: usize = 1 << 18;
    let by_work = MIN_WORK_PER_THREAD.div_ceil(work_per_row.max(1));
    rows.div_ceil(threads()).max(by_work).max(1)
}

/// Calls `f(first_row, rows_chunk)` over `out` (rows of `row_len` elements) in parallel.
/// Every row is computed by exactly one call, so results do not depend on the split.
pub fn for_rows<T: Send>(
    out: &mut [T],
    row_len: usize,
    work_per_row: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let rows = out.len() / row_len.max(1);
    let per = rows_per_thread(rows, work_per_row);
    if per >= rows {
        f(0, out);
        return;
    }
    std::thread::scope(|s| {
        for (i, chunk) in out.chunks_mut(per * row_len).enumerate() {
            let f = &f;
            s.spawn(move || f(i * per, chunk));
        }
    });
}
