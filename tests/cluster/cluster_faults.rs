//! Faults across MPI ranks: a mismatched call order, a rank that exits early, a rank that
//! dies, a rank whose input failed. Each ends in typed errors on the other ranks within
//! the deadline, never a hang or a wrong sum, and the local system keeps serving.
//!
//! Each test launches itself under `mpirun` (`tributary_testkit::cluster`); without the `mpi`
//! feature or without `mpirun` it prints `skipping MPI (<test>): <reason>`.

use tributary_testkit::{cluster, cluster_test};

use cluster::Launch;

#[cfg(feature = "mpi")]
mod bodies {
    use std::{
        sync::Arc,
        time::{Duration, Instant},
    };

    use tributary::{
        collective::{ReduceOp, Strategy},
        kernels::{self, Access, RoutineSpec},
        DType, Error, MemoryMode, TensorNode,
    };
    use tributary_actors::{
        cluster::{Cluster, ClusterConfig},
        ContextHandle,
    };

    pub const DEADLINE: Duration = Duration::from_secs(3);

    pub fn config() -> ClusterConfig {
        let mut c = ClusterConfig::default();
        c.cpu_devices = 2;
        c.deadline = DEADLINE;
        c
    }

    fn node(label: &str, n: usize) -> TensorNode {
        TensorNode::new(label, DType::F32, [n])
            .with_mode(MemoryMode::on_device())
            .expect("node")
    }

    /// Both devices' contexts holding `nodes`, each filled with `value`.
    fn filled(cluster: &Cluster, nodes: &[TensorNode], value: f64) -> Vec<ContextHandle> {
        (0..2)
            .map(|d| {
                let mut ctx = cluster.context(d, 0).expect("ctx");
                for n in nodes {
                    let r = ctx
                        .link(kernels::fill(n, value).expect("spec"))
                        .expect("link");
                    r.schedule().expect("schedule");
                    ctx = r.context();
                }
                ctx
            })
            .collect()
    }

    /// Children of `ctxs` in which `g` is written with `value` again.
    fn filled_from(ctxs: &[ContextHandle], g: &TensorNode, value: f64) -> Vec<ContextHandle> {
        ctxs.iter()
            .map(|ctx| {
                let r = ctx
                    .link(kernels::fill(g, value).expect("spec"))
                    .expect("link");
                r.schedule().expect("schedule");
                r.context()
            })
            .collect()
    }

    /// Local work still runs after a cluster fault.
    fn local_work_still_runs(cluster: &Cluster) {
        let x = node("local", 8);
        let r = cluster
            .context(1, 0)
            .expect("ctx")
            .link(kernels::fill(&x, 4.0).expect("spec"))
            .expect("link");
        r.schedule().expect("schedule");
        assert_eq!(r.context().read::<f32>(&x).expect("read"), vec![4.0; 8]);
    }

    /// Rank 0 all-reduces `a` then `b`, every other rank `b` then `a`: the first of them
    /// (network call 1, after a barrier) is a `CollectiveMismatch` on every rank at once,
    /// the second fails with it too. `a`'s payload takes one frame of its header message,
    /// `b`'s three (3,000 f32): a rank waits for the headers alone before it checks them, so
    /// frames that were posted for and never come (or come unasked) delay nothing.
    pub fn mismatched_order(cluster: &Arc<Cluster>) {
        let (a, b) = (node("a", 64), node("b", 3000));
        let ctxs = filled(cluster, &[a.clone(), b.clone()], 1.0);
        let order = if cluster.rank() == 0 {
            [&a, &b]
        } else {
            [&b, &a]
        };
        // Every rank starts the timed call together: the mismatch waits for no deadline.
        cluster.barrier().expect("barrier");
        let started = Instant::now();
        let first = cluster.all_reduce(
            std::slice::from_ref(order[0]),
            &ctxs,
            ReduceOp::Sum,
            Strategy::Tree,
        );
        match &first {
            Err(Error::CollectiveMismatch {
                call: 1,
                rank,
                this_rank,
                ..
            }) => {
                assert_eq!(*this_rank, cluster.rank());
                // Rank 0 sees rank 1 first; the others see rank 0.
                assert_eq!(*rank, if cluster.rank() == 0 { 1 } else { 0 });
            }
            other => panic!(
                "rank {}: expected a mismatch, got {other:?}",
                cluster.rank()
            ),
        }
        assert!(
            started.elapsed() < DEADLINE,
            "a mismatch waits for no deadline"
        );
        let second = cluster.all_reduce(
            std::slice::from_ref(order[1]),
            &ctxs,
            ReduceOp::Sum,
            Strategy::Tree,
        );
        assert_eq!(
            second.err(),
            first.err(),
            "the cluster stays stopped at the first fault"
        );
        local_work_still_runs(cluster);
    }

