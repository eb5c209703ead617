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
    for_each(out.chunks_mut(per * row_len).enumerate(), |(i, chunk)| {
        f(i * per, chunk)
    });
}

/// Copies `src` into `dst` (as long) on every core, `piece` elements a row of [`for_rows`]:
/// where the source is a file's map read for the first time, its page faults are most of the
/// copy, and every core takes its share of them.
pub fn copy<T: Copy + Send + Sync>(dst: &mut [T], src: &[T], piece: usize) {
    for_rows(dst, piece, piece, |first, part| {
        let at = first * piece;
        part.copy_from_slice(&src[at..at + part.len()]);
    });
}

/// Calls `f` on every item, on up to [`threads`] threads that take the items in turn from a
/// shared queue, the calling thread among them. A thread that cannot be spawned (the host's
/// limits) leaves its share to the others: every item is still done once, nothing fails.
pub fn for_each<I>(items: I, f: impl Fn(I::Item) + Sync)
where
    I: Iterator + Send,
    I::Item: Send,
{
    let queue = std::sync::Mutex::new(items);
    let work = || loop {
        let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
        match next {
            Some(item) => f(item),
            None => break,
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads() {
            if std::thread::Builder::new().spawn_scoped(s, work).is_err() {
                break;
            }
        }
        work();
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_item_is_done_once() {
        let done: Vec<std::sync::atomic::AtomicU32> = (0..1000)
            .map(|_| std::sync::atomic::AtomicU32::new(0))
            .collect();
        super::for_each(0..1000usize, |i| {
            done[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        assert!(done
            .iter()
            .all(|d| d.load(std::sync::atomic::Ordering::Relaxed) == 1));
    }
}
