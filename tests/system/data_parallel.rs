//! Multi-device merging: all-reduce strategies, bucketing, and the data-parallel training
//! example's core (`tributary_testkit::model`, `testkit/src/model.rs`).

use support::{backend_kind, fill_index, Kind};
use tributary::{
    collective::{ReduceOp, Strategy, Transfer},
    kernels,
    protocol::Context,
    DType, Error, Invalidation, MemoryMode, TensorNode,
};
use tributary_actors::{AllReducePlan, BucketedAllReduce, StreamConfig, System};
use tributary_testkit::{for_each_backend, model, support};

/// `devices` devices x 2 streams on `kind`, or `None` when that backend is not available.
fn system(kind: Kind, devices: usize, test: &str) -> Option<System> {
    let backend = backend_kind(kind, devices, test)?;
    Some(
        System::builder()
            .cpu_devices(devices)
            .backend(backend)
            .streams(StreamConfig::MostParallelStreams(2))
            .spawn()
            .expect("spawn"),
    )
}

for_each_backend!(
    all_reduce_lands_in_every_context_for_every_strategy,
    all_reduce_refuses_contexts_sharing_a_buffer,
    captured_all_reduces_replay_with_new_values_until_their_plan_is_finalized,
    bucketed_all_reduce_of_many_small_gradients,
    captured_bucketed_all_reduce_replays,
    one_data_parallel_step_equals_one_full_batch_step,
    training_reduces_the_loss_and_learns_the_blobs,
    replayed_training_steps_equal_issued_ones,
);

/// `count` on-device f32 nodes `g0`, `g1`, ..., node `c` of `len(c)` elements.
fn gradients(count: usize, len: impl Fn(usize) -> usize) -> Vec<TensorNode> {
    (0..count)
        .map(|c| {
            TensorNode::new(format!("g{c}"), DType::F32, [len(c)])
                .with_mode(MemoryMode::on_device())
                .unwrap()
        })
        .collect()
}

/// Contexts `i` on device `i % devices`, stream `i / devices`, each holding every node
/// filled with a value that identifies (context, node).
fn filled(sys: &System, devices: usize, n: usize, nodes: &[TensorNode]) -> Vec<Context> {
    (0..n)
        .map(|i| {
            let mut ctx = sys.context(i % devices, (i / devices) % 2).unwrap();
            for (c, node) in nodes.iter().enumerate() {
                let r = ctx
                    .link(kernels::fill(node, ((i + 1) * 10 + c) as f64).unwrap())
                    .unwrap();
                r.schedule().unwrap();
                ctx = r.context();
            }
            ctx.protocol_context().clone()
        })
        .collect()
}

fn all_reduce_lands_in_every_context_for_every_strategy(kind: Kind) {
    let Some(sys) = system(
        kind,
        3,
        "all_reduce_lands_in_every_context_for_every_strategy",
    ) else {
        return;
    };
    for strategy in Strategy::ALL {
        for n in 1..=5 {
            for (op, transfer) in [
                (ReduceOp::Sum, Transfer::Copy),
                (ReduceOp::Sum, Transfer::Streaming),
                (ReduceOp::Mean, Transfer::Auto),
            ] {
                if !kind.streams_across_devices() && transfer == Transfer::Streaming {
                    // Separate VkDevices (CUDA contexts of their own without peer access,
                    // as the backend answers) cannot read each other's memory in place.
                    continue;
                }
                let nodes = gradients(3, |c| 5 + c);
                let contexts = filled(&sys, 3, n, &nodes);
                let plan =
                    AllReducePlan::new(&sys, &nodes, &contexts, op, strategy, transfer).unwrap();
                plan.run().unwrap();
                for (c, node) in nodes.iter().enumerate() {
                    let sum: f32 = (0..n).map(|i| ((i + 1) * 10 + c) as f32).sum();
                    let want = if op == ReduceOp::Mean {
                        sum / n as f32
                    } else {
                        sum
                    };
                    for ctx in &contexts {
                        let got = sys.read::<f32>(ctx, node).unwrap();
                        assert!(
                            got.iter().all(|&v| v == want),
                            "{strategy:?} n={n} {op:?} {transfer:?} chunk {c}: {got:?} != {want}"
                        );
                    }
                }
                plan.finalize().unwrap();
            }
        }
    }
    sys.shutdown().unwrap();
}