    /// The last rank leaves (its cluster shuts down) before the all-reduce the others issue:
    /// they get `RankUnreachable` naming it, after the deadline and not much later.
    pub fn rank_exits_early(cluster: &Arc<Cluster>) {
        let last = cluster.size() - 1;
        let g = node("g", 1000);
        let ctxs = filled(cluster, std::slice::from_ref(&g), 1.0);
        // One all-reduce that everyone takes part in.
        cluster
            .all_reduce(
                std::slice::from_ref(&g),
                &ctxs,
                ReduceOp::Sum,
                Strategy::Star,
            )
            .expect("first");
        if cluster.rank() == last {
            return; // shuts down: MPI_Finalize
        }
        let started = Instant::now();
        let err = cluster.all_reduce(
            std::slice::from_ref(&g),
            &ctxs,
            ReduceOp::Sum,
            Strategy::Star,
        );
        let took = started.elapsed();
        match err {
            Err(Error::RankUnreachable {
                rank,
                call: 1,
                waited,
                ..
            }) => {
                assert_eq!((rank, waited), (last, DEADLINE));
            }
            other => panic!(
                "rank {}: expected RankUnreachable, got {other:?}",
                cluster.rank()
            ),
        }
        assert!(
            took >= DEADLINE && took < DEADLINE + Duration::from_secs(20),
            "took {took:?}"
        );
        super::cluster::a_rank_is_gone();
        local_work_still_runs(cluster);
        // No partial sum lands anywhere: reading the result fails with the fault as its
        // root cause.
        for ctx in &ctxs {
            let read = ctx.read::<f32>(&g);
            assert!(
                matches!(&read, Err(Error::Failed(f)) if f.message.contains(&format!("rank {last} sent nothing"))),
                "{read:?}"
            );
        }
    }

    /// The last rank dies without finalising MPI (mpirun runs with --enable-recovery): the
    /// others get `RankUnreachable` naming it.
    pub fn rank_dies(cluster: &Arc<Cluster>) {
        let last = cluster.size() - 1;
        cluster.barrier().expect("everyone started");
        if cluster.rank() == last {
            std::process::exit(0);
        }
        let g = node("g", 4096);
        let ctxs = filled(cluster, std::slice::from_ref(&g), 1.0);
        let ticket = cluster
            .all_reduce_plan(
                std::slice::from_ref(&g),
                &ctxs,
                ReduceOp::Mean,
                Strategy::Tree,
            )
            .expect("plan")
            .run()
            .expect("issued");
        match ticket.wait() {
            Err(Error::RankUnreachable { rank, .. }) => assert_eq!(rank, last),
            other => panic!(
                "rank {}: expected RankUnreachable, got {other:?}",
                cluster.rank()
            ),
        }
        super::cluster::a_rank_is_gone();
        // A read of the result fails with the fault as its root cause instead of hanging.
        let read = ctxs[0].read::<f32>(&g);
        assert!(
            matches!(&read, Err(Error::Failed(f)) if f.message.contains(&format!("rank {last}"))),
            "{read:?}"
        );
        local_work_still_runs(cluster);
    }

    /// Rank 1's gradient routine fails: its all-reduce fails with that root cause, the
    /// others' with `RankInputFailed` naming rank 1; the next all-reduce works everywhere.
    pub fn input_fails_on_one_rank(cluster: &Arc<Cluster>) {
        failed_all_reduce_input(cluster, 256);
    }

