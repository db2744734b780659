//! Event timelines (placeholder, being written).