/// A step that fills every chunk in every context with an index value (one slot per
/// fill) and all-reduces the chunks, captured once ([`System::capture`]), then replayed
/// three times with new values: each replay's sums are those of its values, for every
/// strategy and transfer; once the plan is finalized, a replay is refused as a whole.
fn captured_all_reduces_replay_with_new_values_until_their_plan_is_finalized(kind: Kind) {
    let test = "captured_all_reduces_replay_with_new_values_until_their_plan_is_finalized";
    let Some(sys) = system(kind, 3, test) else {
        return;
    };
    let chunks = 3;
    for strategy in Strategy::ALL {
        for (n, op, transfer) in [
            (2, ReduceOp::Sum, Transfer::Copy),
            (3, ReduceOp::Sum, Transfer::Streaming),
            (5, ReduceOp::Mean, Transfer::Auto),
        ] {
            if !kind.streams_across_devices() && transfer == Transfer::Streaming {
                continue;
            }
            let what = format!("{strategy:?} n={n} {op:?} {transfer:?}");
            let nodes = gradients(chunks, |c| 5 + c);
            // Context i on device i % 3, stream (i / 3) % 2; fill j = i * chunks + c
            // writes chunk c of context i.
            let mut fills = Vec::new();
            let mut contexts = Vec::new();
            for i in 0..n {
                let mut ctx = sys.context(i % 3, (i / 3) % 2).unwrap();
                for node in &nodes {
                    let r = ctx
                        .link(fill_index(node, kind.backend_name(), "t").unwrap())
                        .unwrap();
                    ctx = r.context();
                    fills.push(r);
                }
                contexts.push(ctx.protocol_context().clone());
            }
            let plan = AllReducePlan::new(&sys, &nodes, &contexts, op, strategy, transfer).unwrap();
            let step = sys
                .capture(|c| {
                    for (j, f) in fills.iter().enumerate() {
                        c.schedule_with(f.routine(), &[("t", j as i64)])?;
                    }
                    c.all_reduce(&plan)?;
                    Ok(())
                })
                .unwrap_or_else(|e| panic!("{what}: capture: {e}"));
            assert_eq!(
                step.bindings().len(),
                fills.len(),
                "{what}: one slot per fill"
            );
            let check = |values: &dyn Fn(usize) -> i64, round: usize| {
                for (c, node) in nodes.iter().enumerate() {
                    let sum: f32 = (0..n).map(|i| values(i * chunks + c) as f32).sum();
                    let want = match op {
                        ReduceOp::Mean => sum / n as f32,
                        _ => sum,
                    };
                    for ctx in &contexts {
                        let got = sys.read::<f32>(ctx, node).unwrap();
                        assert!(
                            close(&got, &vec![want; got.len()], 1e-5),
                            "{what} round {round} chunk {c}: {got:?} != {want}"
                        );
                    }
                }
            };
            check(&|j| j as i64, 0);
            let mut values = step.bindings();
            for round in 1..=3 {
                let value = |j: usize| (round * 1000 + 7 * j) as i64;
                for j in 0..values.len() {
                    values.get_mut(j).unwrap().set("t", value(j)).unwrap();
                }
                let tickets = sys.replay_with(&step, &values).unwrap();
                assert!(!tickets.is_empty(), "{what}: a ticket per stream");
                for t in tickets {
                    t.wait()
                        .unwrap_or_else(|e| panic!("{what} round {round}: {e}"));
                }
                check(&value, round);
            }
            plan.finalize().unwrap();
            for t in sys.replay(&step).unwrap() {
                match t.wait() {
                    Err(Error::ReplayInvalidated {
                        why: Invalidation::ContextFinalized { .. },
                        ..
                    }) => {}
                    other => panic!("{what}: a finalized plan's replay: {other:?}"),
                }
            }
        }
    }
    sys.shutdown().unwrap();
}

