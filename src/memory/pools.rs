//! [`DevicePools`]: one device's slab pools, deferred frees and merge buffers.
//!
//! Bookkeeping only. It asks a [`PoolMemory`], the backend, to create and release slabs, and
//! hands out [`Allocation`]s: a [`BufferLoc`] and a size. [`crate::memory`] says why.

use std::collections::{btree_map::Entry, BTreeMap};

use serde::{Deserialize, Serialize};
use slab::Slab;

use super::suballoc::{align_up, RangeAllocator};
use crate::{
    error::{Error, Result},
    ids::{BufferLoc, DeviceId, PoolId, StreamId},
};

/// Something that tells whether work touching memory has finished (implemented for
/// the engine's `Event`).
///
/// `is_done` must be monotonic: once it returns `true` it keeps returning `true`.
pub trait UseEvent: Clone {
    /// Whether the work this event marks has completed.
    fn is_done(&self) -> bool;
    /// The stream the work runs on (work on one stream runs in FIFO order).
    fn stream(&self) -> StreamId;
}

/// Pool policy of one device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PoolConfig {
    /// Size of a general pool; a larger request gets a dedicated pool of its own size.
    pub pool_bytes: u64,
    /// Smallest alignment of any allocation (rounded up to a power of two by
    /// [`DevicePools::new`]). Sizes are rounded up to the allocation's alignment.
    pub min_alignment: u64,
    /// Device memory limit: reserved bytes (the sum of pool capacities) never exceed it.
    pub limit_bytes: Option<u64>,
    /// Release general pools that become completely free (keeping one spare).
    pub release_empty_pools: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            pool_bytes: 64 << 20,
            min_alignment: 64,
            limit_bytes: None,
            release_empty_pools: true,
        }
    }
}

/// What a pool is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PoolKind {
    /// Sub-allocated among tensor buffers.
    General,
    /// The merge buffer of a stream: a single tenant at offset 0.
    MergeBuffer(StreamId),
}

/// The memory behind a device's pools: the bookkeeping never touches memory itself, it
/// asks for slabs through this while it decides.
///
/// Creation is part of the decision, not carried out afterwards: a pool the backend cannot
/// create is never recorded, and the operation that needed it fails before anything else
/// changes (a two-phase allocation: ask for the memory, then commit). A released pool id may
/// be reused by a later creation; a release comes only after every event touching the pool
/// has completed, so the backend may free the memory at once.
pub trait PoolMemory {
    /// Creates a zeroed slab of `bytes` bytes whose base is aligned to `align` for `pool`.
    ///
    /// # Errors
    ///
    /// The backend's reason ([`Error::Device`], e.g. out of memory); the pool is then not
    /// created and the bookkeeping does not record it.
    fn create_pool(&mut self, pool: PoolId, bytes: u64, align: u64) -> Result<()>;

    /// Frees the slab of `pool` (nothing uses it any more).
    fn release_pool(&mut self, pool: PoolId);
}

/// Records the operations, and every creation succeeds: the bookkeeping on its own, for
/// tests and models that keep their own `pool -> memory` table.
impl PoolMemory for Vec<PoolOp> {
    fn create_pool(&mut self, pool: PoolId, bytes: u64, align: u64) -> Result<()> {
        self.push(PoolOp::Create { pool, bytes, align });
        Ok(())
    }

    fn release_pool(&mut self, pool: PoolId) {
        self.push(PoolOp::Release { pool });
    }
}

/// One call a [`DevicePools`] made on its [`PoolMemory`], as recorded by `Vec<PoolOp>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PoolOp {
    /// Create a zeroed slab of `bytes` bytes whose base is aligned to `align`.
    Create {
        /// The new pool.
        pool: PoolId,
        /// Its capacity.
        bytes: u64,
        /// Alignment of its base address (a power of two).
        align: u64,
    },
    /// Free the slab.
    Release {
        /// The pool to free.
        pool: PoolId,
    },
}

/// A live allocation: where it is and how many bytes it spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Allocation {
    /// Pool and offset.
    pub loc: BufferLoc,
    /// Size in bytes (the request rounded up to its alignment; for a merge buffer, the
    /// whole capacity of its pool).
    pub bytes: u64,
    /// Unique within one [`DevicePools`] and never reused: a stale copy of a freed
    /// allocation cannot free a later allocation that happens to get the same location.
    pub serial: u64,
}

/// One pool in [`PoolStats`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStat {
    /// The pool.
    pub pool: PoolId,
    /// What it is for.
    pub kind: PoolKind,
    /// Its capacity in bytes.
    pub capacity: u64,
    /// Bytes in live allocations (a merge pool's whole capacity while it serves its stream).
    pub live_bytes: u64,
    /// Bytes free for allocation.
    pub free_bytes: u64,
    /// Bytes freed but waiting for events (a retired merge pool's whole capacity).
    pub pending_bytes: u64,
}

/// Memory report of one device.
///
/// Invariants: `reserved_bytes` is the sum of the pools' capacities, and
/// `live_bytes + free_bytes + pending_free_bytes == reserved_bytes`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolStats {
    /// The device.
    pub device: DeviceId,
    /// Bytes in live allocations, merge buffers included.
    pub live_bytes: u64,
    /// Bytes of all pools together.
    pub reserved_bytes: u64,
    /// Highest `live_bytes` so far.
    pub peak_live_bytes: u64,
    /// Highest `reserved_bytes` so far.
    pub peak_reserved_bytes: u64,
    /// Number of general pools.
    pub pools: usize,
    /// Number of merge-buffer pools (including retired ones not yet released).
    pub merge_pools: usize,
    /// Bytes free for allocation.
    pub free_bytes: u64,
    /// Bytes freed but waiting for events to complete.
    pub pending_free_bytes: u64,
    /// The largest free block in any pool.
    pub largest_free_block: u64,
    /// `1 - largest_free_block / free_bytes` (0 when nothing is free).
    pub fragmentation: f64,
    /// Number of live general allocations (merge buffers are counted in `merge_pools`).
    pub allocations: usize,
    /// Allocations served from memory that already existed.
    pub reuse_count: u64,
    /// Allocations that needed a new pool.
    pub fresh_count: u64,
    /// Allocations (counted in `reuse_count`) served from a same-stream pending range.
    pub stream_reuse_count: u64,
    /// Per pool, by id.
    pub per_pool: Vec<PoolStat>,
}

