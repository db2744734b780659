//! Cross-rank steps captured and replayed (`Cluster::capture`, `Cluster::replay`, feature
//! `mpi`): data-parallel training whose steps after the first are replays, the all-reduce
//! across ranks included, computes bit for bit what issuing every step computes, with every
//! replica identical on every rank; a replay something invalidated fails on every rank
//! with the typed error issuing gives, and the ranks stay in step; a step of work on the
//! network stream itself (compute, a halo exchange and an all-reduce, all in place) replays
//! what issuing computes, and a failed input in one of its replays fails only that
//! replay's transfer, on the two ranks it joins.
//!
//! Each test launches itself under `mpirun` (`tributary_testkit::cluster`); without the `mpi`
//! feature or without `mpirun` it prints `skipping MPI (<test>): <reason>`.

use tributary_testkit::{cluster, cluster_test};

use cluster::Launch;

#[cfg(feature = "mpi")]
mod bodies {
    use std::sync::Arc;

    use tributary::{
        collective::{ReduceOp, Strategy},
        kernels::{self, Access, RoutineSpec},
        DType, Error, MemoryMode, TensorNode,
    };
    use tributary_actors::{
        cluster::{Cluster, ClusterAllReduce, ClusterCapture, ClusterConfig, CrossRankAlgorithm},
        ContextHandle, RoutineHandle,
    };

    use tributary_testkit::model;

    /// The collectives' configuration (exact kernels, a long deadline), `Auto` across ranks.
    pub fn config(devices: usize) -> ClusterConfig {
        crate::cluster_collectives::bodies::config(devices, CrossRankAlgorithm::Auto)
    }

    /// [`config`] with another deadline: 10 s for a test whose mutant stalls a rank (the
    /// check then ends at the deadline, not after a minute); no healthy run waits that long.
    pub fn config_with_deadline(devices: usize, deadline: std::time::Duration) -> ClusterConfig {
        let mut c = config(devices);
        c.deadline = deadline;
        c
    }

    /// Two trainings of the same model on the same cluster, alternating: one issues every
    /// step, the other captures its first step and replays it. Their losses are bitwise
    /// equal after every step, and so are their parameters, on every replica and every rank.
    pub fn replayed_training(cluster: &Arc<Cluster>) {
        let cfg = model::ModelConfig {
            samples: 96,
            ..Default::default()
        };
        let data = model::make_data(&cfg);
        let init = model::init_params(&cfg);
        let on = |strategy| {
            model::DataParallel::on_cluster(cluster.clone(), &cfg, &data, &init, strategy)
                .expect("on the cluster")
        };
        let (issued, replayed) = (on(Strategy::Tree), on(Strategy::Tree));
        issued.step().expect("step");
        let step = replayed.capture_step().expect("captured");
        let bits = |dp: &model::DataParallel| dp.loss().expect("loss").to_bits();
        assert_eq!(bits(&issued), bits(&replayed), "the captured step");
        for epoch in 1..6 {
            issued.step().expect("step");
            replayed.replay(&step).expect("replayed");
            assert_eq!(bits(&issued), bits(&replayed), "step {epoch}");
        }
        let params = issued.params(0).expect("params");
        assert_ne!(params, init, "the steps changed nothing");
        for i in 0..replayed.replicas() {
            assert_eq!(
                replayed.params(i).expect("params"),
                params,
                "replayed replica {i}"
            );
        }
        // Every rank holds the same parameters: the sum across ranks of a digest of their
        // bits is the number of ranks times this rank's.
        let parts = params.digest_parts();
        let sums = cluster.sum_host(&parts).expect("sum");
        let n = cluster.size() as f64;
        assert_eq!(
            sums,
            parts.iter().map(|p| p * n).collect::<Vec<_>>(),
            "ranks hold different parameters"
        );
    }

    /// One rank's program of `in_place_steps`: on a context of the network stream, an
    /// update of `x` from the halo `h` that also copies `x` into `s`, `s` sent to the next
    /// rank and `h` received from the previous one, and the mean of `x` across ranks, in
    /// place. A transfer's two sides name the node alike: `s` is labelled by its rank, and
    /// `h` as the previous rank's `s`.
    struct HaloProgram {
        ctx: ContextHandle,
        x: TensorNode,
        h: TensorNode,
        s: TensorNode,
        update: RoutineHandle,
        mean: ClusterAllReduce,
    }

