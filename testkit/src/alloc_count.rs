//! A global allocator that counts heap allocations on every thread of the process, for
//! `examples/allocations.rs` and `tests/allocations.rs`. A binary installs it with
//! `#[global_allocator] static A: Counting = Counting;` and reads [`allocations`].

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicU64, Ordering},
};

/// The system allocator, counting `alloc`, `alloc_zeroed` and `realloc` calls.
pub struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

/// Allocations so far, on every thread, when [`Counting`] is the global allocator.
pub fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

/// Allocations made by the second of two runs of `run`: the first warms up what a run grows
/// (queues, pools, tables), so the second shows what a run allocates in steady state.
pub fn allocations_of_second_run<E>(run: impl FnMut() -> Result<(), E>) -> Result<u64, E> {
    Ok(allocations_after_warm_up(run, 1, 0)?
        .first()
        .copied()
        .unwrap_or(0))
}

/// Allocations of each counted run of `run` after one warm-up run: counted until a run makes
/// at most `enough`, at most `runs` times (a pool that grew to a new peak in flight in one
/// run allocates nothing for it in the next; an allocation per operation shows in every run).
pub fn allocations_after_warm_up<E>(
    mut run: impl FnMut() -> Result<(), E>,
    runs: usize,
    enough: u64,
) -> Result<Vec<u64>, E> {
    run()?;
    let mut counted = Vec::new();
    for _ in 0..runs {
        let before = allocations();
        run()?;
        let used = allocations() - before;
        counted.push(used);
        if used <= enough {
            break;
        }
    }
    Ok(counted)
}

// SAFETY: every method forwards to the system allocator with the caller's arguments, so
// the `GlobalAlloc` contract holds as it does for `System`; counting touches no memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged (this method's contract).
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }
}
