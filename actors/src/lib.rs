//! The actor layer of tributary (see `DESIGN.md` §4).
//!
//! This crate will host `DeviceActor`, `StreamActor`, `Coordinator` and the host-side
//! `System` handle on top of the engine crate [`tributary`]. It is intentionally empty until
//! the actor issue lands; the workspace builds it so the layering is checked from day one.

pub use tributary;
