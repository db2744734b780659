//! Slab pools (placeholder, being written).
