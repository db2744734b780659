//! The cluster's configuration and its start: MPI, the device counts of every rank, the
//! system with its network stream.

use std::{
    sync::{atomic::AtomicBool, Arc, Mutex},
    time::Duration,
};

use tributary::{
    backend::cpu::{CpuBackend, CpuConfig},
    kernels::KernelMode,
    DType, DeviceId, Error, Result, StreamId, TensorNode,
};

use super::{
    header::CrossRankAlgorithm,
    mpi::{Mpi, DEFAULT_DEADLINE},
    network::{Network, NetworkConfig},
    token_mode, Cluster,
};
use crate::{StreamConfig, System};

/// How a rank's part of the cluster is set up. The network settings (deadline aside) must
/// be the same on every rank: they decide the algorithm, which the header carries.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct ClusterConfig {
    /// CPU devices of this rank (default 1).
    pub cpu_devices: usize,
    /// Compute streams per device (default 1); the network stream comes after them.
    pub compute_streams: usize,
    /// How long a network operation waits to hear from a rank before it fails with
    /// `Error::RankUnreachable` (default 60 s).
    pub deadline: Duration,
    /// How the cross-rank part of an all-reduce moves data (default `Auto`).
    pub algorithm: CrossRankAlgorithm,
    /// `Auto` uses `Direct` up to this many bytes on the wire, `Ring` above (default 64 KiB:
    /// `Direct` measured ahead of the ring up to there, BENCHMARKS.md).
    pub direct_max_bytes: usize,
    /// Largest message of the ring, in bytes (default 1 MiB).
    pub chunk_bytes: usize,
    /// How this rank's CPU built-ins order their sums (default `Fast`). Replicas stay
    /// identical across ranks in either mode: an all-reduce gives every rank the same bits.
    pub kernel_mode: KernelMode,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            cpu_devices: 1,
            compute_streams: 1,
            deadline: DEFAULT_DEADLINE,
            algorithm: CrossRankAlgorithm::Auto,
            direct_max_bytes: 64 << 10,
            chunk_bytes: 1 << 20,
            kernel_mode: KernelMode::Fast,
        }
    }
}

/// Builds a [`Cluster`] ([`Cluster::builder`]).
#[derive(Clone, Debug, Default)]
pub struct ClusterBuilder {
    config: ClusterConfig,
}

impl ClusterBuilder {
    /// CPU devices of this rank.
    pub fn cpu_devices(mut self, n: usize) -> Self {
        self.config.cpu_devices = n;
        self
    }

    /// Compute streams per device.
    pub fn compute_streams(mut self, n: usize) -> Self {
        self.config.compute_streams = n;
        self
    }

    /// The deadline of every network operation ([`ClusterConfig::deadline`]).
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.config.deadline = deadline;
        self
    }

    /// The cross-rank algorithm ([`ClusterConfig::algorithm`]).
    pub fn algorithm(mut self, algorithm: CrossRankAlgorithm) -> Self {
        self.config.algorithm = algorithm;
        self
    }

    /// How the CPU built-ins order their sums ([`ClusterConfig::kernel_mode`]).
    pub fn kernel_mode(mut self, mode: KernelMode) -> Self {
        self.config.kernel_mode = mode;
        self
    }

    /// The whole configuration.
    pub fn config(mut self, config: ClusterConfig) -> Self {
        self.config = config;
        self
    }

    /// Initialises MPI, learns every rank's device count, and starts this rank's system
    /// (`compute_streams + 1` streams per device; the last one of device 0 is the network
    /// stream). Every rank calls it.
    pub fn spawn(self) -> Result<Cluster> {
        let c = self.config;
        let invalid = |setting: &str, value: String, reason: &str| Error::InvalidConfig {
            setting: setting.into(),
            value,
            reason: reason.into(),
        };
        if c.cpu_devices == 0 {
            return Err(invalid("cpu_devices", "0".into(), "a rank needs a device"));
        }
        if c.compute_streams == 0 {
            return Err(invalid(
                "compute_streams",
                "0".into(),
                "a device needs a compute stream",
            ));
        }
        if c.deadline.is_zero() {
            return Err(invalid(
                "deadline",
                "0s".into(),
                "no operation could finish",
            ));
        }
        if c.chunk_bytes < 8 || c.chunk_bytes > i32::MAX as usize {
            return Err(invalid(
                "chunk_bytes",
                c.chunk_bytes.to_string(),
                "a ring message holds 8 bytes to 2^31 - 1 bytes",
            ));
        }
        let mpi = Mpi::init()?;
        let started = (|| {
            let devices: Vec<usize> = mpi
                .all_gather_u64(c.cpu_devices as u64)?
                .into_iter()
                .map(|d| d as usize)
                .collect();
            // The network stream's kernels block on MPI (up to the deadline): a thread of
            // its own, so they never hold a worker the compute streams share.
            let network_stream = StreamId {
                device: DeviceId(0),
                index: u32::try_from(c.compute_streams).unwrap_or(u32::MAX),
            };
            let backend: Arc<dyn tributary::backend::Backend> = Arc::new(CpuBackend::with_config(
                DeviceId(0),
                c.cpu_devices,
                CpuConfig::default()
                    .with_dedicated_stream(network_stream)
                    .with_kernel_mode(c.kernel_mode),
            )?);
            let sys = System::builder()
                .cpu_devices(c.cpu_devices)
                .streams(StreamConfig::MostParallelStreams(c.compute_streams + 1))
                .backend_instance(backend.clone())
                .spawn()?;
            let net_root = sys.context(0, c.compute_streams)?;
            Ok::<_, Error>((devices, backend, sys, net_root))
        })();
        let (devices, backend, sys, net_root) = match started {
            Ok(s) => s,
            Err(e) => {
                mpi.finalize();
                return Err(e);
            }
        };
        let token = TensorNode::new("cluster.token", DType::U8, [1]).with_mode(token_mode())?;
        Ok(Cluster {
            net: Arc::new(Network::new(
                mpi,
                NetworkConfig {
                    deadline: c.deadline,
                    algorithm: c.algorithm,
                    direct_max_bytes: c.direct_max_bytes,
                    chunk_bytes: c.chunk_bytes,
                },
            )),
            sys,
            backend,
            devices,
            compute_streams: c.compute_streams,
            net_root,
            token,
            shut_down: AtomicBool::new(false),
            issuing: Mutex::new(Default::default()),
            transfers: Mutex::new(tributary::ids::IdMap::default()),
            barrier: Mutex::new(None),
        })
    }
}
