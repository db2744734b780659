//! Small copyable identifiers shared by every layer.
//!
//! Identifiers are plain integers so that tables, plans and traces stay deterministic and
//! serialisable; nothing here refers to memory or to a backend.

use std::fmt;

use serde::{Deserialize, Serialize};

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
