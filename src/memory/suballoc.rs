//! [`RangeAllocator`]: byte-range bookkeeping inside one pool of fixed capacity.
//!
//! It hands out offsets and never touches memory. Free space is indexed by offset, to coalesce
//! neighbours, and by size, for best fit. Each operation is logarithmic in the number of
//! ranges. A request aligned beyond the offsets' natural alignment may look at the few free
//! blocks smaller than `size + align - 1` before one fits.

use std::collections::{BTreeMap, BTreeSet};

/// Byte ranges allocated inside `0..capacity`.
///
/// Invariants: live and free ranges tile `0..capacity` exactly, and no two free ranges are
/// adjacent (they are coalesced).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeAllocator {
    capacity: u64,
    /// Free ranges, offset -> size.
    free_by_offset: BTreeMap<u64, u64>,
    /// The same free ranges as (size, offset), for best-fit.
    free_by_size: BTreeSet<(u64, u64)>,
    /// Live ranges, offset -> size.
    live: BTreeMap<u64, u64>,
    live_bytes: u64,
}

/// `x` rounded up to a multiple of `align` (a power of two), or `None` on overflow.
pub(crate) fn align_up(x: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    x.checked_add(align - 1).map(|v| v & !(align - 1))
}

impl RangeAllocator {
    /// An allocator with all of `0..capacity` free.
    pub fn new(capacity: u64) -> Self {
        let mut a = Self {
            capacity,
            free_by_offset: BTreeMap::new(),
            free_by_size: BTreeSet::new(),
            live: BTreeMap::new(),
            live_bytes: 0,
        };
        a.insert_free(0, capacity);
        a
    }

