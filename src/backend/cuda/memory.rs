//! Device memory and host staging: pools as device allocations, locations resolved to device
//! pointers, each stream's pinned staging ring, and the route of a copy between two devices.
//!
//! A ring is one pinned allocation of `CudaConfig::staging_bytes`, made on the first
//! transfer. A transfer is cut into slots of at most a quarter of the ring, so copies
//! overlap. A slot is reused only after its copy completed. The bookkeeping, [`RingBook`]
//! and [`copy_route`], is plain data tested without a driver. The allocations,
//! [`DevicePool`] and [`PinnedMemory`], free themselves on drop.

use std::{
    collections::VecDeque,
    sync::{Arc, Condvar, Mutex},
    time::Duration,
};

use cudarc::driver::{result, sys, CudaContext, DriverError};

use super::instance::{driver_error, lock};
use crate::error::DeviceError;

/// Maps an allocation failure to [`DeviceError`].
pub(super) fn alloc_error(what: &str, bytes: u64, e: DriverError) -> DeviceError {
    match e.0 {
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => DeviceError::OutOfMemory { requested: bytes },
        _ => DeviceError::Unexpected(format!("{what} of {bytes} bytes: {}", driver_error(e))),
    }
}

/// One pool: a device allocation in one context, freed when the last user drops it.
pub(super) struct DevicePool {
    ctx: Arc<CudaContext>,
    base: sys::CUdeviceptr,
    bytes: u64,
}

impl DevicePool {
    /// Allocates `bytes` (at least 1) of device memory in `ctx` (`cuMemAlloc`: aligned to at
    /// least 256 bytes, more than any pool alignment asks).
    pub(super) fn new(ctx: &Arc<CudaContext>, bytes: u64) -> Result<DevicePool, DeviceError> {
        let size = usize::try_from(bytes.max(1))
            .map_err(|_| DeviceError::OutOfMemory { requested: bytes })?;
        ctx.bind_to_thread()
            .map_err(|e| DeviceError::Lost(driver_error(e)))?;
        // SAFETY: the context is current on this thread; the allocation is freed exactly
        // once, by `Drop`, after every user (held by `Arc`) is gone.
        let base = unsafe { result::malloc_sync(size) }
            .map_err(|e| alloc_error("cuMemAlloc", bytes, e))?;
        Ok(DevicePool {
            ctx: ctx.clone(),
            base,
            bytes,
        })
    }

    /// The context that owns the allocation.
    pub(super) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        // SAFETY: work that uses the pool holds an `Arc` to it until its completion was
        // observed, so nothing enqueued refers to this memory any more; freed only here.
        let freed = self
            .ctx
            .bind_to_thread()
            .and_then(|()| unsafe { result::free_sync(self.base) });
        if let Err(e) = freed {
            tracing::warn!(error = %driver_error(e), "cannot free a CUDA pool");
        }
    }
}

/// A checked byte range of a pool: `base + offset .. + bytes`.
#[derive(Clone)]
pub(super) struct Region {
    pub(super) pool: Arc<DevicePool>,
    pub(super) offset: u64,
    pub(super) bytes: u64,
}

impl Region {
    /// The range `offset .. offset + bytes` of `pool`, or why it does not fit.
    pub(super) fn new(pool: Arc<DevicePool>, offset: u64, bytes: u64) -> Result<Region, String> {
        match offset.checked_add(bytes) {
            Some(end) if end <= pool.bytes => Ok(Region {
                pool,
                offset,
                bytes,
            }),
            _ => Err(format!(
                "{bytes} bytes at offset {offset} exceed the pool's {} bytes",
                pool.bytes
            )),
        }
    }

    /// The device pointer of the range's first byte.
    pub(super) fn ptr(&self) -> sys::CUdeviceptr {
        self.pool.base + self.offset
    }

    /// The device pointer `at` bytes into the range.
    pub(super) fn ptr_at(&self, at: u64) -> sys::CUdeviceptr {
        self.ptr() + at
    }
}

