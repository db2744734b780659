//! User code cannot reach what the backends' `unsafe` rests on: it cannot build a plan,
//! construct the work or the bindings of one with fields, start a stream queue or take a
//! timeline out of an event without `unsafe`, clone a plan, or change the host table's use
//! records. Each case in `tests/engine/compile_fail/` must fail to compile with the error
//! in its `.stderr` file (trybuild builds the crate once, then each case).
//!
//! The expected messages come from the toolchain this project pins; after a compiler
//! upgrade, regenerate them with `TRYBUILD=overwrite cargo test --test engine compile_fail`
//! and check that each still names the intended error.

#[test]
fn user_code_cannot_make_or_misuse_plans() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/engine/compile_fail/*.rs");
}
