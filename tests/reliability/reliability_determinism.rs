//! Determinism: the same program, run 20 times on fresh engines, gives bitwise identical
//! results, equal to the sequential reference's (OCANNL's multicore backend was not
//! deterministic even with one stream).
//!
//! The program is a few steps of data-parallel training on 3 devices x 3 streams, with
//! float reductions whose result depends on their order: matrix products, column sums,
//! gradients merged from several devices into one in program order (through the merge
//! buffer and by streaming), updates, host reads in the middle. Devices finish in a
//! different order every run; only program order may decide the result.

use std::time::Duration;

use tributary_testkit::common;

use common::{
    engine_runner::EngineRunner, program::*, reference::ReferenceRunner, watchdog::Watchdog,
};

const RUNS: usize = 20;

fn f32_node(dims: &[usize], mode: Mode) -> NodeDecl {
    NodeDecl {
        dtype: Dt::F32,
        dims: dims.to_vec(),
        mode,
        zeroed: true,
    }
}

/// Data-parallel steps: per device `y = x w`, `g = sum_rows(y)`, `dw = xt y`; device 0
/// sums the gradients of devices 1 and 2 into its own, then every device updates `w`.
fn training_program() -> Program {
    let (x, xt, w, y, g, dw) = (N(0), N(1), N(2), N(3), N(4), N(5));
    let nodes = vec![
        f32_node(&[8, 16], Mode::Hosted(Share::PerStream)),
        f32_node(&[16, 8], Mode::Hosted(Share::PerStream)),
        f32_node(&[16, 4], Mode::Hosted(Share::Unset)),
        f32_node(&[8, 4], Mode::OnDevice(Share::Unset)),
        f32_node(&[4], Mode::OnDevice(Share::Unset)),
        f32_node(&[16, 4], Mode::OnDevice(Share::Unset)),
    ];
    let mut b = Builder::new(3, 3, nodes);
    let mut steps = Vec::new();
    for d in 0..3 {
        // Stream 0 computes, stream 1 holds the weights' upload, stream 2 idles.
        let c = b.root(d, 0);
        let c = b.init(c, x, Data::Fractions(10 + d as u32));
        let c = b.init(c, xt, Data::Fractions(20 + d as u32));
        let c = b.init(c, w, Data::Fractions(7));
        let (fwd, c) = b.link(c, Kernel::Matmul { c: y, a: x, b: w });
        let (sum, c) = b.link(c, Kernel::SumRows { dst: g, src: y });
        let (grad, c) = b.link(c, Kernel::Matmul { c: dw, a: xt, b: y });
        let (update, c) = b.link(
            c,
            Kernel::Axpy {
                y: w,
                x: dw,
                alpha: -0.013,
            },
        );
        steps.push((fwd, sum, grad, update, c));
    }
    // Device 0 merges on stream 0: g += g(d1) through the merge buffer, g += g(d2) in place;
    // dw likewise.
    let c0 = steps[0].4;
    let (merge_g, c0) = b.link(c0, Kernel::AddMerge { dst: g });
    let (merge_dw, c0) = b.link(c0, Kernel::AddMerge { dst: dw });
    let (update0, c0) = b.link(
        c0,
        Kernel::Axpy {
            y: w,
            x: dw,
            alpha: -0.021,
        },
    );
    let side = b.root(0, 2);
    let (scale, side) = b.link(
        side,
        Kernel::Scale {
            dst: dw,
            src: w,
            alpha: 0.3,
        },
    );
    for step in 0..4 {
        for (fwd, sum, grad, _, _) in &steps {
            b.schedule(*fwd).schedule(*sum).schedule(*grad);
        }
        let (c1, c2) = (steps[1].4, steps[2].4);
        b.d2d(g, c1, c0, D2d::Copy).schedule(merge_g);
        b.d2d(g, c2, c0, D2d::StreamingFor(merge_g));
        b.d2d(dw, c2, c0, D2d::Copy).schedule(merge_dw);
        b.d2d(dw, c1, c0, D2d::StreamingFor(merge_dw));
        b.schedule(update0);
        for (_, _, _, update, _) in &steps[1..] {
            b.schedule(*update);
        }
        // Device 0's weights go to the others, in place of their own.
        b.d2d(w, c0, c1, D2d::No).d2d(w, c0, c2, D2d::No);
        if step % 2 == 1 {
            b.op(Op::HostRead { node: w })
                .op(Op::Read { ctx: c0, node: g });
        }
    }
    b.schedule(scale).op(Op::Read {
        ctx: side,
        node: dw,
    });
    b.op(Op::Checkpoint).op(Op::Teardown);
    b.build()
}

