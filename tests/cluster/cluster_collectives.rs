//! Collectives across MPI ranks (`tributary_actors::cluster`, feature `mpi`): hierarchical
//! all-reduces of random sizes (1 element to 16 MiB), dtypes, strategies and cross-rank
//! algorithms against a sequential reference on every rank; replicas bitwise identical
//! across ranks; transfers between ranks; one data-parallel step on 2 ranks x 2 devices
//! equal to one full-batch step on one device.
//!
//! Each test launches itself under `mpirun` (`tributary_testkit::cluster`); without the `mpi`
//! feature or without `mpirun` it prints `skipping MPI (<test>): <reason>`.

use tributary_testkit::{cluster, cluster_test};

use cluster::Launch;

#[cfg(feature = "mpi")]
pub(crate) mod bodies {
    use std::{sync::Arc, time::Duration};

    use tributary::{
        backend::cpu::CpuConfig,
        collective::{ReduceOp, Strategy},
        half::{bf16, f16},
        kernels::{self, KernelMode},
        DType, Element, MemoryMode, TensorNode,
    };
    use tributary_actors::{
        cluster::{Cluster, ClusterConfig, CrossRankAlgorithm, Exchange},
        ContextHandle, System,
    };

    use tributary_testkit::model;

    /// A child of `ctx` in which `node` (on the device) holds `values`, written by a CPU
    /// routine.
    pub fn init<T: Element + Copy + Send + Sync + 'static>(
        ctx: ContextHandle,
        node: &TensorNode,
        values: &[T],
    ) -> tributary::Result<ContextHandle> {
        let values = values.to_vec();
        let r = ctx.link(tributary::kernels::RoutineSpec::custom(
            format!("init({})", node.label()),
            vec![(node.clone(), tributary::kernels::Access::Write)],
            None,
            move |args| {
                args.output::<T>(0)?.copy_from_slice(&values);
                Ok(())
            },
        )?)?;
        r.schedule()?;
        Ok(r.context())
    }

    pub fn config(devices: usize, algorithm: CrossRankAlgorithm) -> ClusterConfig {
        let mut c = ClusterConfig::default();
        c.cpu_devices = devices;
        c.algorithm = algorithm;
        c.deadline = Duration::from_secs(60);
        // The exact kernel mode: `data_parallel_step` compares the replicas with a
        // full-batch step on one device, whose sums differ from the sharded ones only by
        // their order there (the fast mode's blocked matmuls add their own rounding).
        c.kernel_mode = KernelMode::Exact;
        c
    }

    /// [`config`] with a deadline of 10 s: a rank that fails its assertion leaves the
    /// others waiting in the next operation that long (the mutant check's cost).
    pub fn config_10s(devices: usize, algorithm: CrossRankAlgorithm) -> ClusterConfig {
        let mut c = config(devices, algorithm);
        c.deadline = Duration::from_secs(10);
        c
    }

    /// The value every (rank, device) holds at element `i`: small integers, so that sums
    /// (and means over a power of two) are exact in every dtype whatever the order.
    fn value(case: usize, rank: usize, device: usize, i: usize) -> f64 {
        ((case * 3 + rank * 5 + device * 7 + i) % 5) as f64
    }

    fn check<T>(got: &[T], want: &[f64], to: impl Fn(f64) -> T, what: &str)
    where
        T: Element + Copy + PartialEq + std::fmt::Debug,
    {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(*g, to(*w), "{what}: element {i}");
        }
    }

    /// A SplitMix64 stream: the same on every rank (the cases must be the same).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
    }

    /// Random cases: sizes log-uniform from 1 element to 16 MiB (the first case 1
    /// element, the last 16 MiB), every dtype, strategy, op; each checked on every context
    /// of every rank against the sequential sum of every (rank, device) contribution.
    pub fn random_all_reduces(cluster: &Arc<Cluster>) {
        let seed = std::env::var("TRIBUTARY_CLUSTER_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0x5eed);
        let mut rng = Rng(seed);
        let rank = cluster.rank();
        let total: usize = cluster.devices_per_rank().iter().sum();
        let dtypes = [DType::F32, DType::F64, DType::F16, DType::BF16];
        let cases = 14;
        for case in 0..cases {
            let dtype = dtypes[(rng.next() % 4) as usize];
            let bytes: usize = match case {
                0 => dtype.size_in_bytes(),
                c if c == cases - 1 => 16 << 20,
                _ => {
                    let log = (rng.next() % 2400) as f64 / 100.0; // 2^0 .. 2^24 bytes
                    (2f64.powf(log) as usize).max(dtype.size_in_bytes())
                }
            };
            let n = (bytes / dtype.size_in_bytes()).max(1);
            let strategy = Strategy::ALL[(rng.next() % 3) as usize];
            // The mean divides by the number of contexts: exact when it is a power of two.
            let op = if total.is_power_of_two() && rng.next() % 2 == 0 {
                ReduceOp::Mean
            } else {
                ReduceOp::Sum
            };
            // Context 0 on the network stream (the all-reduce in place) on some ranks and
            // not on others: a local choice, the same operation across ranks.
            let in_place = (rng.next() + rank as u64) % 2 == 0;
            all_reduce_case(cluster, case, dtype, n, strategy, op, in_place);
        }
    }

    /// Around the frames of a header message (`FRAME_BYTES` = 4,032: a header of 96 bytes,
    /// then 3,936 payload bytes in the first frame, 4,032 in each next) and the largest
    /// payload that travels with the header (64 KiB): `Direct` all-reduces of f32 whose
    /// payload fills one frame exactly, spills one element into a second, fills two frames
    /// exactly, fills the piggyback limit (seventeen frames) and passes it by one element
    /// (the data after the headers). In place on the even ranks, from a compute stream on the odd ones.
    pub fn frame_boundaries(cluster: &Arc<Cluster>) {
        let total: usize = cluster.devices_per_rank().iter().sum();
        let op = if total.is_power_of_two() {
            ReduceOp::Mean
        } else {
            ReduceOp::Sum
        };
        let in_place = cluster.rank() % 2 == 0;
        for (case, n) in [984, 985, 2000, 16384, 16385].into_iter().enumerate() {
            all_reduce_case(
                cluster,
                100 + case,
                DType::F32,
                n,
                Strategy::Tree,
                op,
                in_place,
            );
        }
    }

    /// One all-reduce of `n` elements of `dtype` (values from [`value`]), checked on every
    /// context of this rank against the sequential sum of every (rank, device)
    /// contribution. Context 0 is on the network stream when `in_place`.
    fn all_reduce_case(
        cluster: &Arc<Cluster>,
        case: usize,
        dtype: DType,
        n: usize,
        strategy: Strategy,
        op: ReduceOp,
        in_place: bool,
    ) {
        let (rank, ranks) = (cluster.rank(), cluster.size());
        let devices = cluster.devices_per_rank()[rank];
        let total: usize = cluster.devices_per_rank().iter().sum();
        let node = TensorNode::new(format!("g{case}"), dtype, [n])
            .with_mode(MemoryMode::on_device())
            .expect("node");
        let mut contexts: Vec<ContextHandle> = Vec::new();
        for d in 0..devices {
            let values: Vec<f64> = (0..n).map(|i| value(case, rank, d, i)).collect();
            let ctx = if in_place && d == 0 {
                cluster.network_context().expect("network context")
            } else {
                cluster.context(d, 0).expect("context")
            };
            let ctx = match dtype {
                DType::F32 => init(
                    ctx,
                    &node,
                    &values.iter().map(|v| *v as f32).collect::<Vec<_>>(),
                ),
                DType::F64 => init(ctx, &node, &values),
                DType::F16 => init(
                    ctx,
                    &node,
                    &values.iter().map(|v| f16::from_f64(*v)).collect::<Vec<_>>(),
                ),
                _ => init(
                    ctx,
                    &node,
                    &values
                        .iter()
                        .map(|v| bf16::from_f64(*v))
                        .collect::<Vec<_>>(),
                ),
            }
            .expect("init");
            contexts.push(ctx);
        }
        let plan = cluster
            .all_reduce_plan(std::slice::from_ref(&node), &contexts, op, strategy)
            .expect("plan");
        plan.run().expect("run").wait().expect("all-reduce");
        let want: Vec<f64> = (0..n)
            .map(|i| {
                let mut sum = 0.0;
                for r in 0..ranks {
                    for d in 0..cluster.devices_per_rank()[r] {
                        sum += value(case, r, d, i);
                    }
                }
                if op == ReduceOp::Mean {
                    sum / total as f64
                } else {
                    sum
                }
            })
            .collect();
        let what = format!(
            "case {case}: {n} x {dtype} {op:?} {strategy:?} on rank {rank} (in place: \
                 {in_place})"
        );
        for ctx in &contexts {
            match dtype {
                DType::F32 => check(
                    &ctx.read::<f32>(&node).expect("read"),
                    &want,
                    |v| v as f32,
                    &what,
                ),
                DType::F64 => check(&ctx.read::<f64>(&node).expect("read"), &want, |v| v, &what),
                DType::F16 => check(
                    &ctx.read::<f16>(&node).expect("read"),
                    &want,
                    f16::from_f64,
                    &what,
                ),
                _ => check(
                    &ctx.read::<bf16>(&node).expect("read"),
                    &want,
                    bf16::from_f64,
                    &what,
                ),
            }
        }
        plan.finalize().expect("finalize");
        for ctx in contexts {
            ctx.finalize().expect("finalize");
        }
        println!("rank {rank}: {what} ok");
    }

    /// Random floats (sums not exact): every context of every rank holds the same bits
    /// (rank 0 sends its result to every rank, which compares), whether a rank reduced in
    /// place or from a compute stream.
    pub fn replicas_bitwise_identical(cluster: &Arc<Cluster>) {
        let rank = cluster.rank();
        let devices = cluster.devices_per_rank()[rank];
        for (case, n) in [(0u64, 3usize), (1, 5000), (2, 300_000)] {
            let node = TensorNode::new(format!("w{case}"), DType::F32, [n])
                .with_mode(MemoryMode::on_device())
                .expect("node");
            // Context 0 on the network stream (the all-reduce in place, which sums into the
            // buffer holding this rank's part) on the odd ranks, then on the even ones.
            let in_place = (rank + case as usize) % 2 == 1;
            let mut contexts = Vec::new();
            for d in 0..devices {
                let mut rng = Rng((rank * 100 + d) as u64 + case);
                let values: Vec<f32> = (0..n).map(|_| (rng.next() >> 40) as f32 / 7.0e5).collect();
                let ctx = if in_place && d == 0 {
                    cluster.network_context().expect("network context")
                } else {
                    cluster.context(d, 0).expect("ctx")
                };
                contexts.push(init(ctx, &node, &values).expect("init"));
            }
            cluster
                .all_reduce(
                    std::slice::from_ref(&node),
                    &contexts,
                    ReduceOp::Mean,
                    Strategy::Tree,
                )
                .expect("all-reduce");
            let mine: Vec<f32> = contexts[0].read(&node).expect("read");
            for ctx in &contexts[1..] {
                assert_eq!(
                    ctx.read::<f32>(&node).expect("read"),
                    mine,
                    "devices differ"
                );
            }
            if rank == 0 {
                for to in 1..cluster.size() {
                    cluster
                        .send(&node, &contexts[0], to)
                        .expect("send")
                        .wait()
                        .expect("sent");
                }
                continue;
            }
            // Another node object with the same label, shape and dtype (what transfers
            // compare), to receive rank 0's bits into.
            let theirs_node = TensorNode::new(format!("w{case}"), DType::F32, [n])
                .with_mode(MemoryMode::on_device())
                .expect("node");
            let holder = init(
                cluster.context(0, 0).expect("ctx"),
                &theirs_node,
                &vec![0f32; n],
            )
            .expect("init");
            cluster
                .recv(&theirs_node, &holder, 0)
                .expect("recv")
                .wait()
                .expect("received");
            let theirs: Vec<f32> = holder.read(&theirs_node).expect("read");
            assert!(
                theirs
                    .iter()
                    .zip(&mine)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "rank {rank}'s result differs from rank 0's (case {case})"
            );
        }
    }

    /// Rank r sends a node to r + 1 and receives one from r - 1 (a ring of transfers; the
    /// even ranks send first, so blocking transfers cannot wait on each other in a cycle).
    pub fn ring_of_transfers(cluster: &Arc<Cluster>) {
        let rank = cluster.rank();
        // Data that travels with the header (8000 bytes: two full frames) and data sent after
        // it (128 KiB); from and into compute streams, in place on the network stream, and
        // mixed (the sender in place on even ranks, the receiver on odd ones). Then around
        // the frames: one frame filled exactly (492 f64 after the 96-byte header), one
        // element into a second, the largest piggybacked payload (64 KiB, seventeen frames)
        // and one element past it.
        let rounds = [
            (1000, false, false),
            (16384, true, true),
            (1000, rank % 2 == 0, rank % 2 == 1),
            (16384, rank % 2 == 1, rank % 2 == 0),
            (492, false, false),
            (493, true, false),
            (8192, false, true),
            (8193, true, true),
        ];
        for (round, (n, send_in_place, recv_in_place)) in rounds.into_iter().enumerate() {
            transfer_round(cluster, round, n, send_in_place, recv_in_place);
        }
    }

    /// One round of `ring_of_transfers`: every rank sends `n` f64 to the next and receives
    /// from the previous, then a routine reads what arrived.
    fn transfer_round(
        cluster: &Arc<Cluster>,
        round: usize,
        n: usize,
        send_in_place: bool,
        recv_in_place: bool,
    ) {
        let (rank, size) = (cluster.rank(), cluster.size());
        let what = format!("round {round} on rank {rank}: {n} f64, in place: send {send_in_place}, recv {recv_in_place}");
        let node = TensorNode::new(format!("msg{round}"), DType::F64, [n])
            .with_mode(MemoryMode::on_device())
            .expect("node");
        let mine: Vec<f64> = (0..n).map(|i| (rank * n + i + round) as f64).collect();
        let on = |in_place: bool, device: usize| {
            if in_place {
                cluster.network_context().expect("network context")
            } else {
                cluster.context(device, 0).expect("ctx")
            }
        };
        let src = init(
            on(send_in_place, 1 % cluster.devices_per_rank()[rank]),
            &node,
            &mine,
        )
        .expect("init");
        let dst = init(on(recv_in_place, 0), &node, &vec![0f64; n]).expect("init");
        let (to, from) = ((rank + 1) % size, (rank + size - 1) % size);
        let (a, b) = if rank % 2 == 0 {
            (
                cluster.send(&node, &src, to).expect("send"),
                cluster.recv(&node, &dst, from).expect("recv"),
            )
        } else {
            let b = cluster.recv(&node, &dst, from).expect("recv");
            (cluster.send(&node, &src, to).expect("send"), b)
        };
        a.wait().expect("sent");
        b.wait().expect("received");
        let want: Vec<f64> = (0..n).map(|i| (from * n + i + round) as f64).collect();
        assert_eq!(dst.read::<f64>(&node).expect("read"), want, "{what}");
        // A compute routine reading the received node waits for the transfer by itself.
        let doubled = TensorNode::new(format!("doubled{round}"), DType::F64, [n])
            .with_mode(MemoryMode::on_device())
            .expect("node");
        let r = dst
            .link(kernels::scale(&doubled, &node, 2.0).expect("spec"))
            .expect("link");
        r.schedule().expect("schedule");
        let want2: Vec<f64> = want.iter().map(|v| v * 2.0).collect();
        assert_eq!(
            r.context().read::<f64>(&doubled).expect("read"),
            want2,
            "{what}"
        );
        // The sender's value is unchanged.
        assert_eq!(src.read::<f64>(&node).expect("read"), mine, "{what}");
    }

    /// Every rank sends a node to the next rank and receives another from the previous in
    /// one `sendrecv` (on 2 ranks both directions between the same pair, issued in the
    /// order the pair shares; on 4 a ring, which blocking sends and receives issued in this
    /// order would wait on forever): data with the header (1,000 f64, two frames; 492,
    /// one full frame) and after it (16,384 f64), in place on the network stream, from a
    /// compute stream, and mixed; then a round whose odd ranks match the sendrecv with a
    /// `recv` and a `send`. Then a captured step (an update of the sent node and the
    /// sendrecv, in place) replayed three times moves each replay's values.
    pub fn sendrecv_rings(cluster: &Arc<Cluster>) {
        let rank = cluster.rank();
        let rounds = [
            (1000, Some(true), false),
            (16384, Some(true), false),
            (1000, Some(false), false),
            (16384, None, false),
            (492, None, false),
            (8193, Some(true), true),
            (1000, Some(false), true),
        ];
        for (round, (n, in_place, split)) in rounds.into_iter().enumerate() {
            let in_place = in_place.unwrap_or(rank % 2 == 0);
            let split = if split && rank % 2 == 1 {
                Split::RecvFirst
            } else {
                Split::No
            };
            sendrecv_round(cluster, round, n, in_place, split);
        }
        // On 3 ranks or more, only rank 0 runs a sendrecv and the others a blocking send
        // then a receive: a ring that completes only because rank 0 posts its receive with
        // its send (its send waits for rank 1, which waits for rank 2, ..., which waits for
        // rank 0's receive).
        if cluster.size() >= 3 {
            for (round, n) in [(50, 1000), (51, 16384)] {
                let split = if rank == 0 {
                    Split::No
                } else {
                    Split::SendFirst
                };
                sendrecv_round(cluster, round, n, true, split);
            }
        }
        replayed_sendrecv(cluster);
        refused_sendrecvs(cluster);
    }

    /// Every rank exchanges with both neighbours of a ring in one `exchange`: its low
    /// boundary `e{round}.{rank}.lo` to the previous rank and its high one to the next,
    /// receiving theirs (on 2 ranks both go to the one peer: four transfers between one
    /// pair, ordered by label whatever order each side lists them in; odd ranks list
    /// theirs reversed). In place and from a compute stream, with data with the header and
    /// after it. Then, on 3 ranks or more, one node sent to both neighbours, and a captured
    /// step of an update and the exchange replayed.
    pub fn exchange_rings(cluster: &Arc<Cluster>) {
        let (rank, size) = (cluster.rank(), cluster.size());
        let (left, right) = ((rank + size - 1) % size, (rank + 1) % size);
        for (round, (n, in_place)) in [(600, true), (9000, true), (600, false), (9000, false)]
            .into_iter()
            .enumerate()
        {
            let what =
                format!("exchange round {round} on rank {rank}: {n} f64, in place {in_place}");
            let node = |r: usize, side: &str| {
                TensorNode::new(format!("e{round}.{r}.{side}"), DType::F64, [n])
                    .with_mode(MemoryMode::on_device())
                    .expect("node")
            };
            let values = |r: usize, side: usize| -> Vec<f64> {
                (0..n)
                    .map(|i| (((r * 2 + side) * n + i) * 10 + round) as f64)
                    .collect()
            };
            let (lo, hi) = (node(rank, "lo"), node(rank, "hi"));
            let (ghost_lo, ghost_hi) = (node(left, "hi"), node(right, "lo"));
            let root = if in_place {
                cluster.network_context()
            } else {
                cluster.context(0, 0)
            }
            .expect("ctx");
            let ctx = init(root, &lo, &values(rank, 0)).expect("init");
            let ctx = init(ctx, &hi, &values(rank, 1)).expect("init");
            let ctx = init(ctx, &ghost_lo, &vec![0f64; n]).expect("init");
            let ctx = init(ctx, &ghost_hi, &vec![0f64; n]).expect("init");
            let mut parts = vec![
                Exchange::Send(&lo, left),
                Exchange::Send(&hi, right),
                Exchange::Recv(&ghost_lo, left),
                Exchange::Recv(&ghost_hi, right),
            ];
            if rank % 2 == 1 {
                parts.reverse();
            }
            cluster
                .exchange(&ctx, &parts)
                .expect("exchange")
                .wait()
                .expect(&what);
            assert_eq!(
                ctx.read::<f64>(&ghost_lo).expect("read"),
                values(left, 1),
                "{what}: low ghost"
            );
            assert_eq!(
                ctx.read::<f64>(&ghost_hi).expect("read"),
                values(right, 0),
                "{what}: high ghost"
            );
            assert_eq!(
                ctx.read::<f64>(&lo).expect("read"),
                values(rank, 0),
                "{what}: sent node"
            );
            cluster.finalize(&ctx).expect("finalize");
        }
        if size < 3 {
            return;
        }
        // One node to both neighbours, then a captured step replayed.
        let n = 300;
        let m = |r: usize| {
            TensorNode::new(format!("m.{r}"), DType::F64, [n])
                .with_mode(MemoryMode::on_device())
                .expect("node")
        };
        let (mine, from_left, from_right) = (m(rank), m(left), m(right));
        let ctx = init(
            cluster.network_context().expect("ctx"),
            &mine,
            &vec![rank as f64; n],
        )
        .expect("init");
        let ctx = init(ctx, &from_left, &vec![0f64; n]).expect("init");
        let ctx = init(ctx, &from_right, &vec![0f64; n]).expect("init");
        let bump = bump(&ctx, &mine, 100.0);
        let ctx = bump.context();
        let parts = [
            Exchange::Recv(&from_right, right),
            Exchange::Send(&mine, left),
            Exchange::Recv(&from_left, left),
            Exchange::Send(&mine, right),
        ];
        let step = cluster
            .capture(|c| {
                c.schedule(bump.routine())?;
                c.exchange(&ctx, &parts)?;
                Ok(())
            })
            .expect("captured");
        for k in 2..4 {
            cluster
                .replay(&step)
                .expect("replay")
                .wait()
                .expect("replayed");
            let bumped = |r: usize| vec![r as f64 + 100.0 * k as f64; n];
            assert_eq!(
                ctx.read::<f64>(&from_left).expect("read"),
                bumped(left),
                "rank {rank}, step {k}"
            );
            assert_eq!(
                ctx.read::<f64>(&from_right).expect("read"),
                bumped(right),
                "rank {rank}, step {k}"
            );
        }
        cluster.finalize(&ctx).expect("finalize");
    }

    /// Calls refused before anything is issued, with the offending value, and the next
    /// sendrecv still in step: one node both sent and received, a rank past the last, this
    /// rank as its own peer, a node the context does not hold.
    fn refused_sendrecvs(cluster: &Arc<Cluster>) {
        let (rank, size) = (cluster.rank(), cluster.size());
        let (own, halo, ctx) = sendrecv_nodes(cluster, 200, 8, true);
        let (to, from) = ((rank + 1) % size, (rank + size - 1) % size);
        match cluster.sendrecv(&own, to, &own, from, &ctx) {
            Err(tributary::Error::InvalidRoutine { reason, .. }) => {
                assert!(reason.contains("both sent and received"), "{reason}")
            }
            other => panic!("one node both ways: {:?}", other.map(drop)),
        }
        match cluster.sendrecv(&own, size, &halo, from, &ctx) {
            Err(tributary::Error::NoSuchRank { rank: r, size: s }) => {
                assert_eq!((r, s), (size, size))
            }
            other => panic!("a rank past the last: {:?}", other.map(drop)),
        }
        assert!(
            matches!(
                cluster.sendrecv(&own, rank, &halo, from, &ctx),
                Err(tributary::Error::InvalidRoutine { .. })
            ),
            "this rank as its own peer"
        );
        let stranger = TensorNode::new("stranger", DType::F64, [8])
            .with_mode(MemoryMode::on_device())
            .expect("node");
        assert!(
            matches!(
                cluster.sendrecv(&own, to, &stranger, from, &ctx),
                Err(tributary::Error::NodeNotInContext { .. })
            ),
            "a node the context does not hold"
        );
        cluster
            .sendrecv(&own, to, &halo, from, &ctx)
            .expect("sendrecv")
            .wait()
            .expect("the sendrecv after the refused ones");
        let want: Vec<f64> = (0..8).map(|i| (from * 8 + i + 200) as f64).collect();
        assert_eq!(ctx.read::<f64>(&halo).expect("read"), want);
        cluster.finalize(&ctx).expect("finalize");
    }

    /// The nodes of a sendrecv round, in one context (on the network stream or a compute
    /// stream): this rank's own, holding its values, and the halo, zeros, that receives
    /// the previous rank's. A node is named after the rank that owns it (`v{round}.{rank}`),
    /// so a transfer moves a node of one label from its owner to its neighbour.
    fn sendrecv_nodes(
        cluster: &Arc<Cluster>,
        round: usize,
        n: usize,
        in_place: bool,
    ) -> (TensorNode, TensorNode, ContextHandle) {
        let (rank, size) = (cluster.rank(), cluster.size());
        let owned_by = |r: usize| {
            TensorNode::new(format!("v{round}.{r}"), DType::F64, [n])
                .with_mode(MemoryMode::on_device())
                .expect("node")
        };
        let (own, halo) = (owned_by(rank), owned_by((rank + size - 1) % size));
        let root = if in_place {
            cluster.network_context()
        } else {
            cluster.context(0, 0)
        }
        .expect("ctx");
        let mine: Vec<f64> = (0..n).map(|i| (rank * n + i + round) as f64).collect();
        let ctx = init(root, &own, &mine).expect("init");
        let ctx = init(ctx, &halo, &vec![0f64; n]).expect("init");
        (own, halo, ctx)
    }

    /// One round of `sendrecv_rings`; `split`: a `recv` from the previous rank, then a
    /// `send` to the next, instead of the sendrecv.
    fn sendrecv_round(
        cluster: &Arc<Cluster>,
        round: usize,
        n: usize,
        in_place: bool,
        split: Split,
    ) {
        let (rank, size) = (cluster.rank(), cluster.size());
        let what = format!(
            "sendrecv round {round} on rank {rank}: {n} f64, in place {in_place}, {split:?}"
        );
        let (own, halo, ctx) = sendrecv_nodes(cluster, round, n, in_place);
        let (to, from) = ((rank + 1) % size, (rank + size - 1) % size);
        if split == Split::RecvFirst {
            let r = cluster.recv(&halo, &ctx, from).expect("recv");
            let s = cluster.send(&own, &ctx, to).expect("send");
            r.wait().expect(&what);
            s.wait().expect(&what);
        } else if split == Split::SendFirst {
            let s = cluster.send(&own, &ctx, to).expect("send");
            let r = cluster.recv(&halo, &ctx, from).expect("recv");
            r.wait().expect(&what);
            s.wait().expect(&what);
        } else {
            cluster
                .sendrecv(&own, to, &halo, from, &ctx)
                .expect("sendrecv")
                .wait()
                .expect(&what);
        }
        let want: Vec<f64> = (0..n).map(|i| (from * n + i + round) as f64).collect();
        assert_eq!(ctx.read::<f64>(&halo).expect("read"), want, "{what}");
        let mine: Vec<f64> = (0..n).map(|i| (rank * n + i + round) as f64).collect();
        assert_eq!(
            ctx.read::<f64>(&own).expect("read"),
            mine,
            "{what}: sent node"
        );
        cluster.finalize(&ctx).expect("finalize");
    }

    /// A routine of a child of `ctx` adding `by` to every element of `node` (f64).
    fn bump(ctx: &ContextHandle, node: &TensorNode, by: f64) -> tributary_actors::RoutineHandle {
        let spec = tributary::kernels::RoutineSpec::custom(
            "bump",
            vec![(node.clone(), tributary::kernels::Access::ReadWrite)],
            None,
            move |args| {
                for v in args.output::<f64>(0)? {
                    *v += by;
                }
                Ok(())
            },
        )
        .expect("spec");
        ctx.link(spec).expect("link")
    }

    /// How a rank runs its part of a sendrecv round.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Split {
        /// A sendrecv.
        No,
        /// A `recv` from the previous rank, then a `send` to the next.
        RecvFirst,
        /// A `send` to the next rank, then a `recv` from the previous.
        SendFirst,
    }

    /// A step of work in place, captured: add 1 to the sent node, then the sendrecv. Each
    /// replay sends the updated values: after `k` steps the halo holds the previous rank's
    /// values plus `k`.
    fn replayed_sendrecv(cluster: &Arc<Cluster>) {
        let (rank, size) = (cluster.rank(), cluster.size());
        let n = 700;
        let (own, halo, ctx) = sendrecv_nodes(cluster, 100, n, true);
        let bump = bump(&ctx, &own, 1.0);
        let ctx = bump.context();
        let (to, from) = ((rank + 1) % size, (rank + size - 1) % size);
        let step = cluster
            .capture(|c| {
                c.schedule(bump.routine())?;
                c.sendrecv(&own, to, &halo, from, &ctx)?;
                Ok(())
            })
            .expect("captured");
        for k in 2..5 {
            cluster
                .replay(&step)
                .expect("replay")
                .wait()
                .expect("replayed");
            let want: Vec<f64> = (0..n).map(|i| (from * n + i + 100 + k) as f64).collect();
            assert_eq!(
                ctx.read::<f64>(&halo).expect("read"),
                want,
                "rank {rank}: halo after {k} steps"
            );
        }
        cluster.finalize(&ctx).expect("finalize");
    }

    /// A bucketed all-reduce of ten small gradients (several per bucket) sums every
    /// replica of every rank into every gradient of every context.
    pub fn bucketed_all_reduce(cluster: &Arc<Cluster>) {
        let (rank, devices) = (cluster.rank(), cluster.devices_per_rank()[cluster.rank()]);
        let grads: Vec<TensorNode> = (0..10)
            .map(|c| {
                TensorNode::new(format!("g{c}"), DType::F32, [3 + c % 4])
                    .with_mode(MemoryMode::on_device())
                    .expect("node")
            })
            .collect();
        // Replica (rank, d) holds (rank * devices + d + 1) * 10 + c in gradient c.
        let value = |r: usize, d: usize, c: usize| ((r * devices + d + 1) * 10 + c) as f32;
        let contexts: Vec<ContextHandle> = (0..devices)
            .map(|d| {
                let mut ctx = cluster.context(d, 0).expect("ctx");
                for (c, g) in grads.iter().enumerate() {
                    ctx = init(ctx, g, &vec![value(rank, d, c); g.numel()]).expect("init");
                }
                ctx
            })
            .collect();
        let plan = cluster
            .bucketed_all_reduce(&grads, &contexts, ReduceOp::Sum, Strategy::Tree, 64)
            .expect("plan");
        assert!(plan.bucket_count() > 1 && plan.bucket_count() < grads.len());
        plan.run().expect("issued").wait().expect("all-reduced");
        for (c, g) in grads.iter().enumerate() {
            let want: f32 = (0..cluster.size())
                .flat_map(|r| (0..devices).map(move |d| (r, d)))
                .map(|(r, d)| value(r, d, c))
                .sum();
            for ctx in plan.contexts() {
                assert_eq!(
                    cluster.system().read::<f32>(ctx, g).expect("read"),
                    vec![want; g.numel()],
                    "rank {rank}, gradient {c}"
                );
            }
        }
        plan.finalize().expect("finalize");
    }

    /// One data-parallel step on every device of every rank equals one full-batch step on
    /// one device (within 1e-5 relative); the replicas are bitwise identical everywhere.
    pub fn data_parallel_step(cluster: &Arc<Cluster>) {
        let cfg = model::ModelConfig {
            samples: 90,
            ..Default::default()
        };
        let data = model::make_data(&cfg);
        let init = model::init_params(&cfg);
        let single_sys = System::builder()
            .cpu_devices(1)
            .cpu(CpuConfig::default().with_kernel_mode(KernelMode::Exact))
            .spawn()
            .expect("system");
        let single = model::DataParallel::new(&single_sys, &cfg, 1, &data, &init, Strategy::Star)
            .expect("single");
        single.step().expect("step");
        let reference = single.params(0).expect("params");
        single_sys.shutdown().expect("shutdown");
        assert_ne!(reference, init, "the step changed nothing");
        let dp =
            model::DataParallel::on_cluster(cluster.clone(), &cfg, &data, &init, Strategy::Tree)
                .expect("on the cluster");
        dp.step().expect("step");
        let params = dp.params(0).expect("params");
        for i in 1..dp.replicas() {
            assert_eq!(dp.params(i).expect("params"), params, "replica {i} differs");
        }
        let close = |a: &[f32], b: &[f32], what: &str| {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                let scale = x.abs().max(y.abs()).max(1e-3);
                assert!(
                    (x - y).abs() <= 1e-5 * scale,
                    "{what}[{i}]: {x} vs {y} (full batch)"
                );
            }
        };
        close(&params.w1, &reference.w1, "w1");
        close(&params.b1, &reference.b1, "b1");
        close(&params.w2, &reference.w2, "w2");
        close(&params.b2, &reference.b2, "b2");
        // Bitwise the same on every rank: a digest of the bits, summed across ranks, is the
        // number of ranks times this rank's.
        let parts = params.digest_parts();
        let sums = cluster.sum_host(&parts).expect("sum");
        let n = cluster.size() as f64;
        assert_eq!(
            sums,
            parts.iter().map(|p| p * n).collect::<Vec<_>>(),
            "ranks hold different parameters"
        );
        assert!(dp.loss().expect("loss").is_finite());
    }
}