    /// The capacity given at creation.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    fn insert_free(&mut self, offset: u64, size: u64) {
        if size > 0 {
            self.free_by_offset.insert(offset, size);
            self.free_by_size.insert((size, offset));
        }
    }

    fn remove_free(&mut self, offset: u64, size: u64) {
        self.free_by_offset.remove(&offset);
        self.free_by_size.remove(&(size, offset));
    }

    /// Allocates `size` bytes at an offset that is a multiple of `align` (a power of two),
    /// best fit: the smallest free block that can hold it. Padding before the offset and the
    /// rest of the block stay free. `None` when nothing fits, `size` is 0 or `align` is not a
    /// power of two.
    pub fn alloc(&mut self, size: u64, align: u64) -> Option<u64> {
        if size == 0 || !align.is_power_of_two() {
            return None;
        }
        // Blocks in increasing size; the first of at least `size + align - 1` bytes always
        // fits, so the scan stops there at the latest.
        let (block_off, block_size, start) =
            self.free_by_size
                .range((size, 0)..)
                .find_map(|&(block_size, block_off)| {
                    let start = align_up(block_off, align)?;
                    let end = start.checked_add(size)?;
                    (end <= block_off + block_size).then_some((block_off, block_size, start))
                })?;
        self.remove_free(block_off, block_size);
        self.insert_free(block_off, start - block_off);
        self.insert_free(start + size, block_off + block_size - (start + size));
        self.live.insert(start, size);
        self.live_bytes += size;
        Some(start)
    }

    /// Frees the live range starting at `offset`, coalescing it with free neighbours.
    /// Returns its size, or `None` (and changes nothing) when no live range starts there.
    pub fn free(&mut self, offset: u64) -> Option<u64> {
        let size = self.live.remove(&offset)?;
        self.live_bytes -= size;
        let (mut start, mut len) = (offset, size);
        let before = self
            .free_by_offset
            .range(..offset)
            .next_back()
            .map(|(&o, &s)| (o, s));
        if let Some((o, s)) = before {
            if o + s == offset {
                self.remove_free(o, s);
                start = o;
                len += s;
            }
        }
        if let Some(&s) = self.free_by_offset.get(&(offset + size)) {
            self.remove_free(offset + size, s);
            len += s;
        }
        self.insert_free(start, len);
        Some(size)
    }

    /// Splits the live range starting at `offset` into two live ranges, `offset..offset + at`
    /// and the rest. Returns `false` (and changes nothing) when no live range starts at
    /// `offset` or `at` is not strictly inside it.
    pub fn split_live(&mut self, offset: u64, at: u64) -> bool {
        match self.live.get_mut(&offset) {
            Some(size) if at > 0 && at < *size => {
                let rest = *size - at;
                *size = at;
                self.live.insert(offset + at, rest);
                true
            }
            _ => false,
        }
    }

    /// The size of the live range starting at `offset`.
    pub fn live_size(&self, offset: u64) -> Option<u64> {
        self.live.get(&offset).copied()
    }

    /// Bytes in live ranges.
    pub fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    /// Bytes in free ranges.
    pub fn free_bytes(&self) -> u64 {
        self.capacity - self.live_bytes
    }

    /// The largest free block (0 when full).
    pub fn largest_free(&self) -> u64 {
        self.free_by_size.last().map_or(0, |&(size, _)| size)
    }

    /// Whether no range is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Number of live ranges.
    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    /// Live ranges as `(offset, size)`, by offset.
    pub fn live_ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.live.iter().map(|(&o, &s)| (o, s))
    }

    /// Free ranges as `(offset, size)`, by offset.
    pub fn free_ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.free_by_offset.iter().map(|(&o, &s)| (o, s))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    /// Checks the tiling and coalescing invariants.
    fn check(a: &RangeAllocator) {
        let mut ranges: Vec<(u64, u64, bool)> = a
            .live_ranges()
            .map(|(o, s)| (o, s, true))
            .chain(a.free_ranges().map(|(o, s)| (o, s, false)))
            .collect();
        ranges.sort();
        let mut at = 0;
        let mut prev_free = false;
        for (o, s, live) in ranges {
            assert_eq!(o, at, "gap or overlap at {o}");
            assert!(s > 0);
            assert!(live || !prev_free, "adjacent free ranges at {o}");
            prev_free = !live;
            at = o + s;
        }
        assert_eq!(at, a.capacity());
        assert_eq!(a.free_by_size.len(), a.free_by_offset.len());
        assert_eq!(a.live_bytes() + a.free_bytes(), a.capacity());
        assert_eq!(a.free_ranges().map(|(_, s)| s).sum::<u64>(), a.free_bytes());
    }

    #[test]
    fn alloc_free_coalesce() {
        let mut a = RangeAllocator::new(1024);
        let x = a.alloc(100, 1).unwrap();
        let y = a.alloc(200, 1).unwrap();
        let z = a.alloc(300, 1).unwrap();
        assert_eq!((x, y, z), (0, 100, 300));
        check(&a);
        assert_eq!(a.free(y), Some(200));
        check(&a);
        assert_eq!(a.free(x), Some(100));
        check(&a);
        assert_eq!(
            a.free_ranges().collect::<Vec<_>>(),
            vec![(0, 300), (600, 424)]
        );
        assert_eq!(a.free(z), Some(300));
        check(&a);
        assert!(a.is_empty());
        assert_eq!(a.largest_free(), 1024);
    }

    #[test]
    fn best_fit_and_alignment_padding() {
        let mut a = RangeAllocator::new(4096);
        let offs: Vec<u64> = (0..8).map(|_| a.alloc(512, 512).unwrap()).collect();
        a.free(offs[1]);
        a.free(offs[3]);
        a.free(offs[4]);
        check(&a);
        // Best fit: the 512-byte hole at 512, not the 1024-byte one at 1536.
        assert_eq!(a.alloc(100, 1), Some(512));
        check(&a);
        // Alignment 1024 inside the hole 1536..2560: the start is padded to 2048, and the
        // padding 1536..2048 stays free.
        assert_eq!(a.alloc(256, 1024), Some(2048));
        check(&a);
        assert!(a.free_ranges().any(|r| r == (1536, 512)));
        assert_eq!(a.largest_free(), 512);
        assert_eq!(a.alloc(513, 1), None);
        check(&a);
    }

    #[test]
    fn refusals_change_nothing() {
        let mut a = RangeAllocator::new(256);
        let before = a.clone();
        assert_eq!(a.alloc(0, 8), None);
        assert_eq!(a.alloc(8, 3), None);
        assert_eq!(a.alloc(257, 1), None);
        assert_eq!(a.free(0), None);
        assert!(!a.split_live(0, 1));
        assert_eq!(a, before);
        let x = a.alloc(64, 64).unwrap();
        let before = a.clone();
        assert_eq!(a.free(x + 1), None);
        assert!(!a.split_live(x, 0));
        assert!(!a.split_live(x, 64));
        assert_eq!(a, before);
        assert_eq!(a.free(x), Some(64));
        assert_eq!(a.free(x), None, "double free is refused");
    }

    #[test]
    fn split_then_free_pieces() {
        let mut a = RangeAllocator::new(1000);
        let x = a.alloc(600, 1).unwrap();
        assert!(a.split_live(x, 100));
        assert!(a.split_live(x + 100, 200));
        assert_eq!(a.live_size(x + 300), Some(300));
        assert_eq!(a.live_count(), 3);
        check(&a);
        a.free(x + 100);
        check(&a);
        a.free(x + 300);
        check(&a);
        assert_eq!(a.free_ranges().collect::<Vec<_>>(), vec![(100, 900)]);
        a.free(x);
        check(&a);
        assert_eq!(a.largest_free(), 1000);
    }

    #[test]
    fn zero_capacity_and_exact_fit() {
        let mut a = RangeAllocator::new(0);
        assert_eq!(a.alloc(1, 1), None);
        check(&a);
        let mut a = RangeAllocator::new(64);
        assert_eq!(a.alloc(64, 64), Some(0));
        assert_eq!(a.largest_free(), 0);
        assert_eq!(a.free_bytes(), 0);
        check(&a);
    }

    #[test]
    fn alignment_near_u64_max_does_not_overflow() {
        let mut a = RangeAllocator::new(u64::MAX);
        assert_eq!(a.alloc(1, 1), Some(0));
        assert_eq!(a.alloc(1, 1 << 63), Some(1 << 63));
        assert_eq!(a.alloc(u64::MAX, 1), None);
        check(&a);
    }
}