#[test]
fn same_program_same_bits_twenty_times() {
    let program = training_program();
    let expected = ReferenceRunner::default().run(&program);
    if let Some(i) = expected.results.iter().position(|r| r.is_err()) {
        panic!(
            "the reference refused operation {i}: {:?}\n{}",
            expected.results[i],
            program.marked(Some(i))
        );
    }
    let shown = program.to_string();
    let _watchdog = Watchdog::arm(Duration::from_secs(300), move || shown);
    let mut runner = EngineRunner::cpu();
    let first = runner.run(&program);
    for run in 1..RUNS {
        let again = runner.run(&program);
        if let Err(diff) = compare(&program, &first, &again) {
            panic!("run {run} differs from run 0: {diff}");
        }
    }
    // And the bits are the ones program order gives.
    if let Err(diff) = compare(&program, &expected, &first) {
        panic!("the engine differs from the reference: {diff}");
    }
}

/// The same check on the merges alone, where the order of float additions is the whole
/// result: four devices add their gradients into one in a fixed order.
#[test]
fn merge_order_is_program_order() {
    let g = N(0);
    let mut b = Builder::new(4, 2, vec![f32_node(&[257], Mode::OnDevice(Share::Unset))]);
    let mut producers = Vec::new();
    for d in 0..4 {
        let c = b.root(d, d % 2);
        let (fill, c) = b.link(
            c,
            Kernel::Fill {
                dst: g,
                value: [1e8, 1.0, -1e8, 0.3][d],
            },
        );
        producers.push((fill, c));
    }
    let (merge, _) = b.link(producers[0].1, Kernel::AddMerge { dst: g });
    for round in 0..3 {
        for (fill, _) in &producers {
            b.schedule(*fill);
        }
        for (i, (_, c)) in producers.iter().enumerate().skip(1) {
            if (i + round) % 2 == 0 {
                b.d2d(g, *c, producers[0].1, D2d::Copy).schedule(merge);
            } else {
                b.d2d(g, *c, producers[0].1, D2d::StreamingFor(merge));
            }
        }
        b.op(Op::Read {
            ctx: producers[0].1,
            node: g,
        });
    }
    b.op(Op::Teardown);
    let program = b.build();
    let expected = ReferenceRunner::default().run(&program);
    // 1e8 + 1 - 1e8 + 0.3 in this order is 0.3 in f32 (1 is lost against 1e8).
    let reads: Vec<&Values> = expected
        .results
        .iter()
        .filter_map(|r| match r {
            Ok(Obs::Values(v)) => Some(v),
            _ => None,
        })
        .collect();
    assert_eq!(reads.len(), 3);
    assert_eq!(reads[0], &Values::f32s(&[1e8f32 + 1.0 - 1e8 + 0.3; 257]));
    let shown = program.to_string();
    let _watchdog = Watchdog::arm(Duration::from_secs(120), move || shown);
    let mut runner = EngineRunner::cpu();
    for run in 0..RUNS {
        let got = runner.run(&program);
        if let Err(diff) = compare(&program, &expected, &got) {
            panic!("run {run}: {diff}");
        }
    }
}