    /// As [`input_fails_on_one_rank`] with a payload of three frames (3,000 f32: 12,000
    /// bytes after the 96-byte header, `Direct`): the failed rank still sends every frame
    /// the others posted a receive for, so they fail the operation with `RankInputFailed`
    /// at once, not with `RankUnreachable` at the deadline while waiting for frames that
    /// never come, and the next all-reduce sums right. Then a transfer: rank 0's input of a
    /// three-frame send to rank 1 fails, rank 1's receive fails with `RankInputFailed`
    /// naming rank 0, and the next transfer between them arrives whole.
    pub fn input_of_several_frames_fails_on_one_rank(cluster: &Arc<Cluster>) {
        failed_all_reduce_input(cluster, 3000);
        let rank = cluster.rank();
        if rank > 1 {
            return;
        }
        let t = node("t", 3000);
        let ctx = filled(cluster, std::slice::from_ref(&t), 1.0).swap_remove(0);
        let started = Instant::now();
        let first = if rank == 0 {
            let r = ctx
                .link(
                    RoutineSpec::custom("produce", vec![(t.clone(), Access::Write)], None, |_| {
                        Err("the message failed".into())
                    })
                    .expect("spec"),
                )
                .expect("link");
            r.schedule().expect("schedule");
            let failed = r.context();
            let result = cluster.send(&t, &failed, 1).expect("issued").wait();
            match &result {
                Err(Error::Failed(f)) => assert!(f.message.contains("the message failed"), "{f}"),
                other => panic!("unexpected send outcome {other:?}"),
            }
            failed
        } else {
            let result = cluster.recv(&t, &ctx, 0).expect("issued").wait();
            match &result {
                Err(Error::RankInputFailed {
                    rank: 0, call: 0, ..
                }) => {}
                other => panic!("unexpected receive outcome {other:?}"),
            }
            ctx
        };
        assert!(
            started.elapsed() < DEADLINE,
            "rank {rank}: the failed transfer took {:?}, past the deadline {DEADLINE:?}",
            started.elapsed()
        );
        let healed =
            filled_from(std::slice::from_ref(&first), &t, 5.0 + rank as f64).swap_remove(0);
        if rank == 0 {
            cluster
                .send(&t, &healed, 1)
                .expect("issued")
                .wait()
                .expect("sent");
        } else {
            cluster
                .recv(&t, &healed, 0)
                .expect("issued")
                .wait()
                .expect("received");
            assert_eq!(healed.read::<f32>(&t).expect("read"), vec![5.0; 3000]);
        }
    }

    /// A ring of sendrecvs (every rank sends `f{case}.{rank}`, 3,000 f32 in three frames, to
    /// the next rank and receives the previous rank's into `f{case}.{from}`, in place on
    /// the network stream) whose sent node's producer fails: first on rank 0 alone, then on
    /// every rank. A rank whose routine was skipped still posts both parts' headers, with
    /// `InputFailed`, together (one after the other, a ring of them would wait on itself):
    /// the failed rank gets its producer's error, its neighbours `RankInputFailed` naming
    /// it for the part it joins, the others their data, all within the deadline; then a
    /// healthy sendrecv moves every rank's values.
    pub fn failed_sendrecv_inputs(cluster: &Arc<Cluster>) {
        let (rank, size) = (cluster.rank(), cluster.size());
        let (to, from) = ((rank + 1) % size, (rank + size - 1) % size);
        let round = |case: usize, fails: bool| {
            let (own, halo) = (
                node(&format!("f{case}.{rank}"), 3000),
                node(&format!("f{case}.{from}"), 3000),
            );
            let mut ctx = cluster.network_context().expect("ctx");
            for n in [&halo, &own] {
                let r = ctx
                    .link(kernels::fill(n, 0.0).expect("spec"))
                    .expect("link");
                r.schedule().expect("schedule");
                ctx = r.context();
            }
            let value = (rank + 1) as f32;
            let r = ctx
                .link(
                    RoutineSpec::custom("produce", vec![(own.clone(), Access::Write)], None, {
                        move |args| {
                            if fails {
                                return Err("the message failed".into());
                            }
                            args.output::<f32>(0)?.fill(value);
                            Ok(())
                        }
                    })
                    .expect("spec"),
                )
                .expect("link");
            r.schedule().expect("schedule");
            let ctx = r.context();
            let started = Instant::now();
            let result = cluster
                .sendrecv(&own, to, &halo, from, &ctx)
                .expect("issued")
                .wait();
            assert!(
                started.elapsed() < DEADLINE,
                "rank {rank}, case {case}: the sendrecv took {:?}, past the deadline {DEADLINE:?}",
                started.elapsed()
            );
            (result, ctx, halo)
        };
        // Rank 0's input fails.
        let (result, ctx, halo) = round(0, rank == 0);
        match (&result, rank) {
            (Err(Error::Failed(f)), 0) => assert!(f.message.contains("the message failed"), "{f}"),
            (Err(Error::RankInputFailed { rank: 0, .. }), r) if r == 1 || r == size - 1 => {}
            (Ok(()), r) if r != 0 && r != 1 && r != size - 1 => {
                assert_eq!(
                    ctx.read::<f32>(&halo).expect("read"),
                    vec![from as f32 + 1.0; 3000]
                );
            }
            other => panic!("rank {rank}: unexpected outcome {other:?} with rank 0's input failed"),
        }
        cluster.finalize(&ctx).expect("finalize");
        // Every rank's input fails.
        let (result, ctx, _) = round(1, true);
        match &result {
            Err(Error::Failed(f)) => assert!(f.message.contains("the message failed"), "{f}"),
            other => panic!("rank {rank}: unexpected outcome {other:?} with every input failed"),
        }
        cluster.finalize(&ctx).expect("finalize");
        // Still in step.
        let (result, ctx, halo) = round(2, false);
        result.expect("a healthy sendrecv");
        assert_eq!(
            ctx.read::<f32>(&halo).expect("read"),
            vec![from as f32 + 1.0; 3000]
        );
        cluster.finalize(&ctx).expect("finalize");
    }

