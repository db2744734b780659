//! Small copyable identifiers shared by every layer. They are plain integers, so tables, plans
//! and traces stay deterministic and serialisable.

use std::{
    collections::HashMap,
    fmt,
    hash::{BuildHasherDefault, Hasher},
};

use serde::{Deserialize, Serialize};

/// A hash map keyed by identifiers, hashed by [`IdHasher`].
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Hashes identifiers (small integers and pairs of them) by a rotate, an xor and one
/// multiplication per word (Fibonacci hashing), not by SipHash: the protocol's tables are
/// looked up several times per scheduled routine (SipHash was 9% of the instructions of a
/// tiny routine through `System`, `BENCHMARKS.md`), and their keys are chosen by the
/// runtime, not by an adversary. Deterministic: no per-process seed.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHasher(u64);

impl IdHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

impl Hasher for IdHasher {
    /// The state with its best-mixed (high) half folded into the low bits the map indexes
    /// its buckets with: a multiplication leaves the low bits of the product depending
    /// only on the low bits of the operands, and buffer offsets are multiples of their
    /// alignment (the test below).
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 32)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.add(u64::from(b));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u16(&mut self, n: u16) {
        self.add(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
}

/// Identifies a tensor node, unique within one node registry (one engine or system).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub u32);

/// Identifies a device, unique across the whole system (all backends together).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DeviceId(pub u32);

/// Identifies a stream: the device it belongs to and its index on that device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct StreamId {
    /// The device that owns the stream.
    pub device: DeviceId,
    /// The index of the stream on its device, from 0.
    pub index: u32,
}

/// Identifies a slab pool inside one device's pool registry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PoolId(pub u32);

/// Identifies a context, unique within one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ContextId(pub u64);

/// Where a buffer lives: a pool of one device and a byte offset inside it.
///
/// The protocol and its tables only ever see locations; each backend resolves them to
/// memory privately (DESIGN.md §2, "Buffer location").
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BufferLoc {
    /// The pool holding the buffer.
    pub pool: PoolId,
    /// Byte offset of the buffer inside its pool.
    pub offset: u64,
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.0)
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "d{}", self.0)
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "d{}s{}", self.device.0, self.index)
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p{}", self.0)
    }
}

impl fmt::Display for ContextId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "c{}", self.0)
    }
}

impl fmt::Display for BufferLoc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}+{}", self.pool, self.offset)
    }
}

#[cfg(test)]
mod tests {
    use std::hash::{BuildHasher, BuildHasherDefault};

    use super::*;

    fn hash(v: impl std::hash::Hash) -> u64 {
        BuildHasherDefault::<IdHasher>::default().hash_one(v)
    }

    #[test]
    fn aligned_buffer_offsets_of_one_pool_spread_over_the_low_bits() {
        let buckets: std::collections::HashSet<u64> = (0..1024u64)
            .map(|i| {
                hash(BufferLoc {
                    pool: PoolId(3),
                    offset: i * 256,
                }) & 1023
            })
            .collect();
        assert!(
            buckets.len() > 550, // random hashing: ~647 on average
            "1,024 offsets of one pool fell into {} of 1,024 buckets",
            buckets.len()
        );
    }

    #[test]
    fn identifiers_hash_apart_and_the_same_every_time() {
        let hashes: std::collections::HashSet<u64> = (0..10_000).map(|i| hash(NodeId(i))).collect();
        assert_eq!(hashes.len(), 10_000);
        assert_eq!(hash(ContextId(7)), hash(ContextId(7)));
    }
}
