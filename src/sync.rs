//! Synchronisation shim (placeholder, being written).