fn all_reduce_refuses_contexts_sharing_a_buffer(kind: Kind) {
    let Some(sys) = system(kind, 1, "all_reduce_refuses_contexts_sharing_a_buffer") else {
        return;
    };
    let g = TensorNode::new("g", DType::F32, [4])
        .with_mode(MemoryMode::on_device())
        .unwrap();
    let contexts = filled(&sys, 1, 1, std::slice::from_ref(&g));
    let twice = vec![contexts[0].clone(), contexts[0].clone()];
    let err = AllReducePlan::new(
        &sys,
        &[g],
        &twice,
        ReduceOp::Sum,
        Strategy::Ring,
        Transfer::Auto,
    )
    .err()
    .expect("an error");
    assert!(
        matches!(err, tributary::Error::InvalidRoutine { .. }),
        "{err}"
    );
    sys.shutdown().unwrap();
}

fn bucketed_all_reduce_of_many_small_gradients(kind: Kind) {
    let Some(sys) = system(kind, 2, "bucketed_all_reduce_of_many_small_gradients") else {
        return;
    };
    let grads = gradients(10, |c| 3 + c % 4);
    let contexts = filled(&sys, 2, 3, &grads);
    let plan =
        BucketedAllReduce::new(&sys, &grads, &contexts, ReduceOp::Sum, Strategy::Tree, 64).unwrap();
    assert!(plan.bucket_count() > 1 && plan.bucket_count() < grads.len());
    plan.run().unwrap();
    for (c, g) in grads.iter().enumerate() {
        let want: f32 = (0..3).map(|i| ((i + 1) * 10 + c) as f32).sum();
        for ctx in plan.contexts() {
            assert!(
                sys.read::<f32>(ctx, g).unwrap().iter().all(|&v| v == want),
                "grad {c}"
            );
        }
    }
    plan.finalize().unwrap();
    sys.shutdown().unwrap();
}

/// A bucketed all-reduce (packs, the buckets' all-reduce, unpacks) captured as one step
/// and replayed: each replay sums what the previous one left (3 contexts: every gradient
/// triples), on every context.
fn captured_bucketed_all_reduce_replays(kind: Kind) {
    let Some(sys) = system(kind, 2, "captured_bucketed_all_reduce_replays") else {
        return;
    };
    let grads = gradients(7, |c| 2 + c % 3);
    let contexts = filled(&sys, 2, 3, &grads);
    let plan =
        BucketedAllReduce::new(&sys, &grads, &contexts, ReduceOp::Sum, Strategy::Ring, 32).unwrap();
    let step = sys
        .capture(|c| c.bucketed_all_reduce(&plan))
        .expect("capture");
    let mut factor = 1.0;
    for round in 0..4 {
        if round > 0 {
            for t in sys.replay(&step).unwrap() {
                t.wait().unwrap();
            }
            factor *= 3.0;
        }
        for (c, g) in grads.iter().enumerate() {
            let want = factor * (0..3).map(|i| ((i + 1) * 10 + c) as f32).sum::<f32>();
            for ctx in plan.contexts() {
                let got = sys.read::<f32>(ctx, g).unwrap();
                assert!(
                    got.iter().all(|&v| v == want),
                    "round {round} grad {c}: {got:?} != {want}"
                );
            }
        }
    }
    plan.finalize().unwrap();
    sys.shutdown().unwrap();
}

fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
    a.iter()
        .zip(b)
        .all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
}