/// Pinned, portable host memory (`cuMemHostAlloc`), freed on drop.
pub(super) struct PinnedMemory {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: the allocation is plain host memory owned by this value; which bytes are read or
// written when is decided by the staging ring (a slot is used by one transfer at a time).
unsafe impl Send for PinnedMemory {}
// SAFETY: as above; shared references only expose the address.
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    /// `bytes` of page-locked host memory, portable (pinned for every context).
    pub(super) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<PinnedMemory, DeviceError> {
        ctx.bind_to_thread()
            .map_err(|e| DeviceError::Lost(driver_error(e)))?;
        // SAFETY: the context is current; the memory is freed once, in `Drop`.
        let ptr = unsafe { result::malloc_host(bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| alloc_error("cuMemHostAlloc", bytes as u64, e))?;
        Ok(PinnedMemory {
            ctx: ctx.clone(),
            ptr: ptr.cast(),
            bytes,
        })
    }

    /// The address `offset` bytes in, when `offset + len` fits.
    pub(super) fn at(&self, offset: usize, len: usize) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        // SAFETY: `offset <= end <= bytes`, inside the allocation.
        (end <= self.bytes).then(|| unsafe { self.ptr.add(offset) })
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        // SAFETY: the ring that owns this memory is dropped only after every transfer that
        // used a slot completed (the watcher holds the ring until it observed them).
        let freed = self
            .ctx
            .bind_to_thread()
            .and_then(|()| unsafe { result::free_host(self.ptr.cast()) });
        if let Err(e) = freed {
            tracing::warn!(error = %driver_error(e), "cannot free pinned staging memory");
        }
    }
}

/// A slot of the ring: `offset .. offset + len`, released by its ticket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Slot {
    pub(super) offset: usize,
    pub(super) len: usize,
    pub(super) ticket: u64,
}

/// Which bytes of a ring buffer are in use: slots are taken at the head and released, in
/// the order they were taken, at the tail; a slot that does not fit before the end starts
/// again at 0 (the end's remainder stays unused until the ring wraps past it).
#[derive(Debug)]
pub(super) struct RingBook {
    capacity: usize,
    in_use: VecDeque<Slot>,
    next_ticket: u64,
}

impl RingBook {
    /// An empty ring of `capacity` bytes.
    pub(super) fn new(capacity: usize) -> RingBook {
        RingBook {
            capacity,
            in_use: VecDeque::new(),
            next_ticket: 1,
        }
    }

    /// The ring's size.
    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Slots taken and not yet released.
    #[cfg(test)]
    pub(super) fn in_use(&self) -> usize {
        self.in_use.len()
    }

    /// Takes `len` contiguous bytes: `Ok(None)` when they are not free now (release older
    /// slots first), an error when they never will be.
    pub(super) fn take(&mut self, len: usize) -> Result<Option<Slot>, String> {
        if len == 0 || len > self.capacity {
            return Err(format!(
                "a staging slot of {len} bytes in a ring of {} bytes",
                self.capacity
            ));
        }
        let offset = match (self.in_use.front(), self.in_use.back()) {
            (Some(oldest), Some(newest)) => {
                let (tail, head) = (oldest.offset, newest.offset + newest.len);
                if newest.offset >= oldest.offset {
                    // In use: [tail, head). Free: [head, capacity) then [0, tail).
                    if head + len <= self.capacity {
                        Some(head)
                    } else if len <= tail {
                        Some(0)
                    } else {
                        None
                    }
                } else {
                    // Wrapped. In use: [tail, capacity) and [0, head). Free: [head, tail).
                    (head + len <= tail).then_some(head)
                }
            }
            _ => Some(0),
        };
        Ok(offset.map(|offset| {
            let slot = Slot {
                offset,
                len,
                ticket: self.next_ticket,
            };
            self.next_ticket += 1;
            self.in_use.push_back(slot);
            slot
        }))
    }

    /// Releases every slot up to `ticket` (the transfers that used them completed).
    pub(super) fn release_upto(&mut self, ticket: u64) {
        while self.in_use.front().is_some_and(|s| s.ticket <= ticket) {
            self.in_use.pop_front();
        }
    }
}

