//! Build script of the engine crate: its only job is the mutation check.
//!
//! `TRIBUTARY_MUTANT=<rule>` in the environment compiles this crate with
//! `--cfg tributary_mutant="<rule>"`, exactly as `RUSTFLAGS='--cfg tributary_mutant="<rule>"'`
//! would (see `mutant!` in `src/lib.rs`), but without changing `RUSTFLAGS`: cargo then
//! rebuilds only this crate and its tests when the mutant changes, instead of the whole
//! dependency graph (`loom_tests/run.sh` builds one mutant after the other). Unset or
//! empty: a normal build.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=TRIBUTARY_MUTANT");
    let rule = std::env::var("TRIBUTARY_MUTANT").unwrap_or_default();
    if rule.is_empty() {
        return;
    }
    if !rule.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        panic!("TRIBUTARY_MUTANT must be a rule name ([A-Za-z0-9_]+), got {rule:?}");
    }
    println!("cargo:rustc-cfg=tributary_mutant=\"{rule}\"");
}