fn one_data_parallel_step_equals_one_full_batch_step(kind: Kind) {
    let test = "one_data_parallel_step_equals_one_full_batch_step";
    let cfg = model::ModelConfig {
        samples: 90,
        ..Default::default()
    };
    let data = model::make_data(&cfg);
    let init = model::init_params(&cfg);
    // Reference: the full batch on a single device.
    let Some(sys) = system(kind, 1, test) else {
        return;
    };
    let single = model::DataParallel::new(&sys, &cfg, 1, &data, &init, Strategy::Star).unwrap();
    single.step().unwrap();
    let reference = single.params(0).unwrap();
    sys.shutdown().unwrap();
    assert_ne!(reference, init, "the step changed nothing");
    // Tolerance: the shards sum their partial gradients in another order than the full
    // batch does, so results agree to float rounding, not bitwise.
    const TOL: f32 = 1e-5;
    for n in 1..=4 {
        for strategy in Strategy::ALL {
            let Some(sys) = system(kind, n, test) else {
                return;
            };
            let dp = model::DataParallel::new(&sys, &cfg, n, &data, &init, strategy).unwrap();
            dp.step().unwrap();
            let p0 = dp.params(0).unwrap();
            for (got, want, name) in [
                (&p0.w1, &reference.w1, "w1"),
                (&p0.b1, &reference.b1, "b1"),
                (&p0.w2, &reference.w2, "w2"),
                (&p0.b2, &reference.b2, "b2"),
            ] {
                assert!(close(got, want, TOL), "{strategy:?} n={n}: {name} differs");
            }
            for i in 1..n {
                assert_eq!(dp.params(i).unwrap(), p0, "{strategy:?} n={n}: replica {i}");
            }
            sys.shutdown().unwrap();
        }
    }
}

fn training_reduces_the_loss_and_learns_the_blobs(kind: Kind) {
    let cfg = model::ModelConfig::default();
    let data = model::make_data(&cfg);
    let init = model::init_params(&cfg);
    let Some(sys) = system(kind, 4, "training_reduces_the_loss_and_learns_the_blobs") else {
        return;
    };
    let dp = model::DataParallel::new(&sys, &cfg, 4, &data, &init, Strategy::Ring).unwrap();
    dp.step().unwrap();
    let first = dp.loss().unwrap();
    for _ in 0..29 {
        dp.step().unwrap();
    }
    let last = dp.loss().unwrap();
    let acc = model::accuracy(&cfg, &dp.params(0).unwrap(), &data);
    assert!(first > 1.0, "initial loss {first}");
    assert!(last < 0.1 * first, "loss {first} -> {last}");
    assert!(acc >= 0.95, "accuracy {acc}");
    sys.shutdown().unwrap();
}

/// Training with the first step captured and every later one replayed (compute, the
/// gradients' all-reduce and the SGD updates: one operation per device per step) computes
/// bit for bit what issuing every step computes: the same loss after every step and the
/// same parameters on every replica.
fn replayed_training_steps_equal_issued_ones(kind: Kind) {
    let test = "replayed_training_steps_equal_issued_ones";
    let cfg = model::ModelConfig::default();
    let data = model::make_data(&cfg);
    let init = model::init_params(&cfg);
    let (Some(issued), Some(replayed)) = (system(kind, 3, test), system(kind, 3, test)) else {
        return;
    };
    let a = model::DataParallel::new(&issued, &cfg, 3, &data, &init, Strategy::Tree).unwrap();
    let b = model::DataParallel::new(&replayed, &cfg, 3, &data, &init, Strategy::Tree).unwrap();
    a.step().unwrap();
    let step = b.capture_step().unwrap();
    assert_eq!(a.loss().unwrap(), b.loss().unwrap(), "the captured step");
    for epoch in 1..8 {
        a.step().unwrap();
        b.replay(&step).unwrap();
        assert_eq!(
            a.loss().unwrap().to_bits(),
            b.loss().unwrap().to_bits(),
            "step {epoch}"
        );
    }
    for i in 0..3 {
        assert!(
            a.params(i).unwrap() == b.params(i).unwrap(),
            "replica {i}'s parameters"
        );
    }
    issued.shutdown().unwrap();
    replayed.shutdown().unwrap();
}
