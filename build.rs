//! Build script of the engine crate: its only job is the mutation check.
//!
//! `TRIBUTARY_MUTANT=<rule>` in the environment compiles this crate with
//! `--cfg tributary_mutant="<rule>"`, exactly as `RUSTFLAGS='--cfg tributary_mutant="<rule>"'`
//! would (see `mutant!` in `src/lib.rs`), but without changing `RUSTFLAGS`: cargo then
//! rebuilds only this crate and its tests when the mutant changes, instead of the whole
//! dependency graph. `TRIBUTARY_MUTANTS=1` compiles every mutant in, each chosen when a
//! process starts (`TRIBUTARY_ACTIVE_MUTANT=<rule>`): one build for the whole mutation
//! check (`loom_tests/run.sh`). Unset or empty: a normal build.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=TRIBUTARY_MUTANT");
    println!("cargo:rerun-if-env-changed=TRIBUTARY_MUTANTS");
    if !std::env::var("TRIBUTARY_MUTANTS")
        .unwrap_or_default()
        .is_empty()
    {
        println!("cargo:rustc-cfg=tributary_mutants");
    }
    let rule = std::env::var("TRIBUTARY_MUTANT").unwrap_or_default();
    if rule.is_empty() {
        return;
    }
    if !rule.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        panic!("TRIBUTARY_MUTANT must be a rule name ([A-Za-z0-9_]+), got {rule:?}");
    }
    println!("cargo:rustc-cfg=tributary_mutant=\"{rule}\"");
}
