//! Build script of the actor crate: its only job is the mutation check (as the engine's).
//!
//! `TRIBUTARY_MUTANT=<rule>` compiles this crate with `--cfg tributary_mutant="<rule>"`;
//! `TRIBUTARY_MUTANTS=1` compiles every mutant in (`--cfg tributary_mutants`), each chosen
//! when a process starts (`TRIBUTARY_ACTIVE_MUTANT=<rule>`, read by the engine's
//! `tributary::mutants::active`, which the same variable compiles in). See `mutant!` in
//! `src/lib.rs`; `loom_tests/run.sh` checks the cluster's rules with one such build, whose
//! randomized tests catch them. Unset or empty: a normal build.

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
