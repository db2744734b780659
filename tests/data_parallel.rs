//! Multi-device merging: all-reduce strategies, bucketing, and the data-parallel training
//! example's core (`examples/data_parallel/model.rs`).

#[path = "../examples/data_parallel/model.rs"]
mod model;

#[macro_use]
mod support;

use support::{backend_kind, Kind};
use tributary::{
    collective::{ReduceOp, Strategy, Transfer},
    kernels,
    protocol::Context,
    DType, MemoryMode, TensorNode,
};
use tributary_actors::{AllReducePlan, BucketedAllReduce, StreamConfig, System};

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
    bucketed_all_reduce_of_many_small_gradients,
    one_data_parallel_step_equals_one_full_batch_step,
    training_reduces_the_loss_and_learns_the_blobs,
);

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
                    // Separate VkDevices (CUDA contexts without peer access) cannot read
                    // each other's memory in place.
                    continue;
                }
                let nodes: Vec<TensorNode> = (0..3)
                    .map(|c| {
                        TensorNode::new(format!("g{c}"), DType::F32, [5 + c])
                            .with_mode(MemoryMode::on_device())
                            .unwrap()
                    })
                    .collect();
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
    let grads: Vec<TensorNode> = (0..10)
        .map(|c| {
            TensorNode::new(format!("g{c}"), DType::F32, [3 + c % 4])
                .with_mode(MemoryMode::on_device())
                .unwrap()
        })
        .collect();
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
