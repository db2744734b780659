//! [`AlignedBuffer`]: zero-initialised host memory with a chosen alignment.
//!
//! The CPU backend backs each slab pool and each host array with one. The device actor and the
//! stream workers share it. The buffer does no locking. The protocol orders any two uses of
//! overlapping bytes where one writes, and that makes the `unsafe` accessors sound; see
//! DESIGN.md §3. A holder of `&mut self` gets safe accessors.

use std::{
    alloc::{self, Layout},
    fmt,
    ptr::{self, NonNull},
    slice,
};

use crate::error::DeviceError;

/// A byte range that does not lie inside an [`AlignedBuffer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("byte range {offset}+{len} is outside a buffer of {buffer_len} bytes")]
pub struct OutOfBounds {
    /// Start of the requested range.
    pub offset: usize,
    /// Length of the requested range.
    pub len: usize,
    /// Length of the buffer.
    pub buffer_len: usize,
}

impl From<OutOfBounds> for DeviceError {
    fn from(e: OutOfBounds) -> Self {
        DeviceError::Unexpected(e.to_string())
    }
}

/// A zero-initialised heap allocation of `len` bytes aligned to a power of two, freed on
/// drop.
///
/// Length 0 allocates nothing (the pointer is dangling but aligned).
///
/// An alignment above 16 bytes is reached by allocating `align` bytes more at 16 bytes and
/// starting inside: the system allocator zeroes such a request with `calloc`, whose large
/// blocks are fresh pages the kernel zeroes when first touched, where a request aligned
/// above it is zeroed by a `memset` of every byte at once. A 64 MiB slab pool with its
/// first page written costs 12 µs instead of 38 ms (BENCHMARKS.md, "A new CPU pool").
pub struct AlignedBuffer {
    /// Where the bytes start: `base` rounded up to `align`.
    ptr: NonNull<u8>,
    len: usize,
    align: usize,
    /// The allocation itself (`None` for length 0), freed on drop.
    base: Option<(NonNull<u8>, Layout)>,
}

/// The largest alignment at which the system allocator zeroes by `calloc` (its minimum
/// alignment on the 64-bit targets tributary builds for).
const ZEROED_ALIGN: usize = 16;

/// SAFETY: `AlignedBuffer` owns its allocation exclusively (like a `Box<[u8]>`); nothing in
/// it is tied to the thread that created it, so moving it to another thread is sound.
unsafe impl Send for AlignedBuffer {}

