//! What the examples share: the `--backend` flag and logging. Each example includes this
//! file with `#[path = ".../common/mod.rs"] mod common;`.

// Each example uses its own part of this module.
#![allow(dead_code)]

use std::process::ExitCode;

use clap::ValueEnum;
use tributary::backend::{cuda::CudaConfig, vulkan::VulkanConfig, BackendKind};

/// The backend an example runs on (`--backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// Virtual CPU devices (always available).
    Cpu,
    /// Vulkan devices; on a machine without a GPU, Mesa's lavapipe
    /// (`VK_ICD_FILENAMES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json`).
    Vulkan,
    /// NVIDIA GPUs through CUDA (several logical devices per GPU when more devices than
    /// GPUs are asked for).
    Cuda,
}

impl BackendArg {
    /// The backend with `devices` devices (`None`: every device the machine has; the CPU
    /// backend then makes one), or why this build cannot run it.
    pub fn kind(self, devices: Option<usize>) -> Result<BackendKind, String> {
        match self {
            BackendArg::Cpu => Ok(BackendKind::Cpu),
            BackendArg::Vulkan => Ok(BackendKind::Vulkan(VulkanConfig {
                devices,
                ..VulkanConfig::default()
            })),
            BackendArg::Cuda => Ok(BackendKind::Cuda(CudaConfig {
                devices,
                ..CudaConfig::default()
            })),
        }
    }

    /// The name `--backend` takes.
    pub fn name(self) -> String {
        self.to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default()
    }
}

/// Shows the runtime's `tracing` spans and events on stderr, filtered by `RUST_LOG`
/// (default `warn`; `RUST_LOG=debug` shows every operation's span with its duration).
pub fn init_logging() {
    use tracing_subscriber::{fmt::format::FmtSpan, EnvFilter};
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_span_events(FmtSpan::CLOSE)
        .with_writer(std::io::stderr)
        .init();
}

/// The exit status of an example's `run`: failure (after printing the error) on `Err`.
pub fn exit_code<E: std::fmt::Display>(result: Result<(), E>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
