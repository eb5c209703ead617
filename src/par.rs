//! Row-parallel loops on every core, with results independent of the thread count.

pub use crate::config::threads;

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