/// SAFETY: every method taking `&self` that reads or writes the bytes is `unsafe` and makes
/// the caller promise that no conflicting access (a write overlapping any other access)
/// happens at the same time; the safe `&self` methods only read the pointer, length and
/// alignment, which never change. Sharing references across threads is therefore sound.
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    /// Allocates `len` zeroed bytes aligned to `align` (a power of two).
    ///
    /// # Errors
    ///
    /// [`DeviceError::OutOfMemory`] when the allocator refuses or `len` rounded up to `align`
    /// overflows; [`DeviceError::Unexpected`] when `align` is not a power of two.
    pub fn new(len: usize, align: usize) -> Result<Self, DeviceError> {
        if !align.is_power_of_two() {
            return Err(DeviceError::Unexpected(format!(
                "alignment {align} is not a power of two"
            )));
        }
        let requested = u64::try_from(len).unwrap_or(u64::MAX);
        let oom = DeviceError::OutOfMemory { requested };
        // What a caller could ask of `Layout`: refused here too, whatever the padding.
        Layout::from_size_align(len, align).map_err(|_| oom.clone())?;
        if len == 0 {
            // A non-null, aligned pointer without provenance: valid for zero-sized accesses.
            let dangling = ptr::null_mut::<u8>().wrapping_add(align);
            let ptr = NonNull::new(dangling).ok_or(oom)?;
            return Ok(Self {
                ptr,
                len,
                align,
                base: None,
            });
        }
        let (padded, at) = if align <= ZEROED_ALIGN {
            (len, align)
        } else {
            (len.checked_add(align).ok_or(oom.clone())?, ZEROED_ALIGN)
        };
        let layout = Layout::from_size_align(padded, at).map_err(|_| oom.clone())?;
        // SAFETY: `layout` has a non-zero size (`len > 0`) and a valid alignment.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let base = NonNull::new(raw).ok_or(oom)?;
        let skip = raw.align_offset(align);
        debug_assert!(
            skip <= padded - len,
            "the padding holds the way to alignment"
        );
        // SAFETY: `skip < align` when `align > at` (an `at`-aligned pointer is at most
        // `align - at` bytes short of the next multiple of `align`), so `skip + len <=
        // padded` and the result stays inside the allocation; `skip` is 0 otherwise.
        let ptr = unsafe { base.add(skip) };
        Ok(Self {
            ptr,
            len,
            align,
            base: Some((base, layout)),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has length 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The alignment of the start of the buffer.
    pub fn align(&self) -> usize {
        self.align
    }

    /// The start of the buffer. Writing through it is subject to the same rules as
    /// [`bytes_mut`](Self::bytes_mut).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), OutOfBounds> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(OutOfBounds {
                offset,
                len,
                buffer_len: self.len(),
            }),
        }
    }

    /// The bytes `offset..offset + len`, or an error when they are not all inside the buffer.
    ///
    /// # Safety
    ///
    /// While the returned slice lives, nobody may write any of these bytes (through
    /// [`bytes_mut`](Self::bytes_mut), [`fill_zero`](Self::fill_zero) or
    /// [`as_ptr`](Self::as_ptr)). The synchronisation protocol guarantees this by ordering
    /// every write after the reads it conflicts with, and the other way round.
    pub unsafe fn bytes(&self, offset: usize, len: usize) -> Result<&[u8], OutOfBounds> {
        self.check(offset, len)?;
        // SAFETY: `offset + len <= self.len()`, so the range lies inside one live allocation
        // (or is empty, with an aligned non-null pointer); the bytes are initialised (zeroed
        // at allocation); the caller promises no concurrent writes.
        Ok(unsafe { slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) })
    }

    /// The bytes `offset..offset + len` for writing, or an error when they are not all inside
    /// the buffer.
    ///
    /// # Safety
    ///
    /// While the returned slice lives, nobody else may read or write any of these bytes
    /// (through [`bytes`](Self::bytes), another `bytes_mut`, [`fill_zero`](Self::fill_zero)
    /// or [`as_ptr`](Self::as_ptr)). The synchronisation protocol guarantees this: a write is
    /// ordered after every earlier access to the same buffer and before every later one.
    #[allow(clippy::mut_from_ref)] // interior mutability guarded by the caller's contract
    pub unsafe fn bytes_mut(&self, offset: usize, len: usize) -> Result<&mut [u8], OutOfBounds> {
        self.check(offset, len)?;
        // SAFETY: bounds as in `bytes`; the caller promises exclusive access to the range for
        // the slice's lifetime, so no aliasing reference exists.
        Ok(unsafe { slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) })
    }

    /// Sets the bytes `offset..offset + len` to zero.
    ///
    /// # Safety
    ///
    /// Same obligation as [`bytes_mut`](Self::bytes_mut) for the duration of the call.
    pub unsafe fn fill_zero(&self, offset: usize, len: usize) -> Result<(), OutOfBounds> {
        self.check(offset, len)?;
        // SAFETY: in bounds (checked); the caller promises no concurrent access to the range.
        unsafe { ptr::write_bytes(self.ptr.as_ptr().add(offset), 0, len) };
        Ok(())
    }

    /// The whole buffer, mutably. Safe: `&mut self` rules out every other access.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `&mut self` is exclusive; the full range is in bounds and initialised.
        unsafe { slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn copy_from_slice_at(&mut self, offset: usize, src: &[u8]) -> Result<(), OutOfBounds> {
        self.check(offset, src.len())?;
        self.as_mut_slice()[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    /// Copies the bytes at `offset` into `dst`.
    ///
    /// Takes `&mut self` because shared (`&self`) access to the bytes is reserved to the
    /// protocol-guarded `unsafe` accessors; use [`bytes`](Self::bytes) from shared code.
    pub fn copy_to_slice_at(&mut self, offset: usize, dst: &mut [u8]) -> Result<(), OutOfBounds> {
        self.check(offset, dst.len())?;
        dst.copy_from_slice(&self.as_mut_slice()[offset..offset + dst.len()]);
        Ok(())
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        if let Some((base, layout)) = self.base {
            // SAFETY: `base` came from `alloc_zeroed` with exactly this layout and is freed
            // only here, once.
            unsafe { alloc::dealloc(base.as_ptr(), layout) };
        }
    }
}

impl fmt::Debug for AlignedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len())
            .field("align", &self.align())
            .finish()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn is_send_and_sync() {
        assert_send_sync::<AlignedBuffer>();
    }

    #[test]
    fn zeroed_and_aligned() {
        // Small and large (a large block is fresh pages from calloc), at alignments up to
        // calloc's and past it (the start moved inside a padded block).
        for len in [1000, 3 << 20] {
            for align in [1, 8, 16, 64, 4096] {
                let mut b = AlignedBuffer::new(len, align).unwrap();
                assert_eq!(b.len(), len);
                assert_eq!(b.align(), align);
                assert_eq!(b.as_ptr() as usize % align, 0);
                // SAFETY: nobody else uses `b`.
                let bytes = unsafe { b.bytes(0, len) }.unwrap();
                assert!(bytes.iter().all(|&x| x == 0));
                // Every byte up to the last is the buffer's own to write.
                b.as_mut_slice().fill(0xA5);
                assert!(b.as_mut_slice().iter().all(|&x| x == 0xA5));
            }
        }
    }

    #[test]
    fn empty_buffer_is_aligned_and_allocates_nothing() {
        let mut b = AlignedBuffer::new(0, 256).unwrap();
        assert!(b.is_empty());
        assert_eq!(b.as_ptr() as usize % 256, 0);
        assert!(!b.as_ptr().is_null());
        assert!(b.as_mut_slice().is_empty());
        // SAFETY: nobody else uses `b`.
        assert_eq!(unsafe { b.bytes(0, 0) }.unwrap(), &[] as &[u8]);
        // SAFETY: as above.
        assert!(unsafe { b.bytes(0, 1) }.is_err());
    }

    #[test]
    fn bad_alignment_and_huge_sizes_are_errors() {
        assert!(matches!(
            AlignedBuffer::new(8, 3),
            Err(DeviceError::Unexpected(_))
        ));
        assert!(matches!(
            AlignedBuffer::new(8, 0),
            Err(DeviceError::Unexpected(_))
        ));
        assert!(matches!(
            AlignedBuffer::new(usize::MAX - 10, 64),
            Err(DeviceError::OutOfMemory { .. })
        ));
    }

    #[test]
    fn accessors_check_bounds() {
        let mut b = AlignedBuffer::new(64, 64).unwrap();
        assert_eq!(
            b.copy_from_slice_at(60, &[1; 8]),
            Err(OutOfBounds {
                offset: 60,
                len: 8,
                buffer_len: 64
            })
        );
        // SAFETY: nobody else uses `b`.
        unsafe {
            assert!(b.bytes(usize::MAX, 2).is_err());
            assert!(b.bytes_mut(65, 0).is_err());
            assert!(b.fill_zero(1, 64).is_err());
        }
        let e: DeviceError = OutOfBounds {
            offset: 1,
            len: 2,
            buffer_len: 0,
        }
        .into();
        assert!(matches!(e, DeviceError::Unexpected(_)));
    }

    #[test]
    fn copies_and_zero_fill_round_trip() {
        let mut b = AlignedBuffer::new(128, 64).unwrap();
        b.copy_from_slice_at(10, &[1, 2, 3, 4]).unwrap();
        let mut out = [0u8; 6];
        b.copy_to_slice_at(9, &mut out).unwrap();
        assert_eq!(out, [0, 1, 2, 3, 4, 0]);
        // SAFETY: nobody else uses `b`.
        unsafe {
            b.bytes_mut(100, 2).unwrap().copy_from_slice(&[7, 8]);
            assert_eq!(b.bytes(99, 4).unwrap(), &[0, 7, 8, 0]);
            b.fill_zero(11, 2).unwrap();
            assert_eq!(b.bytes(10, 4).unwrap(), &[1, 0, 0, 4]);
        }
    }

    #[test]
    fn disjoint_ranges_from_two_threads() {
        let b = std::sync::Arc::new(AlignedBuffer::new(2 * 4096, 64).unwrap());
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let b = b.clone();
                std::thread::spawn(move || {
                    // SAFETY: each thread writes its own disjoint half.
                    let half = unsafe { b.bytes_mut(i * 4096, 4096) }.unwrap();
                    half.fill(i as u8 + 1);
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        // SAFETY: the writers have been joined.
        let all = unsafe { b.bytes(0, 2 * 4096) }.unwrap();
        assert!(all[..4096].iter().all(|&x| x == 1));
        assert!(all[4096..].iter().all(|&x| x == 2));
    }
}