#[derive(Clone, Debug)]
struct Pool {
    capacity: u64,
    /// Alignment of the pool's base address.
    align: u64,
    kind: PoolKind,
    /// Pending ranges count as live here until their events complete.
    ranges: RangeAllocator,
    pending_bytes: u64,
}

/// A freed range (or a retired merge pool) waiting for its events.
#[derive(Clone, Debug)]
struct Pending<E> {
    pool: PoolId,
    offset: u64,
    bytes: u64,
    /// Events not yet seen done.
    events: Vec<E>,
    /// The whole pool is released when the events are done (a retired merge buffer).
    retire_pool: bool,
}

#[derive(Clone, Debug)]
struct Live<E> {
    bytes: u64,
    serial: u64,
    /// Unfinished events of a pending range this allocation reused on their own stream;
    /// they are added to the events of its own free.
    carried: Vec<E>,
}

#[derive(Clone, Copy, Debug)]
struct MergeSlot {
    pool: PoolId,
    serial: u64,
}

/// The slab pools of one device: allocation, stream-ordered deferred free and merge buffers.
///
/// Generic over the event type so that the bookkeeping can be tested without streams.
#[derive(Clone, Debug)]
pub struct DevicePools<E: UseEvent> {
    device: DeviceId,
    config: PoolConfig,
    pools: Slab<Pool>,
    live: BTreeMap<BufferLoc, Live<E>>,
    pending: Vec<Pending<E>>,
    merge: BTreeMap<StreamId, MergeSlot>,
    next_serial: u64,
    live_bytes: u64,
    reserved_bytes: u64,
    pending_bytes: u64,
    peak_live_bytes: u64,
    peak_reserved_bytes: u64,
    reuse_count: u64,
    fresh_count: u64,
    stream_reuse_count: u64,
}

/// How to make room for a new pool: its capacity and the empty pools to release first.
struct Room {
    capacity: u64,
    release: Vec<PoolId>,
}

impl<E: UseEvent> DevicePools<E> {
    /// No pools yet; `config.min_alignment` is rounded up to a power of two (0 becomes 1).
    pub fn new(device: DeviceId, mut config: PoolConfig) -> Self {
        config.min_alignment = config
            .min_alignment
            .max(1)
            .checked_next_power_of_two()
            .unwrap_or(1 << 63);
        Self {
            device,
            config,
            pools: Slab::new(),
            live: BTreeMap::new(),
            pending: Vec::new(),
            merge: BTreeMap::new(),
            next_serial: 0,
            live_bytes: 0,
            reserved_bytes: 0,
            pending_bytes: 0,
            peak_live_bytes: 0,
            peak_reserved_bytes: 0,
            reuse_count: 0,
            fresh_count: 0,
            stream_reuse_count: 0,
        }
    }

    /// The device these pools belong to.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The policy in force.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Allocates `bytes` bytes aligned to `max(align, min_alignment)` for work on `stream`.
    ///
    /// Runs [`reclaim`](Self::reclaim) first, then serves the request from, in order: a
    /// pending range whose unfinished events are all on `stream` (stream-ordered reuse; only
    /// this stream can use it, so it goes first and leaves free space to the others); the
    /// free space of the general pools (first pool by id, best fit inside); a new pool of
    /// `max(pool_bytes, size)` bytes (smaller, down to `size`, when only that fits under the
    /// limit), releasing empty pools if that is the only way to stay under the limit.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidSize`] for 0 bytes, an alignment that is not a power of two or a size
    /// that overflows; [`Error::ForeignStream`] for a stream of another device;
    /// [`Error::PoolExhausted`] when the limit would be exceeded; the error of `memory` when
    /// it cannot create the new pool. On error nothing changes except what `reclaim` did and
    /// the release of empty pools made to stay under the limit.
    pub fn alloc(
        &mut self,
        bytes: u64,
        align: u64,
        stream: StreamId,
        memory: &mut dyn PoolMemory,
    ) -> Result<Allocation> {
        self.check_stream(stream)?;
        let (size, align) = self.normalize(bytes, align)?;
        self.reclaim(memory);
        if let Some(a) = self.alloc_from_pending(size, align, stream) {
            self.reuse_count += 1;
            self.stream_reuse_count += 1;
            return Ok(a);
        }
        if let Some(a) = self.alloc_from_free(size, align) {
            self.reuse_count += 1;
            return Ok(a);
        }
        let wanted = align_up(self.config.pool_bytes, align)
            .unwrap_or(size)
            .max(size);
        let room = self.plan_room(size, wanted, align, 0)?;
        let pool = self.create_pool(room, align, PoolKind::General, memory)?;
        let offset = self.pools[pool.0 as usize].ranges.alloc(size, align);
        debug_assert_eq!(offset, Some(0), "a new pool fits its first allocation");
        self.fresh_count += 1;
        Ok(self.add_live(pool, offset.unwrap_or(0), size, Vec::new()))
    }