    impl HaloProgram {
        /// `x` starts at rank-dependent values, `h` at zero; labels end in `tag`, so the
        /// issued and the replayed programs are distinct nodes (the same on every rank).
        fn new(cluster: &Cluster, tag: &str) -> HaloProgram {
            let (rank, n) = (cluster.rank(), 256);
            let prev = (rank + cluster.size() - 1) % cluster.size();
            let (x, h, s) = (
                f64_node(format!("x.{tag}"), n),
                f64_node(format!("s{prev}.{tag}"), n),
                f64_node(format!("s{rank}.{tag}"), n),
            );
            let start: Vec<f64> = (0..n).map(|i| (rank * n + i) as f64).collect();
            let ctx = initialised_on_network_stream(
                cluster,
                vec![
                    (x.clone(), start),
                    (h.clone(), vec![0.0; n]),
                    (s.clone(), vec![0.0; n]),
                ],
            );
            let update = ctx
                .link(
                    RoutineSpec::custom(
                        "update",
                        vec![
                            (h.clone(), Access::Read),
                            (x.clone(), Access::ReadWrite),
                            (s.clone(), Access::Write),
                        ],
                        None,
                        |a| {
                            let h = a.input::<f64>(0)?;
                            let x = a.output::<f64>(1)?;
                            for (x, h) in x.iter_mut().zip(h) {
                                *x = 0.5 * *x + h + 1.0;
                            }
                            a.output::<f64>(2)?.copy_from_slice(x);
                            Ok(())
                        },
                    )
                    .expect("spec"),
                )
                .expect("linked");
            let mean = cluster
                .all_reduce_plan(
                    std::slice::from_ref(&x),
                    std::slice::from_ref(&ctx),
                    ReduceOp::Mean,
                    Strategy::Tree,
                )
                .expect("plan");
            HaloProgram {
                ctx,
                x,
                h,
                s,
                update,
                mean,
            }
        }

        /// The ring's neighbours, and whether this rank sends first (even ranks do, so
        /// that every send meets its receive on an even number of ranks).
        fn neighbours(cluster: &Cluster) -> (usize, usize, bool) {
            let (rank, size) = (cluster.rank(), cluster.size());
            ((rank + 1) % size, (rank + size - 1) % size, rank % 2 == 0)
        }

        fn issue(&self, cluster: &Cluster) {
            let (next, prev, send_first) = Self::neighbours(cluster);
            self.update.schedule().expect("update");
            let ctx = self.ctx.protocol_context();
            if send_first {
                cluster.send(&self.s, ctx, next).expect("send");
                cluster.recv(&self.h, ctx, prev).expect("recv");
            } else {
                cluster.recv(&self.h, ctx, prev).expect("recv");
                cluster.send(&self.s, ctx, next).expect("send");
            }
            self.mean.run().expect("mean").wait().expect("step");
        }

        fn capture(&self, c: &mut ClusterCapture<'_, '_>) -> tributary::Result<()> {
            let (next, prev, send_first) = Self::neighbours(c.cluster());
            c.schedule(self.update.routine())?;
            let ctx = self.ctx.protocol_context();
            if send_first {
                c.send(&self.s, ctx, next)?;
                c.recv(&self.h, ctx, prev)?;
            } else {
                c.recv(&self.h, ctx, prev)?;
                c.send(&self.s, ctx, next)?;
            }
            c.all_reduce(&self.mean)?;
            Ok(())
        }

        fn values(&self) -> Vec<u64> {
            let x = self.ctx.read::<f64>(&self.x).expect("read x");
            let h = self.ctx.read::<f64>(&self.h).expect("read h");
            x.iter().chain(&h).map(|v| v.to_bits()).collect()
        }
    }

    /// An f64 node of `n` elements in device memory.
    fn f64_node(label: String, n: usize) -> TensorNode {
        TensorNode::new(label, DType::F64, [n])
            .with_mode(MemoryMode::on_device())
            .expect("node")
    }

    /// A context on the network stream in which each node holds its values, written by one
    /// routine.
    fn initialised_on_network_stream(
        cluster: &Cluster,
        nodes: Vec<(TensorNode, Vec<f64>)>,
    ) -> ContextHandle {
        let args = nodes
            .iter()
            .map(|(x, _)| (x.clone(), Access::Write))
            .collect();
        let values: Vec<Vec<f64>> = nodes.into_iter().map(|(_, v)| v).collect();
        let init = cluster
            .network_context()
            .expect("network context")
            .link(
                RoutineSpec::custom("init", args, None, move |a| {
                    for (i, v) in values.iter().enumerate() {
                        a.output::<f64>(i)?.copy_from_slice(v);
                    }
                    Ok(())
                })
                .expect("spec"),
            )
            .expect("linked");
        init.schedule().expect("initialised");
        init.context()
    }