/// A stream's staging ring: the bookkeeping, and the pinned memory made on first use.
pub(super) struct StagingRing {
    ctx: Arc<CudaContext>,
    state: Mutex<RingState>,
    freed: Condvar,
}

struct RingState {
    book: RingBook,
    memory: Option<Arc<PinnedMemory>>,
    /// The watcher is gone: nothing will be released any more.
    closed: bool,
}

impl StagingRing {
    /// A ring of `capacity` bytes in `ctx` (allocated on the first [`StagingRing::take`]).
    pub(super) fn new(ctx: Arc<CudaContext>, capacity: usize) -> StagingRing {
        StagingRing {
            ctx,
            state: Mutex::new(RingState {
                book: RingBook::new(capacity),
                memory: None,
                closed: false,
            }),
            freed: Condvar::new(),
        }
    }

    /// The largest slot worth taking: a quarter of the ring, so that copies overlap.
    pub(super) fn chunk(&self) -> usize {
        (lock(&self.state).book.capacity() / 4).max(1)
    }

    /// Takes a slot of `len` bytes, waiting for the watcher to release older ones.
    pub(super) fn take(&self, len: usize) -> Result<(Slot, Arc<PinnedMemory>), String> {
        let mut s = lock(&self.state);
        let memory = match &s.memory {
            Some(m) => m.clone(),
            None => {
                let m = Arc::new(
                    PinnedMemory::new(&self.ctx, s.book.capacity()).map_err(|e| e.to_string())?,
                );
                s.memory = Some(m.clone());
                m
            }
        };
        loop {
            if let Some(slot) = s.book.take(len)? {
                return Ok((slot, memory));
            }
            if s.closed {
                return Err("the stream's watcher is gone".into());
            }
            s = self
                .freed
                .wait_timeout(s, Duration::from_millis(100))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Releases the slots up to `ticket` (called by the watcher, in order).
    pub(super) fn release_upto(&self, ticket: u64) {
        lock(&self.state).book.release_upto(ticket);
        self.freed.notify_all();
    }

    /// No more releases will come.
    pub(super) fn close(&self) {
        lock(&self.state).closed = true;
        self.freed.notify_all();
    }
}

/// How bytes move from one device's pool to another's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CopyRoute {
    /// `cuMemcpyDtoDAsync`: one context addresses both.
    Direct,
    /// `cuMemcpyPeerAsync` between two contexts with peer access, or two contexts of one
    /// GPU (which the driver copies on the GPU without peer access).
    Peer,
    /// Through pinned host memory: download from the source, upload to the destination.
    Staged,
}

/// What decides a copy's route.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RouteFacts {
    /// Source and destination are the same tributary device.
    pub(super) same_device: bool,
    /// Source and destination are in the same CUDA context.
    pub(super) same_context: bool,
    /// The destination's context has peer access to the source's.
    pub(super) peer_access: bool,
    /// Source and destination contexts are on the same physical GPU (two logical devices
    /// of one GPU: the driver refuses peer access between them, yet `cuMemcpyPeerAsync`
    /// copies on the GPU at device bandwidth).
    pub(super) same_gpu: bool,
    /// [`super::CudaConfig::force_staging`].
    pub(super) force_staging: bool,
}

/// The route of a copy: inside one device always direct; across devices staged when forced,
/// direct in one context, peer-to-peer where peer access is on or both contexts are on one
/// GPU, staged otherwise.
pub(super) fn copy_route(f: RouteFacts) -> CopyRoute {
    if f.same_device {
        CopyRoute::Direct
    } else if f.force_staging {
        CopyRoute::Staged
    } else if f.same_context {
        CopyRoute::Direct
    } else if f.peer_access || f.same_gpu {
        CopyRoute::Peer
    } else {
        CopyRoute::Staged
    }
}