cluster_test!(
    random_all_reduces_match_the_sequential_sum,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config(2, tributary_actors::cluster::CrossRankAlgorithm::Auto),
    bodies::random_all_reduces
);

cluster_test!(
    all_reduces_around_the_frames_of_a_header_message,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config(2, tributary_actors::cluster::CrossRankAlgorithm::Auto),
    bodies::frame_boundaries
);

cluster_test!(
    replicas_are_bitwise_identical_across_ranks,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config_10s(2, tributary_actors::cluster::CrossRankAlgorithm::Auto),
    bodies::replicas_bitwise_identical
);

cluster_test!(
    transfers_between_ranks,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config(2, tributary_actors::cluster::CrossRankAlgorithm::Auto),
    bodies::ring_of_transfers
);

cluster_test!(
    sendrecv_moves_both_directions_at_once,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config_10s(1, tributary_actors::cluster::CrossRankAlgorithm::Auto),
    bodies::sendrecv_rings
);

cluster_test!(
    an_exchange_moves_every_transfer_at_once,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config_10s(1, tributary_actors::cluster::CrossRankAlgorithm::Auto),
    bodies::exchange_rings
);

cluster_test!(
    one_data_parallel_step_on_two_ranks_equals_one_full_batch_step,
    [Launch::ranks(2)],
    bodies::config(2, tributary_actors::cluster::CrossRankAlgorithm::Auto),
    bodies::data_parallel_step
);

cluster_test!(
    bucketed_all_reduce_sums_every_gradient_of_every_rank,
    [Launch::ranks(2), Launch::ranks(4)],
    bodies::config(2, tributary_actors::cluster::CrossRankAlgorithm::Auto),
    bodies::bucketed_all_reduce
);
