//! loom models of the protocol (run with `RUSTFLAGS="--cfg tributary_loom"`).
#![cfg(tributary_loom)]
