//! What this machine offers: every backend, its devices and their properties, or why the
//! backend is unavailable here.
//!
//! ```sh
//! cargo run --example devices
//! VK_ICD_FILENAMES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json cargo run --example devices
//! ```

#[path = "common/mod.rs"]
mod common;

use clap::{Parser, ValueEnum};
use common::BackendArg;

#[derive(Parser, Debug)]
#[command(about = "Lists every backend, its devices and their properties")]
struct Args {
    /// Virtual CPU devices to describe (the CPU backend makes as many as asked).
    #[arg(long, default_value_t = 1)]
    cpu_devices: usize,
}

fn main() {
    let args = Args::parse();
    common::init_logging();
    for backend in BackendArg::value_variants() {
        println!("{}:", backend.name());
        // The Vulkan and CUDA backends make one device per GPU when given no count.
        let count = (*backend == BackendArg::Cpu).then_some(args.cpu_devices);
        let created = backend
            .kind(count)
            .and_then(|kind| kind.create(args.cpu_devices).map_err(|e| e.to_string()));
        match created {
            Err(why) => println!("  unavailable: {why}"),
            Ok(b) => {
                for device in b.devices() {
                    match b.device_info(device) {
                        Ok(info) => println!("  {info}"),
                        Err(e) => println!("  device {device}: {e}"),
                    }
                }
            }
        }
    }
}
