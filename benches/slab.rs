//! Slab sub-allocation and free beside the system allocator, and the pool's reuse rate.

use std::hint::black_box;

use criterion::Criterion;
use tributary::{
    memory::{AlignedBuffer, DevicePools, PoolConfig, PoolOp, UseEvent},
    DeviceId, StreamId,
};

#[derive(Clone)]
struct Done;

impl UseEvent for Done {
    fn is_done(&self) -> bool {
        true
    }
    fn stream(&self) -> StreamId {
        StreamId {
            device: DeviceId(0),
            index: 0,
        }
    }
}

const SIZES: [u64; 8] = [256, 4096, 1000, 65536, 64, 12288, 300_000, 2048];

/// Registers this module's benchmarks.
pub fn bench(c: &mut Criterion) {
    let stream = StreamId {
        device: DeviceId(0),
        index: 0,
    };
    let mut g = c.benchmark_group("slab");
    let mut pools: DevicePools<Done> = DevicePools::new(DeviceId(0), PoolConfig::default());
    let mut ops: Vec<PoolOp> = Vec::new();
    g.bench_function("pool_alloc_free/8", |b| {
        b.iter(|| {
            let mut live = Vec::with_capacity(SIZES.len());
            for &s in &SIZES {
                live.push(pools.alloc(s, 64, stream, &mut ops).expect("alloc"));
            }
            for a in live {
                pools.free(black_box(a), Vec::new(), stream).expect("free");
            }
            ops.clear();
        })
    });
    let stats = pools.stats();
    let rate = stats.reuse_count as f64 / (stats.reuse_count + stats.fresh_count).max(1) as f64;
    eprintln!(
        "slab: reuse rate {:.4} ({} reused, {} fresh), {} pool(s), fragmentation {:.3}",
        rate, stats.reuse_count, stats.fresh_count, stats.pools, stats.fragmentation
    );
    g.bench_function("system_alloc_free/8", |b| {
        b.iter(|| {
            let mut live = Vec::with_capacity(SIZES.len());
            for &s in &SIZES {
                let layout = std::alloc::Layout::from_size_align(s as usize, 64).expect("layout");
                // SAFETY: `layout` has a non-zero size; the pointer is freed below with it.
                live.push((unsafe { std::alloc::alloc(layout) }, layout));
            }
            for (p, layout) in live {
                if !p.is_null() {
                    // SAFETY: `p` came from `alloc` with this very layout and is freed once.
                    unsafe { std::alloc::dealloc(black_box(p), layout) };
                }
            }
        })
    });
    // A CPU pool's memory, created, its first 4 KiB page written, dropped: what a new pool
    // costs the stream that needs it. Baseline: the zeroed buffer a user would make,
    // `vec![0u8; n]` (calloc). Beside them, `alloc_zeroed` at the pool's 64-byte alignment,
    // which was `AlignedBuffer::new` before it went through calloc's alignment (a memset of
    // every byte).
    const POOL: usize = 64 << 20;
    g.bench_function("cpu_pool_64MiB_first_page", |b| {
        b.iter(|| {
            let buffer = AlignedBuffer::new(POOL, 64).expect("pool");
            // SAFETY: nobody else uses `buffer`.
            unsafe { buffer.bytes_mut(0, 4096) }.expect("page").fill(1);
            black_box(buffer);
        })
    });
    g.bench_function("calloc_64MiB_first_page", |b| {
        b.iter(|| {
            let mut buffer = vec![0u8; POOL];
            buffer[..4096].fill(1);
            black_box(buffer);
        })
    });
    g.bench_function("alloc_zeroed_aligned_64MiB_first_page", |b| {
        let layout = std::alloc::Layout::from_size_align(POOL, 64).expect("layout");
        b.iter(|| {
            // SAFETY: `layout` has a non-zero size; the pointer is freed below with it.
            let p = unsafe { std::alloc::alloc_zeroed(layout) };
            if !p.is_null() {
                // SAFETY: `p` holds `POOL` bytes; it is freed once, with its layout.
                unsafe {
                    std::ptr::write_bytes(p, 1, 4096);
                    std::alloc::dealloc(black_box(p), layout);
                }
            }
        })
    });
    g.finish();
}
