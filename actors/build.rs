//! Build script of the actor crate: its only job is the mutation check (as the engine's).
//!
//! `TRIBUTARY_MUTANT=<rule>` compiles this crate with `--cfg tributary_mutant="<rule>"`
//! (see `mutant!` in `src/lib.rs`); `loom_tests/run.sh` uses it for the cluster's rules,
//! which randomized tests catch. Unset or empty: a normal build.

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