    /// Frees `a` once every event in `last_uses` (the work that read or wrote it) has
    /// completed; until then the range is pending and only `alloc`s for the stream that
    /// runs all its unfinished events may reuse it. `stream` is the stream issuing the free.
    ///
    /// # Errors
    ///
    /// [`Error::NotLive`] when `a` is not live (already freed, a merge buffer, or never
    /// allocated here), [`Error::ForeignStream`] when `stream` belongs to another device;
    /// nothing changes then.
    pub fn free(&mut self, a: Allocation, last_uses: Vec<E>, stream: StreamId) -> Result<()> {
        self.check_stream(stream)?;
        let live = match self.live.entry(a.loc) {
            Entry::Occupied(e) if e.get().serial == a.serial && e.get().bytes == a.bytes => {
                e.remove()
            }
            _ => {
                return Err(Error::NotLive {
                    loc: a.loc,
                    bytes: a.bytes,
                })
            }
        };
        let mut events = last_uses;
        events.extend(live.carried);
        events.retain(|e| !e.is_done());
        self.live_bytes -= a.bytes;
        let Some(pool) = self.pools.get_mut(a.loc.pool.0 as usize) else {
            debug_assert!(false, "a live allocation's pool exists");
            return Ok(());
        };
        if events.is_empty() {
            let freed = pool.ranges.free(a.loc.offset);
            debug_assert_eq!(freed, Some(a.bytes));
        } else {
            pool.pending_bytes += a.bytes;
            self.pending_bytes += a.bytes;
            self.pending.push(Pending {
                pool: a.loc.pool,
                offset: a.loc.offset,
                bytes: a.bytes,
                events,
                retire_pool: false,
            });
        }
        Ok(())
    }

    /// Returns pending ranges whose events have all completed to their pools' free lists,
    /// releases retired merge pools whose events have completed, and, with
    /// `release_empty_pools`, releases completely free general pools but one (the largest):
    /// reused memory is several times faster than fresh memory, which page-faults.
    pub fn reclaim(&mut self, memory: &mut dyn PoolMemory) {
        for mut p in std::mem::take(&mut self.pending) {
            p.events.retain(|e| !e.is_done());
            if !p.events.is_empty() {
                self.pending.push(p);
                continue;
            }
            self.pending_bytes -= p.bytes;
            if p.retire_pool {
                self.release_pool(p.pool, memory);
            } else if let Some(pool) = self.pools.get_mut(p.pool.0 as usize) {
                pool.pending_bytes -= p.bytes;
                let freed = pool.ranges.free(p.offset);
                debug_assert_eq!(freed, Some(p.bytes));
            }
        }
        if self.config.release_empty_pools {
            let mut empty = self.empty_general_pools();
            if empty.len() > 1 {
                // Keep the largest (the first after sorting), release the rest.
                for (pool, _) in empty.drain(1..) {
                    self.release_pool(pool, memory);
                }
            }
        }
    }

    /// The merge buffer of `stream`, holding at least `bytes` bytes.
    ///
    /// Each stream has one merge-buffer pool with a single tenant at offset 0; it is
    /// returned as is when large enough. Otherwise a pool of `max(bytes, 2 * old)` bytes
    /// (less, down to `bytes`, when only that fits under the limit) replaces it, and the old
    /// pool is released once every event in `retire` (the work still using it) has
    /// completed. `retire` is ignored when the buffer does not grow.
    ///
    /// # Errors
    ///
    /// As [`alloc`](Self::alloc); on error the old merge buffer stays in place, with its
    /// contents.
    pub fn merge_buffer(
        &mut self,
        stream: StreamId,
        bytes: u64,
        retire: Vec<E>,
        memory: &mut dyn PoolMemory,
    ) -> Result<Allocation> {
        self.check_stream(stream)?;
        let (size, align) = self.normalize(bytes, self.config.min_alignment)?;
        self.reclaim(memory);
        let current = self.current_merge_buffer(stream);
        if let Some(m) = current.filter(|m| m.bytes >= size) {
            return Ok(m);
        }
        let old = current.map(|m| m.loc.pool);
        let old_capacity = current.map_or(0, |m| m.bytes);
        let mut retire = retire;
        retire.retain(|e| !e.is_done());
        if mutant!("merge_retire") {
            retire.clear();
        }
        let wanted = align_up(old_capacity.saturating_mul(2), align)
            .unwrap_or(size)
            .max(size);
        // An old pool with nothing left to wait for is released before the new one exists.
        let release_old_now = old.is_some() && retire.is_empty();
        // It counts as room, but goes only once the new pool exists: a failed creation
        // leaves the old buffer (and what it holds) in place.
        let extra = if release_old_now { old_capacity } else { 0 };
        let room = self.plan_room(size, wanted, align, extra)?;
        let pool = self.create_pool(room, align, PoolKind::MergeBuffer(stream), memory)?;
        let capacity = self.pools[pool.0 as usize].capacity;
        let offset = self.pools[pool.0 as usize].ranges.alloc(capacity, 1);
        debug_assert_eq!(offset, Some(0));
        if let Some(old) = old {
            self.live_bytes -= old_capacity;
            if release_old_now {
                self.release_pool(old, memory);
            } else {
                self.pools[old.0 as usize].pending_bytes = old_capacity;
                self.pending_bytes += old_capacity;
                self.pending.push(Pending {
                    pool: old,
                    offset: 0,
                    bytes: old_capacity,
                    events: retire,
                    retire_pool: true,
                });
            }
        }
        let serial = self.next_serial();
        self.merge.insert(stream, MergeSlot { pool, serial });
        self.live_bytes += capacity;
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
        Ok(Allocation {
            loc: BufferLoc { pool, offset: 0 },
            bytes: capacity,
            serial,
        })
    }

    /// The current merge buffer of `stream`, if it has one.
    pub fn current_merge_buffer(&self, stream: StreamId) -> Option<Allocation> {
        let slot = self.merge.get(&stream)?;
        Some(Allocation {
            loc: BufferLoc {
                pool: slot.pool,
                offset: 0,
            },
            bytes: self.pools.get(slot.pool.0 as usize)?.capacity,
            serial: slot.serial,
        })
    }

