//! Slab pools: where device buffers live, and when freed memory may be used again.
//!
//! Every device buffer is a [`BufferLoc`](crate::BufferLoc) `{pool, offset}` inside one of
//! the device's slab pools (DESIGN.md §2, "Buffer location"). The protocol and its tables
//! see only locations; each backend keeps its own `pool -> memory` table and resolves them
//! privately. This module is the bookkeeping behind those locations, with no memory and no
//! backend in it:
//!
//! - [`RangeAllocator`] hands out byte ranges inside one pool (best fit, coalescing free).
//! - [`DevicePools`] is a device's pool registry. It answers `alloc`, `free` and
//!   `merge_buffer` with [`Allocation`]s, asking a [`PoolMemory`] (the backend) to create
//!   and release slabs as it decides, so that a slab the backend cannot create fails the
//!   allocation before anything is recorded.
//! - [`AlignedBuffer`] is the zeroed, aligned host memory behind CPU pools and host arrays.
//!
//! # Why pools, and why they keep their slabs
//!
//! Fresh memory is expensive: on the CPU the first touch of a new buffer runs at about a
//! fifth of the speed of reused memory (page faults), and on GPUs an allocation call may
//! synchronise the device. So pools are large slabs (64 MiB by default) that are
//! sub-allocated and kept: freed ranges go back to a free list, and a pool that becomes
//! completely free is released only if another empty one is kept as a spare
//! (`release_empty_pools`). A request larger than a pool gets a dedicated pool of its own
//! size. An optional device limit caps the reserved bytes; a request that cannot fit fails
//! with [`Error::PoolExhausted`](crate::Error::PoolExhausted) and changes nothing.
//!
//! # Deferred free (DESIGN.md §3, rule 5)
//!
//! Work runs later than it is scheduled, so a buffer freed by the host may still be read or
//! written by queued work on several streams. [`DevicePools::free`] takes the events of
//! that work (`last_uses`); the range stays *pending* and returns to the free list only in
//! [`DevicePools::reclaim`] once every one of them is done. OCANNL freed at once and
//! relied on luck (or on `cuMemFree` synchronising); this is the fix.
//!
//! # Stream-ordered reuse
//!
//! A stream runs its work in FIFO order, so if every unfinished event of a pending range is
//! on stream `S`, new work on `S` runs after all of them: an `alloc` for `S` may take the
//! range at once, as CUDA's `cuMemAllocAsync` and PyTorch's caching allocator do. Another
//! stream never may. The reusing allocation carries the range's unfinished events, and its
//! own free waits for them too, so the rule holds however the new buffer is used.
//!
//! # Merge buffers
//!
//! Each stream has one merge buffer (OCANNL's pool 0, one per stream here) receiving a tensor
//! from another context so that a routine can combine it. It is a pool of its own with a
//! single tenant at offset 0. When a larger node arrives the buffer grows into a new pool of
//! at least twice the size, and the old pool is released only after the work still using it
//! (`retire` events) is done; OCANNL released it at once (`ac86c4aa` leaked it, the CUDA
//! backend freed memory queued kernels could still read).
//!
//! # Invariants
//!
//! Live allocations never overlap, respect their alignment (pool bases are aligned at least
//! as much as anything inside them) and lie inside their pool; `reserved_bytes` is the sum
//! of the pool capacities and equals `live + free + pending`; nothing pending is handed to a
//! stream while an event of another stream touching it is unfinished. `tests/pool_props.rs`
//! checks all of these on random operation sequences.

mod aligned;
mod pools;
mod suballoc;

pub use aligned::{AlignedBuffer, OutOfBounds};
pub use pools::{
    Allocation, DevicePools, PoolConfig, PoolKind, PoolMemory, PoolOp, PoolStat, PoolStats,
    UseEvent,
};
pub use suballoc::RangeAllocator;