    /// Work on the network stream itself, captured and replayed: each step updates `x`
    /// from the halo, exchanges halos around the ring and averages `x` across ranks, all in
    /// place on the network stream (compute and network operations interleaved on its
    /// lane). The replayed program's values equal the issued one's bit for bit after every
    /// step, on every rank.
    pub fn in_place_steps(cluster: &Arc<Cluster>) {
        let (issued, replayed) = (
            HaloProgram::new(cluster, "issued"),
            HaloProgram::new(cluster, "replayed"),
        );
        let before = issued.values();
        issued.issue(cluster);
        let step = cluster.capture(|c| replayed.capture(c)).expect("captured");
        assert_eq!(
            step.network_operations(),
            3,
            "send, recv and the all-reduce"
        );
        cluster
            .replay(&step)
            .map(drop)
            .expect("the first replay issued");
        // The capture ran the step once and the replay once more: one issued step behind.
        issued.issue(cluster);
        assert_eq!(replayed.values(), issued.values(), "after two steps");
        for t in 2..8 {
            issued.issue(cluster);
            cluster
                .replay(&step)
                .expect("issued")
                .wait()
                .expect("replayed");
            assert_eq!(replayed.values(), issued.values(), "after step {t}");
        }
        assert_ne!(issued.values(), before, "the steps changed nothing");
        for p in [issued, replayed] {
            p.mean.finalize().expect("finalized");
            p.update.context().finalize().expect("finalized");
            cluster
                .finalize(p.ctx.protocol_context())
                .expect("finalized");
        }
    }

    /// A step of work on the network stream (produce `s`, send it to the next rank, receive
    /// the previous rank's into `h`, copy `h` into `out`) replayed while rank 0's `produce`
    /// fails once: in that replay rank 0's ticket fails with its routine's error, rank 1's
    /// with `RankInputFailed` naming rank 0 (its receive never got data), every other
    /// rank's succeeds; the next replay succeeds everywhere, each rank's `out` holding the
    /// previous rank's `produce` count.
    /// Each transfer's event is found by its position on the network stream's lane, where
    /// work runs after it: the mutant `cluster_replay_positions` (counting only the network
    /// operations) takes a later operation's event for a transfer, and the skipped send is
    /// run as the receive after it.
    pub fn failed_input_in_a_replay(cluster: &Arc<Cluster>) {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

        let (rank, size) = (cluster.rank(), cluster.size());
        let (next, prev, send_first) = HaloProgram::neighbours(cluster);
        let n = 16;
        // Rank r sends `s{r}`; its next rank receives it into its `h`, of the same label.
        let (s, h, out) = (
            f64_node(format!("s{rank}"), n),
            f64_node(format!("s{prev}"), n),
            f64_node("out".into(), n),
        );
        let ctx = initialised_on_network_stream(
            cluster,
            [&s, &h, &out]
                .into_iter()
                .map(|x| (x.clone(), vec![0.0; n]))
                .collect(),
        );
        // `produce` writes how many times it ran (a failing run counts), so every rank's
        // `s` holds the same number after the same steps.
        let (runs, fail) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let produce = {
            let (runs, fail) = (runs.clone(), fail.clone());
            ctx.link(
                RoutineSpec::custom(
                    "produce",
                    vec![(s.clone(), Access::Write)],
                    None,
                    move |a| {
                        // Relaxed: the host sets `fail` before it issues the replay that
                        // runs this; the stream's hand-off orders the two.
                        let run = runs.fetch_add(1, Ordering::Relaxed) + 1;
                        if fail.load(Ordering::Relaxed) {
                            return Err("produce failed on purpose".into());
                        }
                        a.output::<f64>(0)?.fill(run as f64);
                        Ok(())
                    },
                )
                .expect("spec"),
            )
            .expect("linked")
        };
        let consume = ctx
            .link(
                RoutineSpec::custom(
                    "consume",
                    vec![(h.clone(), Access::Read), (out.clone(), Access::Write)],
                    None,
                    |a| {
                        let h = a.input::<f64>(0)?.to_vec();
                        a.output::<f64>(1)?.copy_from_slice(&h);
                        Ok(())
                    },
                )
                .expect("spec"),
            )
            .expect("linked");
        let step = cluster
            .capture(|c| {
                let at = ctx.protocol_context();
                c.schedule(produce.routine())?;
                if send_first {
                    c.send(&s, at, next)?;
                    c.recv(&h, at, prev)?;
                } else {
                    c.recv(&h, at, prev)?;
                    c.send(&s, at, next)?;
                }
                c.schedule(consume.routine())?;
                Ok(())
            })
            .expect("captured");
        assert_eq!(step.network_operations(), 2, "a send and a receive");
        // The capture ran the step once (run 1); each replay runs it again.
        let out_now = || ctx.read::<f64>(&out).expect("read out");
        cluster
            .replay(&step)
            .expect("issued")
            .wait()
            .expect("replay 1");
        assert_eq!(out_now(), vec![2.0; n], "after the first replay");

        fail.store(rank == 0, Ordering::Relaxed);
        let failed = cluster.replay(&step).expect("issued").wait();
        match (rank, &failed) {
            (0, Err(Error::Failed(f))) => {
                assert!(f.message.contains("produce failed on purpose"), "{f}")
            }
            (1, Err(Error::RankInputFailed { rank: 0, .. })) => {}
            (r, Ok(())) if r > 1 => {}
            other => panic!("rank {rank} of {size}: the failing replay gave {other:?}"),
        }
        if rank > 1 {
            assert_eq!(
                out_now(),
                vec![3.0; n],
                "rank {rank} after the failing replay"
            );
        }

        fail.store(false, Ordering::Relaxed);
        cluster
            .replay(&step)
            .expect("issued")
            .wait()
            .unwrap_or_else(|e| panic!("rank {rank}: the replay after the failure: {e}"));
        assert_eq!(out_now(), vec![4.0; n], "rank {rank} after the failure");
        assert_eq!(
            runs.load(Ordering::Relaxed),
            4,
            "the capture and three replays"
        );
        for r in [produce, consume] {
            r.context().finalize().expect("finalized");
        }
        cluster.finalize(ctx.protocol_context()).expect("finalized");
    }