    /// The live allocation at `loc` (general allocations and current merge buffers).
    pub fn live(&self, loc: BufferLoc) -> Option<Allocation> {
        if let Some(l) = self.live.get(&loc) {
            return Some(Allocation {
                loc,
                bytes: l.bytes,
                serial: l.serial,
            });
        }
        match self.pools.get(loc.pool.0 as usize)?.kind {
            PoolKind::MergeBuffer(stream) if loc.offset == 0 => self
                .current_merge_buffer(stream)
                .filter(|a| a.loc.pool == loc.pool),
            _ => None,
        }
    }

    /// The capacity of `pool`, if it exists.
    pub fn pool_capacity(&self, pool: PoolId) -> Option<u64> {
        self.pools.get(pool.0 as usize).map(|p| p.capacity)
    }

    /// The kind of `pool`, if it exists.
    pub fn pool_kind(&self, pool: PoolId) -> Option<PoolKind> {
        self.pools.get(pool.0 as usize).map(|p| p.kind)
    }

    /// Whether freed memory waits for events to complete before it can be reused.
    pub fn has_pending_frees(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The memory report.
    pub fn stats(&self) -> PoolStats {
        let mut per_pool = Vec::with_capacity(self.pools.len());
        let (mut pools, mut merge_pools, mut free_bytes, mut largest) = (0, 0, 0, 0);
        for (key, p) in &self.pools {
            match p.kind {
                PoolKind::General => pools += 1,
                PoolKind::MergeBuffer(_) => merge_pools += 1,
            }
            free_bytes += p.ranges.free_bytes();
            largest = largest.max(p.ranges.largest_free());
            per_pool.push(PoolStat {
                pool: PoolId(key as u32),
                kind: p.kind,
                capacity: p.capacity,
                live_bytes: p.ranges.live_bytes() - p.pending_bytes,
                free_bytes: p.ranges.free_bytes(),
                pending_bytes: p.pending_bytes,
            });
        }
        let fragmentation = if free_bytes == 0 {
            0.0
        } else {
            1.0 - largest as f64 / free_bytes as f64
        };
        PoolStats {
            device: self.device,
            live_bytes: self.live_bytes,
            reserved_bytes: self.reserved_bytes,
            peak_live_bytes: self.peak_live_bytes,
            peak_reserved_bytes: self.peak_reserved_bytes,
            pools,
            merge_pools,
            free_bytes,
            pending_free_bytes: self.pending_bytes,
            largest_free_block: largest,
            fragmentation,
            allocations: self.live.len(),
            reuse_count: self.reuse_count,
            fresh_count: self.fresh_count,
            stream_reuse_count: self.stream_reuse_count,
            per_pool,
        }
    }

    fn check_stream(&self, stream: StreamId) -> Result<()> {
        if stream.device == self.device {
            Ok(())
        } else {
            Err(Error::ForeignStream {
                stream,
                device: self.device,
            })
        }
    }

    /// The size rounded up to the effective alignment, and that alignment.
    fn normalize(&self, bytes: u64, align: u64) -> Result<(u64, u64)> {
        let invalid = |reason: String| Error::InvalidSize {
            node: format!("allocation on {}", self.device),
            reason,
        };
        if bytes == 0 {
            return Err(invalid("0 bytes requested".into()));
        }
        let align = align.max(self.config.min_alignment);
        if !align.is_power_of_two() {
            return Err(invalid(format!("alignment {align} is not a power of two")));
        }
        let size = align_up(bytes, align)
            .ok_or_else(|| invalid(format!("{bytes} bytes aligned to {align} overflow u64")))?;
        Ok((size, align))
    }

    fn next_serial(&mut self) -> u64 {
        self.next_serial += 1;
        self.next_serial
    }

    fn add_live(&mut self, pool: PoolId, offset: u64, bytes: u64, carried: Vec<E>) -> Allocation {
        let serial = self.next_serial();
        let loc = BufferLoc { pool, offset };
        self.live.insert(
            loc,
            Live {
                bytes,
                serial,
                carried,
            },
        );
        self.live_bytes += bytes;
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
        Allocation { loc, bytes, serial }
    }

    /// First general pool (by id) whose free space fits; best fit inside it.
    fn alloc_from_free(&mut self, size: u64, align: u64) -> Option<Allocation> {
        let (key, offset) = self.pools.iter_mut().find_map(|(key, p)| {
            let fits = p.kind == PoolKind::General && p.align >= align;
            fits.then(|| p.ranges.alloc(size, align))
                .flatten()
                .map(|o| (key, o))
        })?;
        Some(self.add_live(PoolId(key as u32), offset, size, Vec::new()))
    }

    /// Best-fit pending range that `stream` may reuse: every unfinished event on it runs on
    /// `stream`, so the stream's FIFO order puts the new work after them. Unused head and
    /// tail bytes stay pending with the same events.
    fn alloc_from_pending(
        &mut self,
        size: u64,
        align: u64,
        stream: StreamId,
    ) -> Option<Allocation> {
        let mut best: Option<(usize, u64, u64)> = None; // (index, start, waste)
        for (i, p) in self.pending.iter().enumerate() {
            if p.retire_pool || self.pools[p.pool.0 as usize].align < align {
                continue;
            }
            if !p.events.iter().all(|e| e.is_done() || e.stream() == stream) {
                continue;
            }
            let Some(start) = align_up(p.offset, align) else {
                continue;
            };
            let end = p.offset + p.bytes;
            if start.checked_add(size).is_some_and(|e| e <= end) {
                let waste = p.bytes - size;
                if best.is_none_or(|(_, _, w)| waste < w) {
                    best = Some((i, start, waste));
                }
            }
        }
        let (i, start, _) = best?;
        let p = self.pending.remove(i);
        let carried: Vec<E> = p.events.into_iter().filter(|e| !e.is_done()).collect();
        let ranges = &mut self.pools[p.pool.0 as usize].ranges;
        let (head, tail) = (start - p.offset, p.offset + p.bytes - (start + size));
        if head > 0 {
            let split = ranges.split_live(p.offset, head);
            debug_assert!(split);
        }
        if tail > 0 {
            let split = ranges.split_live(start, size);
            debug_assert!(split);
        }
        for (offset, bytes) in [(p.offset, head), (start + size, tail)] {
            if bytes > 0 {
                self.pending.push(Pending {
                    pool: p.pool,
                    offset,
                    bytes,
                    events: carried.clone(),
                    retire_pool: false,
                });
            }
        }
        self.pools[p.pool.0 as usize].pending_bytes -= size;
        self.pending_bytes -= size;
        Some(self.add_live(p.pool, start, size, carried))
    }

    /// General pools with nothing live or pending, largest first (ties: lowest id first).
    fn empty_general_pools(&self) -> Vec<(PoolId, u64)> {
        let mut empty: Vec<(PoolId, u64)> = self
            .pools
            .iter()
            .filter(|(_, p)| p.kind == PoolKind::General && p.ranges.is_empty())
            .map(|(key, p)| (PoolId(key as u32), p.capacity))
            .collect();
        empty.sort_by_key(|&(pool, capacity)| (std::cmp::Reverse(capacity), pool));
        empty
    }

    /// Plans a new pool of `wanted` bytes, or at least `min`, under the limit. `extra` bytes
    /// are about to be released by the caller. Changes nothing.
    fn plan_room(&self, min: u64, wanted: u64, align: u64, extra: u64) -> Result<Room> {
        let Some(limit) = self.config.limit_bytes else {
            return Ok(Room {
                capacity: wanted,
                release: Vec::new(),
            });
        };
        let mut available = limit
            .saturating_sub(self.reserved_bytes)
            .saturating_add(extra);
        let mut release = Vec::new();
        if available < min && self.config.release_empty_pools {
            for (pool, capacity) in self.empty_general_pools() {
                if available >= min {
                    break;
                }
                available = available.saturating_add(capacity);
                release.push(pool);
            }
        }
        if available < min {
            return Err(Error::PoolExhausted {
                device: self.device,
                requested: min,
                available,
                limit,
            });
        }
        // `min` is a multiple of `align`, so rounding `available` down keeps it >= `min`.
        let capacity = wanted.min(available & !(align - 1)).max(min);
        Ok(Room { capacity, release })
    }

    /// Releases the pools `room` names (empty ones: their memory may be what the new pool
    /// needs), then has `memory` create a pool of `room.capacity` bytes and records it only
    /// if that succeeded.
    fn create_pool(
        &mut self,
        room: Room,
        align: u64,
        kind: PoolKind,
        memory: &mut dyn PoolMemory,
    ) -> Result<PoolId> {
        for pool in room.release {
            self.release_pool(pool, memory);
        }
        let Ok(id) = u32::try_from(self.pools.vacant_key()) else {
            return Err(Error::PoolExhausted {
                device: self.device,
                requested: room.capacity,
                available: 0,
                limit: self.config.limit_bytes.unwrap_or(u64::MAX),
            });
        };
        let pool = PoolId(id);
        memory.create_pool(pool, room.capacity, align)?;
        let entry = self.pools.vacant_entry();
        debug_assert_eq!(entry.key(), id as usize);
        entry.insert(Pool {
            capacity: room.capacity,
            align,
            kind,
            ranges: RangeAllocator::new(room.capacity),
            pending_bytes: 0,
        });
        self.reserved_bytes += room.capacity;
        self.peak_reserved_bytes = self.peak_reserved_bytes.max(self.reserved_bytes);
        Ok(pool)
    }

    /// Removes `pool` and tells the backend to free it. The caller has already taken its
    /// bytes out of the live or pending totals (a general pool is empty).
    fn release_pool(&mut self, pool: PoolId, memory: &mut dyn PoolMemory) {
        if let Some(p) = self.pools.try_remove(pool.0 as usize) {
            debug_assert!(p.kind != PoolKind::General || p.ranges.is_empty());
            self.reserved_bytes -= p.capacity;
            memory.release_pool(pool);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use std::sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    };

    use super::*;

    #[derive(Clone, Debug)]
    struct Ev {
        done: Arc<AtomicBool>,
        stream: StreamId,
    }

    impl Ev {
        fn new(stream: StreamId) -> Self {
            Self {
                done: Arc::new(AtomicBool::new(false)),
                stream,
            }
        }
        fn complete(&self) {
            self.done.store(true, Ordering::Release);
        }
    }

    impl UseEvent for Ev {
        fn is_done(&self) -> bool {
            self.done.load(Ordering::Acquire)
        }
        fn stream(&self) -> StreamId {
            self.stream
        }
    }

    const D: DeviceId = DeviceId(0);

    fn s(index: u32) -> StreamId {
        StreamId { device: D, index }
    }

    fn pools(pool_bytes: u64, limit: Option<u64>) -> DevicePools<Ev> {
        DevicePools::new(
            D,
            PoolConfig {
                pool_bytes,
                limit_bytes: limit,
                ..PoolConfig::default()
            },
        )
    }

    fn check(p: &DevicePools<Ev>) -> PoolStats {
        let st = p.stats();
        assert_eq!(
            st.live_bytes + st.free_bytes + st.pending_free_bytes,
            st.reserved_bytes
        );
        assert_eq!(
            st.per_pool.iter().map(|q| q.capacity).sum::<u64>(),
            st.reserved_bytes
        );
        assert_eq!(
            st.per_pool.iter().map(|q| q.live_bytes).sum::<u64>(),
            st.live_bytes
        );
        assert_eq!(
            st.per_pool.iter().map(|q| q.pending_bytes).sum::<u64>(),
            st.pending_free_bytes
        );
        assert!(st.peak_live_bytes >= st.live_bytes);
        assert!(st.peak_reserved_bytes >= st.reserved_bytes);
        if let Some(limit) = p.config().limit_bytes {
            assert!(st.reserved_bytes <= limit);
        }
        st
    }

    #[test]
    fn alloc_rounds_aligns_and_creates_pools() {
        let mut p = pools(4096, None);
        let mut ops = Vec::new();
        let a = p.alloc(100, 1, s(0), &mut ops).unwrap();
        assert_eq!(
            ops,
            vec![PoolOp::Create {
                pool: a.loc.pool,
                bytes: 4096,
                align: 64
            }]
        );
        assert_eq!((a.loc.offset, a.bytes), (0, 128));
        let b = p.alloc(10, 256, s(0), &mut ops).unwrap();
        assert_eq!(b.bytes, 256);
        assert_eq!(b.loc.offset % 256, 0);
        assert_ne!(
            b.loc.pool, a.loc.pool,
            "a 64-aligned pool cannot hold 256 alignment"
        );
        let c = p.alloc(64, 64, s(1), &mut ops).unwrap();
        assert_eq!(
            c.loc,
            BufferLoc {
                pool: a.loc.pool,
                offset: 128
            }
        );
        assert_eq!(p.live(c.loc), Some(c));
        assert_eq!(p.pool_capacity(a.loc.pool), Some(4096));
        assert_eq!(p.pool_kind(a.loc.pool), Some(PoolKind::General));
        let st = check(&p);
        assert_eq!((st.allocations, st.fresh_count, st.reuse_count), (3, 2, 1));
        assert_eq!(st.live_bytes, 128 + 256 + 64);
    }

    #[test]
    fn invalid_requests_are_errors() {
        let mut p = pools(4096, None);
        let mut ops = Vec::new();
        assert!(matches!(
            p.alloc(0, 1, s(0), &mut ops),
            Err(Error::InvalidSize { .. })
        ));
        assert!(matches!(
            p.alloc(8, 96, s(0), &mut ops),
            Err(Error::InvalidSize { .. })
        ));
        assert!(matches!(
            p.alloc(u64::MAX, 1, s(0), &mut ops),
            Err(Error::InvalidSize { .. })
        ));
        let other = StreamId {
            device: DeviceId(1),
            index: 0,
        };
        assert!(matches!(
            p.alloc(8, 1, other, &mut ops),
            Err(Error::ForeignStream { .. })
        ));
        assert!(matches!(
            p.merge_buffer(s(0), 0, vec![], &mut ops),
            Err(Error::InvalidSize { .. })
        ));
        assert!(ops.is_empty());
        assert_eq!(check(&p).reserved_bytes, 0);
    }

    #[test]
    fn min_alignment_is_normalised() {
        let p: DevicePools<Ev> = DevicePools::new(
            D,
            PoolConfig {
                min_alignment: 48,
                ..PoolConfig::default()
            },
        );
        assert_eq!(p.config().min_alignment, 64);
        let p: DevicePools<Ev> = DevicePools::new(
            D,
            PoolConfig {
                min_alignment: 0,
                ..PoolConfig::default()
            },
        );
        assert_eq!(p.config().min_alignment, 1);
    }

    #[test]
    fn freed_range_is_reused_only_after_its_event() {
        // One allocation fills a pool.
        let mut p = pools(1024, None);
        let mut ops = Vec::new();
        let a = p.alloc(1024, 64, s(0), &mut ops).unwrap();
        let e = Ev::new(s(1));
        p.free(a, vec![e.clone()], s(0)).unwrap();
        assert_eq!(check(&p).pending_free_bytes, 1024);
        // Stream 0 may not take it: the read on stream 1 is unfinished.
        let b = p.alloc(1024, 64, s(0), &mut ops).unwrap();
        assert_ne!(b.loc.pool, a.loc.pool);
        e.complete();
        let reuse_before = check(&p).reuse_count;
        let c = p.alloc(1024, 64, s(2), &mut ops).unwrap();
        assert_eq!(c.loc, a.loc);
        assert_ne!(c.serial, a.serial);
        let st = check(&p);
        assert_eq!(st.reuse_count, reuse_before + 1);
        assert_eq!(st.pending_free_bytes, 0);
        assert_eq!(st.stream_reuse_count, 0);
    }

    #[test]
    fn same_stream_reuses_pending_range_at_once() {
        let mut p = pools(4096, None);
        let mut ops = Vec::new();
        let a = p.alloc(1024, 64, s(0), &mut ops).unwrap();
        let _keep = p.alloc(3072, 64, s(0), &mut ops).unwrap(); // pool now full
        let e = Ev::new(s(0));
        p.free(a, vec![e.clone()], s(0)).unwrap();
        // Another stream cannot have it: a new pool.
        let other = p.alloc(256, 64, s(1), &mut ops).unwrap();
        assert_ne!(other.loc.pool, a.loc.pool);
        // The same stream gets its head at once; the tail stays pending.
        let b = p.alloc(256, 64, s(0), &mut ops).unwrap();
        assert_eq!(b.loc, a.loc);
        let st = check(&p);
        assert_eq!(st.stream_reuse_count, 1);
        assert_eq!(st.pending_free_bytes, 768);
        // The pending tail still belongs to stream 0 only.
        let c = p.alloc(768, 64, s(1), &mut ops).unwrap();
        assert_ne!(c.loc.pool, a.loc.pool);
        let d = p.alloc(768, 64, s(0), &mut ops).unwrap();
        assert_eq!(
            d.loc,
            BufferLoc {
                pool: a.loc.pool,
                offset: 256
            }
        );
        assert_eq!(check(&p).stream_reuse_count, 2);
        // The reused allocation carries the unfinished event: freed with an event on stream 1
        // only, stream 1 still may not reuse it while `e` (stream 0) is unfinished.
        let f = Ev::new(s(1));
        p.free(b, vec![f.clone()], s(1)).unwrap();
        f.complete();
        let g = p.alloc(256, 64, s(1), &mut ops).unwrap();
        assert_ne!(g.loc, b.loc);
        e.complete();
        p.reclaim(&mut ops);
        let h = p.alloc(256, 64, s(1), &mut ops).unwrap();
        assert_eq!(h.loc, b.loc);
        check(&p);
    }

    #[test]
    fn events_on_two_streams_block_both() {
        let mut p = pools(1024, None);
        let mut ops = Vec::new();
        let a = p.alloc(1024, 64, s(0), &mut ops).unwrap();
        let (e0, e1) = (Ev::new(s(0)), Ev::new(s(1)));
        p.free(a, vec![e0.clone(), e1.clone()], s(0)).unwrap();
        assert_ne!(p.alloc(1024, 64, s(0), &mut ops).unwrap().loc, a.loc);
        assert_ne!(p.alloc(1024, 64, s(1), &mut ops).unwrap().loc, a.loc);
        e1.complete();
        // Only stream 0's event remains: stream 0 may reuse, stream 1 may not.
        assert_ne!(p.alloc(1024, 64, s(1), &mut ops).unwrap().loc, a.loc);
        assert_eq!(p.alloc(1024, 64, s(0), &mut ops).unwrap().loc, a.loc);
        check(&p);
    }

    #[test]
    fn free_without_pending_events_is_immediate() {
        let mut p = pools(1024, None);
        let mut ops = Vec::new();
        let a = p.alloc(512, 64, s(0), &mut ops).unwrap();
        let done = Ev::new(s(1));
        done.complete();
        p.free(a, vec![done], s(0)).unwrap();
        let st = check(&p);
        assert_eq!((st.pending_free_bytes, st.free_bytes), (0, 1024));
    }

    #[test]
    fn double_and_stale_frees_are_errors() {
        let mut p = pools(1024, None);
        let mut ops = Vec::new();
        let a = p.alloc(512, 64, s(0), &mut ops).unwrap();
        p.free(a, vec![], s(0)).unwrap();
        let before = p.stats();
        assert!(matches!(
            p.free(a, vec![], s(0)),
            Err(Error::NotLive { .. })
        ));
        // Same location again: the stale copy still cannot free the new allocation.
        let b = p.alloc(512, 64, s(0), &mut ops).unwrap();
        assert_eq!(b.loc, a.loc);
        assert!(p.free(a, vec![], s(0)).is_err());
        assert!(p.free(Allocation { bytes: 64, ..b }, vec![], s(0)).is_err());
        assert_eq!(p.live(b.loc), Some(b));
        p.free(b, vec![], s(0)).unwrap();
        assert_eq!(p.stats().live_bytes, before.live_bytes);
        // A merge buffer is not freed through `free`.
        let m = p.merge_buffer(s(0), 64, vec![], &mut ops).unwrap();
        assert!(p.free(m, vec![], s(0)).is_err());
        check(&p);
    }

    #[test]
    fn limit_is_respected_and_failure_changes_nothing() {
        let mut p = pools(4096, Some(6144));
        let mut ops = Vec::new();
        let a = p.alloc(4096, 64, s(0), &mut ops).unwrap();
        // The second pool is clamped to what is left under the limit.
        let b = p.alloc(1024, 64, s(0), &mut ops).unwrap();
        assert_eq!(p.pool_capacity(b.loc.pool), Some(2048));
        let before = p.stats();
        let mut ops = Vec::new();
        let err = p.alloc(4096, 64, s(0), &mut ops).unwrap_err();
        assert_eq!(
            err,
            Error::PoolExhausted {
                device: D,
                requested: 4096,
                available: 0,
                limit: 6144
            }
        );
        assert_eq!(p.stats(), before);
        assert!(ops.is_empty());
        // Freeing the big allocation lets the pool be reused.
        p.free(a, vec![], s(0)).unwrap();
        assert_eq!(p.alloc(4096, 64, s(0), &mut ops).unwrap().loc, a.loc);
        check(&p);
    }

    #[test]
    fn empty_pools_are_released_under_pressure() {
        let mut p = pools(1024, Some(3072));
        let mut ops = Vec::new();
        let a = p.alloc(1024, 64, s(0), &mut ops).unwrap();
        let b = p.alloc(1024, 64, s(0), &mut ops).unwrap();
        p.free(a, vec![], s(0)).unwrap();
        p.free(b, vec![], s(0)).unwrap();
        p.reclaim(&mut ops);
        assert_eq!(check(&p).pools, 1, "one spare kept");
        ops.clear();
        // 3072 bytes need the spare's room: it is released to make space.
        let c = p.alloc(3072, 64, s(0), &mut ops).unwrap();
        assert_eq!(c.bytes, 3072);
        assert!(matches!(ops[0], PoolOp::Release { .. }));
        assert!(matches!(ops[1], PoolOp::Create { bytes: 3072, .. }));
        let st = check(&p);
        assert_eq!((st.pools, st.reserved_bytes), (1, 3072));
    }

    #[test]
    fn huge_requests_get_dedicated_pools_and_reclaim_keeps_one_spare() {
        let mut p = pools(1024, None);
        let mut ops = Vec::new();
        let small = p.alloc(64, 64, s(0), &mut ops).unwrap();
        let huge = p.alloc(10_000, 64, s(0), &mut ops).unwrap();
        assert_eq!(p.pool_capacity(huge.loc.pool), Some(10_048));
        let e = Ev::new(s(0));
        p.free(huge, vec![e.clone()], s(0)).unwrap();
        p.free(small, vec![], s(0)).unwrap();
        ops.clear();
        p.reclaim(&mut ops);
        // The huge pool is still pending, the small one is the only empty pool: kept.
        assert!(ops.is_empty());
        e.complete();
        p.reclaim(&mut ops);
        assert_eq!(
            ops,
            vec![PoolOp::Release {
                pool: small.loc.pool
            }]
        );
        let st = check(&p);
        assert_eq!((st.pools, st.reserved_bytes), (1, 10_048));
        // Without release_empty_pools, nothing is given back.
        let mut p: DevicePools<Ev> = DevicePools::new(
            D,
            PoolConfig {
                pool_bytes: 1024,
                release_empty_pools: false,
                ..PoolConfig::default()
            },
        );
        let a = p.alloc(1024, 64, s(0), &mut ops).unwrap();
        let b = p.alloc(1024, 64, s(0), &mut ops).unwrap();
        p.free(a, vec![], s(0)).unwrap();
        p.free(b, vec![], s(0)).unwrap();
        ops.clear();
        p.reclaim(&mut ops);
        assert!(ops.is_empty());
        assert_eq!(check(&p).pools, 2);
    }

    #[test]
    fn merge_buffer_grows_and_retires_after_events() {
        let mut p = pools(4096, None);
        let mut ops = Vec::new();
        let m = p.merge_buffer(s(0), 100, vec![], &mut ops).unwrap();
        assert_eq!((m.loc.offset, m.bytes), (0, 128));
        assert_eq!(p.pool_kind(m.loc.pool), Some(PoolKind::MergeBuffer(s(0))));
        assert_eq!(p.merge_buffer(s(0), 128, vec![], &mut ops).unwrap(), m);
        assert_eq!(p.current_merge_buffer(s(0)), Some(m));
        assert_eq!(p.live(m.loc), Some(m));
        // Streams have their own merge buffers.
        let m1 = p.merge_buffer(s(1), 64, vec![], &mut ops).unwrap();
        assert_ne!(m1.loc.pool, m.loc.pool);
        // Growing: at least twice the old size; the old pool waits for its consumer.
        let consumer = Ev::new(s(0));
        ops.clear();
        let g = p
            .merge_buffer(s(0), 200, vec![consumer.clone()], &mut ops)
            .unwrap();
        assert_eq!(g.bytes, 256);
        assert_eq!(
            ops,
            vec![PoolOp::Create {
                pool: g.loc.pool,
                bytes: 256,
                align: 64
            }]
        );
        let st = check(&p);
        assert_eq!((st.merge_pools, st.pending_free_bytes), (3, 128));
        assert_eq!(p.live(m.loc), None);
        ops.clear();
        p.reclaim(&mut ops);
        assert!(ops.is_empty());
        consumer.complete();
        p.reclaim(&mut ops);
        assert_eq!(ops, vec![PoolOp::Release { pool: m.loc.pool }]);
        let st = check(&p);
        assert_eq!(
            (st.merge_pools, st.live_bytes, st.reserved_bytes),
            (2, 320, 320)
        );
        // Growing with no unfinished user releases the old pool at once, but only after
        // the new one exists (a refused creation keeps the old buffer and its contents).
        ops.clear();
        let h = p.merge_buffer(s(0), 1000, vec![], &mut ops).unwrap();
        assert_eq!(h.bytes, 1024);
        assert!(matches!(ops[0], PoolOp::Create { bytes: 1024, .. }));
        assert_eq!(ops[1], PoolOp::Release { pool: g.loc.pool });
        check(&p);
    }

    #[test]
    fn merge_buffer_respects_the_limit() {
        let mut p = pools(4096, Some(1024));
        let mut ops = Vec::new();
        let m = p.merge_buffer(s(0), 512, vec![], &mut ops).unwrap();
        let user = Ev::new(s(0));
        let before = p.stats();
        // Needs 768 more while the old 512 are still in use: refused, buffer unchanged.
        assert!(matches!(
            p.merge_buffer(s(0), 768, vec![user.clone()], &mut ops),
            Err(Error::PoolExhausted { .. })
        ));
        assert_eq!(p.stats(), before);
        assert_eq!(p.current_merge_buffer(s(0)), Some(m));
        // Once the user is done the old pool counts as room (it goes once the new one exists);
        // growth is clamped to the limit.
        user.complete();
        let g = p
            .merge_buffer(s(0), 768, vec![user.clone()], &mut ops)
            .unwrap();
        assert_eq!(g.bytes, 1024);
        check(&p);
    }

    #[test]
    fn stats_serialise() {
        let mut p = pools(4096, None);
        let mut ops = Vec::new();
        let a = p.alloc(100, 64, s(0), &mut ops).unwrap();
        let _b = p.alloc(100, 64, s(0), &mut ops).unwrap();
        p.free(a, vec![], s(0)).unwrap();
        let st = check(&p);
        assert!(st.fragmentation > 0.0 && st.fragmentation < 1.0);
        let json = serde_json::to_string(&st).unwrap();
        let back: PoolStats = serde_json::from_str(&json).unwrap();
        assert_eq!(back, st);
        let cfg: PoolConfig = serde_json::from_str(r#"{"limit_bytes": 100}"#).unwrap();
        assert_eq!(cfg.limit_bytes, Some(100));
        assert_eq!(cfg.pool_bytes, PoolConfig::default().pool_bytes);
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<Allocation>(&json).unwrap(), a);
    }
}
