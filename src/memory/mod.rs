//! Slab pools: where device buffers live, and when freed memory may be used again. See
//! DESIGN.md §2, "Buffer location", and §3, rules 4 and 5.
//!
//! Every device buffer is a [`BufferLoc`] inside one of the device's slab pools. The protocol
//! sees only locations, and each backend resolves them privately. This module is the
//! bookkeeping, with no memory and no backend in it. [`DevicePools`] is a device's registry.
//! It answers `alloc`, `free` and `merge_buffer` with [`Allocation`]s, using a
//! [`RangeAllocator`] per pool. It asks a [`PoolMemory`], the backend, for slabs as it
//! decides, so a slab the backend cannot create fails before anything is recorded.
//! [`AlignedBuffer`] is the host memory behind CPU pools and host arrays.
//!
//! Fresh memory is slow: on the CPU a new buffer's first touch runs at about a fifth of the
//! speed of reused memory, and on GPUs an allocation may synchronise the device. So pools are
//! large slabs, 64 MiB by default, that are kept. An empty pool is released only if another
//! empty one is kept as a spare. A request larger than a pool gets a pool of its own. A
//! request over the optional device limit fails with [`Error::PoolExhausted`].
//!
//! [`DevicePools::free`] takes the events of the work that may still use the range. The range
//! stays pending until [`DevicePools::reclaim`] sees them all done. But if every unfinished
//! event of a pending range is on stream `S`, an `alloc` for `S` may take it at once. The new
//! allocation carries those events, and its own free waits for them too.
//!
//! A merge buffer is a pool of its own, with one tenant at offset 0. It grows into a new pool
//! at least twice the size, and the old pool is released after its `retire` events.
//!
//! Invariants, checked by `tests/engine/pool_props.rs`: live allocations never overlap, respect their
//! alignment and lie inside their pool. `reserved_bytes` is the sum of pool capacities and
//! equals `live + free + pending`. Nothing pending goes to a stream while an unfinished event
//! of another stream touches it.
//!
//! [`BufferLoc`]: crate::BufferLoc
//! [`Error::PoolExhausted`]: crate::Error::PoolExhausted

mod aligned;
mod pools;
mod suballoc;

pub use aligned::{AlignedBuffer, OutOfBounds};
pub use pools::{
    Allocation, DevicePools, PoolConfig, PoolKind, PoolMemory, PoolOp, PoolStat, PoolStats,
    UseEvent,
};
pub use suballoc::RangeAllocator;
