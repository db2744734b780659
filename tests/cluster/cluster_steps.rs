//! Cross-rank steps captured and replayed (`Cluster::capture`, `Cluster::replay`, feature
//! `mpi`): data-parallel training whose steps after the first are replays, the all-reduce
//! across ranks included, computes bit for bit what issuing every step computes, with every
//! replica identical on every rank; a replay something invalidated fails on every rank
//! with the typed error issuing gives, and the ranks stay in step.
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
        kernels, DType, Error, MemoryMode,
    };
    use tributary_actors::cluster::{Cluster, ClusterConfig, CrossRankAlgorithm};

    use tributary_testkit::model;

    /// The collectives' configuration (exact kernels, a long deadline), `Auto` across ranks.
    pub fn config(devices: usize) -> ClusterConfig {
        crate::cluster_collectives::bodies::config(devices, CrossRankAlgorithm::Auto)
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
    an_invalidated_replay_fails_on_every_rank_and_the_ranks_stay_in_step,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config(1),
    bodies::invalidated_replay
);