/// Whether a kernel on the destination device can read the source's memory in place (not
/// merely because both are on one GPU: without peer access a context need not map the
/// other's allocations).
pub(super) fn can_address(f: RouteFacts) -> bool {
    f.same_device || f.same_context || f.peer_access
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(b: &mut RingBook, len: usize) -> Option<(usize, u64)> {
        b.take(len).expect("fits").map(|s| (s.offset, s.ticket))
    }

    #[test]
    fn slots_follow_each_other_and_wrap_around() {
        let mut b = RingBook::new(100);
        assert_eq!(take(&mut b, 40), Some((0, 1)));
        assert_eq!(take(&mut b, 40), Some((40, 2)));
        // 30 bytes do not fit before the end (80..110) nor before the oldest slot (0..0).
        assert_eq!(take(&mut b, 30), None);
        b.release_upto(1);
        // Now [0, 40) is free: the slot wraps to 0, leaving 80..100 unused.
        assert_eq!(take(&mut b, 30), Some((0, 3)));
        // Wrapped: free is [30, 40) only.
        assert_eq!(take(&mut b, 11), None);
        assert_eq!(take(&mut b, 10), Some((30, 4)));
        assert_eq!(take(&mut b, 1), None);
        b.release_upto(2);
        // In use [0, 40) not wrapped any more: the end [40, 100) is free again.
        assert_eq!(take(&mut b, 60), Some((40, 5)));
        assert_eq!(b.in_use(), 3);
        b.release_upto(5);
        assert_eq!(b.in_use(), 0);
        assert_eq!(take(&mut b, 100), Some((0, 6)));
    }

    #[test]
    fn a_slot_is_reused_only_after_its_release() {
        let mut b = RingBook::new(64);
        let first = take(&mut b, 64).expect("empty ring");
        for _ in 0..3 {
            assert_eq!(take(&mut b, 1), None, "the ring is full until the release");
        }
        // Releasing an older ticket than the slot's frees nothing.
        b.release_upto(first.1 - 1);
        assert_eq!(take(&mut b, 1), None);
        b.release_upto(first.1);
        assert_eq!(take(&mut b, 64).map(|s| s.0), Some(0));
    }

    #[test]
    fn impossible_slots_are_errors() {
        let mut b = RingBook::new(16);
        assert!(b.take(0).is_err());
        let e = b.take(17).expect_err("larger than the ring");
        assert!(e.contains("17 bytes") && e.contains("16 bytes"), "{e}");
    }

    #[test]
    fn many_transfers_cycle_through_the_ring_without_overlap() {
        let mut b = RingBook::new(1000);
        let mut live: VecDeque<Slot> = VecDeque::new();
        for i in 0..500usize {
            let len = 1 + (i * 37) % 300;
            let slot = loop {
                if let Some(s) = b.take(len).expect("fits") {
                    break s;
                }
                let oldest = live.pop_front().expect("a full ring has slots in use");
                b.release_upto(oldest.ticket);
            };
            assert!(slot.offset + slot.len <= 1000);
            for other in &live {
                let apart = slot.offset + slot.len <= other.offset
                    || other.offset + other.len <= slot.offset;
                assert!(apart, "{slot:?} overlaps {other:?}");
            }
            live.push_back(slot);
        }
    }

    #[test]
    fn routes() {
        let f = |same_device, same_context, peer_access, force_staging| RouteFacts {
            same_device,
            same_context,
            peer_access,
            force_staging,
            same_gpu: false,
        };
        let one_gpu = |force_staging| RouteFacts {
            same_gpu: true,
            ..f(false, false, false, force_staging)
        };
        use CopyRoute::*;
        // Two logical devices of one GPU: peer copies (the first GPU run found them staged
        // through the host at a tenth of the bandwidth), staged only when forced, never
        // addressed in place.
        assert_eq!(copy_route(one_gpu(false)), Peer);
        assert_eq!(copy_route(one_gpu(true)), Staged);
        assert!(!can_address(one_gpu(false)));
        assert_eq!(copy_route(f(true, true, false, true)), Direct);
        assert_eq!(copy_route(f(false, true, true, false)), Direct);
        assert_eq!(copy_route(f(false, false, true, false)), Peer);
        assert_eq!(copy_route(f(false, false, true, true)), Staged);
        assert_eq!(copy_route(f(false, false, false, false)), Staged);
        assert!(can_address(f(true, true, false, true)));
        assert!(can_address(f(false, false, true, false)));
        assert!(!can_address(f(false, false, false, false)));
    }
}
