//! Device-to-device copy and merge (add-into) bandwidth on the CPU backend, beside plain
//! memcpy and a plain add loop over the same sizes.

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use tributary::{kernels, DType, MemoryMode, MergeBufferUse, TensorNode};
use tributary_actors::{StreamConfig, System};

/// Registers this module's benchmarks.
pub fn bench(c: &mut Criterion) {
    let sys = System::builder()
        .cpu_devices(2)
        .streams(StreamConfig::OnlyDevicesParallel)
        .spawn()
        .expect("spawn");
    let mut g = c.benchmark_group("bandwidth");
    for mib in [1usize, 16, 64] {
        let bytes = mib << 20;
        let n = bytes / 4;
        g.throughput(Throughput::Bytes(bytes as u64));
        let x = TensorNode::new(format!("x{mib}"), DType::F32, [n])
            .with_mode(MemoryMode::on_device())
            .expect("mode");
        let src = sys
            .context(0, 0)
            .expect("ctx")
            .link(kernels::fill(&x, 1.0).expect("spec"))
            .expect("link");
        let dst = sys
            .context(1, 0)
            .expect("ctx")
            .link(kernels::fill(&x, 0.0).expect("spec"))
            .expect("link");
        let merge = dst
            .context()
            .link(kernels::add_merge(&x).expect("spec"))
            .expect("link");
        src.schedule().expect("s");
        dst.schedule().expect("s").wait().expect("w");
        g.bench_function(format!("d2d_copy/{mib}MiB"), |b| {
            b.iter(|| {
                sys.device_to_device(&x, &src.context(), &dst.context(), MergeBufferUse::No)
                    .expect("copy")
                    .expect("event")
                    .wait()
                    .expect("wait")
            })
        });
        g.bench_function(format!("memcpy/{mib}MiB"), |b| {
            let a = vec![1u8; bytes];
            let mut d = vec![0u8; bytes];
            b.iter(|| d.copy_from_slice(std::hint::black_box(&a)))
        });
        g.bench_function(format!("merge_streaming/{mib}MiB"), |b| {
            b.iter(|| {
                sys.device_to_device(
                    &x,
                    &src.context(),
                    &merge.context(),
                    MergeBufferUse::StreamingFor(merge.routine().clone()),
                )
                .expect("merge")
                .expect("event")
                .wait()
                .expect("wait")
            })
        });
        g.bench_function(format!("add_loop/{mib}MiB"), |b| {
            let a = vec![1.0f32; n];
            let mut d = vec![0.0f32; n];
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    d.iter_mut()
                        .zip(std::hint::black_box(&a))
                        .for_each(|(d, s)| *d += s);
                }
                start.elapsed()
            })
        });
    }
    g.finish();
    let _ = sys.shutdown_within(Duration::from_secs(10));
}