    /// Rank 1's routine writing the gradient (`n` f32) fails; see [`input_fails_on_one_rank`].
    fn failed_all_reduce_input(cluster: &Arc<Cluster>, n: usize) {
        let g = node("g", n);
        let ctxs = filled(cluster, std::slice::from_ref(&g), 1.0);
        let rank = cluster.rank();
        let broken: Vec<ContextHandle> = ctxs
            .iter()
            .map(|ctx| {
                let r = ctx
                    .link(
                        RoutineSpec::custom(
                            "grad",
                            vec![(g.clone(), Access::Write)],
                            None,
                            move |args| {
                                if rank == 1 {
                                    return Err("the gradient failed".into());
                                }
                                args.output::<f32>(0)?.fill(2.0);
                                Ok(())
                            },
                        )
                        .expect("spec"),
                    )
                    .expect("link");
                r.schedule().expect("schedule");
                r.context()
            })
            .collect();
        let plan = cluster
            .all_reduce_plan(
                std::slice::from_ref(&g),
                &broken,
                ReduceOp::Sum,
                Strategy::Tree,
            )
            .expect("plan");
        let result = plan.run().expect("issued").wait();
        match (rank, &result) {
            (1, Err(Error::Failed(f))) => assert!(f.message.contains("the gradient failed"), "{f}"),
            (
                r,
                Err(Error::RankInputFailed {
                    rank: 1, call: 0, ..
                }),
            ) if r != 1 => {}
            other => panic!("unexpected outcome {other:?}"),
        }
        // The ranks are still in step: after writing g again, the next all-reduce sums 1.0
        // from every context of every rank.
        plan.finalize().expect("finalize");
        let healed = filled_from(&broken, &g, 1.0);
        cluster
            .all_reduce(
                std::slice::from_ref(&g),
                &healed,
                ReduceOp::Sum,
                Strategy::Tree,
            )
            .expect("second");
        assert_eq!(
            healed[1].read::<f32>(&g).expect("read"),
            vec![2.0 * cluster.size() as f32; n]
        );
    }
}

cluster_test!(
    a_mismatched_call_order_is_an_error_on_every_rank,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config(),
    bodies::mismatched_order
);

cluster_test!(
    a_rank_that_exits_early_is_named_within_the_deadline,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config(),
    bodies::rank_exits_early
);

cluster_test!(
    a_rank_that_dies_is_named_within_the_deadline,
    [
        Launch {
            ranks: 2,
            mpirun_args: vec![
                "--enable-recovery".into(),
                "--mca".into(),
                "orte_abort_on_non_zero_status".into(),
                "0".into()
            ],
            finishing: 1
        },
        Launch {
            ranks: 4,
            mpirun_args: vec![
                "--enable-recovery".into(),
                "--mca".into(),
                "orte_abort_on_non_zero_status".into(),
                "0".into()
            ],
            finishing: 3
        }
    ],
    bodies::config(),
    bodies::rank_dies
);

cluster_test!(
    a_failed_input_fails_that_operation_on_every_rank_and_no_more,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config(),
    bodies::input_fails_on_one_rank
);

cluster_test!(
    a_failed_input_of_several_frames_fails_that_operation_on_every_rank_and_no_more,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config(),
    bodies::input_of_several_frames_fails_on_one_rank
);

cluster_test!(
    a_failed_sendrecv_input_fails_the_transfers_it_joins_and_no_more,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config(),
    bodies::failed_sendrecv_inputs
);