    /// A step replayed after its context was finalized is refused on every rank: its
    /// all-reduce fails with `ReplayInvalidated` here and `RankInputFailed` from the others
    /// (as an operation whose input failed), and the next all-reduce, issued, still sums
    /// every rank's value.
    pub fn invalidated_replay(cluster: &Arc<Cluster>) {
        let rank = cluster.rank();
        let g = cluster
            .system()
            .node("g", DType::F32, [64])
            .with_mode(MemoryMode::on_device())
            .expect("node");
        let fill = cluster
            .context(0, 0)
            .expect("ctx")
            .link(kernels::fill(&g, rank as f64 + 1.0).expect("spec"))
            .expect("linked");
        let plan = cluster
            .all_reduce_plan(
                std::slice::from_ref(&g),
                &[fill.context()],
                ReduceOp::Sum,
                Strategy::Tree,
            )
            .expect("plan");
        let step = cluster
            .capture(|c| {
                c.schedule(fill.routine())?;
                c.all_reduce(&plan)?;
                Ok(())
            })
            .expect("captured");
        assert_eq!(step.network_operations(), 1);
        let ranks = cluster.size();
        let sum = (1..=ranks).sum::<usize>() as f32;
        for _ in 0..3 {
            cluster
                .replay(&step)
                .expect("issued")
                .wait()
                .expect("replayed");
            assert_eq!(
                cluster
                    .system()
                    .read::<f32>(fill.protocol_context(), &g)
                    .expect("read"),
                vec![sum; 64]
            );
        }
        // A context the step writes, finalized: every rank's replay is refused.
        let other = cluster
            .context(0, 0)
            .expect("ctx")
            .link(kernels::fill(&g, 1.0).expect("spec"))
            .expect("linked");
        fill.context().finalize().expect("finalized");
        match cluster.replay(&step).and_then(|t| t.wait()) {
            Err(Error::ReplayInvalidated { .. } | Error::RankInputFailed { .. }) => {}
            other => panic!("rank {rank}: an invalidated replay gave {other:?}"),
        }
        // The ranks are still in step: a new all-reduce sums every rank's 1.
        other.schedule().expect("filled");
        let again = cluster
            .all_reduce_plan(
                std::slice::from_ref(&g),
                &[other.context()],
                ReduceOp::Sum,
                Strategy::Tree,
            )
            .expect("plan");
        again.run().expect("issued").wait().expect("all-reduced");
        assert_eq!(
            cluster
                .system()
                .read::<f32>(other.protocol_context(), &g)
                .expect("read"),
            vec![ranks as f32; 64]
        );
    }
}

cluster_test!(
    replayed_training_steps_equal_issued_ones_on_every_rank,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config(2),
    bodies::replayed_training
);

cluster_test!(
    work_on_the_network_stream_replays_what_issuing_computes,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config(1),
    bodies::in_place_steps
);

cluster_test!(
    a_failed_input_in_a_replay_fails_its_transfer_on_both_ranks_and_no_more,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config_with_deadline(1, std::time::Duration::from_secs(10)),
    bodies::failed_input_in_a_replay
);

cluster_test!(
    an_invalidated_replay_fails_on_every_rank_and_the_ranks_stay_in_step,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config(1),
    bodies::invalidated_replay
);
