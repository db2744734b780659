//! Launch geometry and parameter lists of the CUDA kernels, checked without a GPU: every
//! built-in for every dtype it supports, against the C signatures of the generated source.

#![allow(clippy::unwrap_used)]

use super::*;
use crate::{
    ids::{BufferLoc, DeviceId, PoolId},
    kernels::{self, Access, RoutineSpec, ShaderKernel},
    node::{Shape, TensorNode},
    protocol::GlobalLoc,
};

/// No index values (the built-ins', and user kernels that declare none).
const NONE: Bindings = Bindings::none();

/// A device with 132 multiprocessors and the usual limits.
const BIG: LaunchLimits = LaunchLimits {
    multiprocessor_count: 132,
    ..LaunchLimits::MINIMUM
};

/// A device with the usual blocks but at most 2 blocks per grid, so that every loop
/// strides (tiled matmuls included).
const TWO_BLOCKS: LaunchLimits = LaunchLimits {
    max_grid: [2, 65535, 65535],
    ..LaunchLimits::MINIMUM
};

/// A device with tiny limits, so that caps and block lowering show.
const TINY: LaunchLimits = LaunchLimits {
    max_threads_per_block: 48,
    max_block: [40, 40, 8],
    max_grid: [3, 2, 2],
    max_shared_mem_per_block: 1024,
    multiprocessor_count: 1,
};

fn binding(i: u64, dtype: DType, shape: &[usize], access: Access) -> ArgBinding {
    let numel: usize = shape.iter().product();
    ArgBinding {
        loc: GlobalLoc {
            device: DeviceId(0),
            loc: BufferLoc {
                pool: PoolId(0),
                offset: i * 4096,
            },
        },
        bytes: (numel * dtype.size_in_bytes()) as u64,
        dtype,
        shape: Shape::from(shape),
        access,
    }
}

/// The bindings of a spec's parameters and merge node.
fn bindings(spec: &RoutineSpec) -> (Vec<ArgBinding>, Option<ArgBinding>) {
    let args = spec
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| binding(i as u64, p.node.dtype(), p.node.shape().dims(), p.access))
        .collect();
    let merge = spec
        .merge
        .as_ref()
        .map(|n| binding(99, n.dtype(), n.shape().dims(), Access::Read));
    (args, merge)
}

/// The C parameter types of `entry` in `source`, pointers written `T*`.
fn signature(source: &str, entry: &str) -> Vec<String> {
    let head = format!("extern \"C\" __global__ void {entry}(");
    let start = source
        .find(&head)
        .unwrap_or_else(|| panic!("no entry point {entry}"))
        + head.len();
    let end = start + source[start..].find(')').unwrap();
    source[start..end]
        .split(',')
        .map(|p| {
            if p.contains('*') {
                "T*".to_string()
            } else {
                let words: Vec<&str> = p.split_whitespace().collect();
                words[..words.len() - 1].join(" ")
            }
        })
        .collect()
}

/// Every built-in, over nodes of `dtype` with the given sizes (`m` rows, `k` inner, `n`
/// columns), and the items its launches must cover, in launch order.
fn cases(dtype: DType, m: usize, k: usize, n: usize) -> Vec<(RoutineSpec, Vec<u64>)> {
    let t = |dims: &[usize]| TensorNode::new("t", dtype, Shape::from(dims));
    let mn = (m * n) as u64;
    let out = vec![
        (kernels::fill(&t(&[m, n]), 2.5), vec![mn]),
        (kernels::copy(&t(&[m, n]), &t(&[n, m])), vec![mn]),
        (
            kernels::copy_range(
                &t(&[m, n]),
                usize::from(mn > 0),
                &t(&[m, n]),
                0,
                (m * n).saturating_sub(1),
            ),
            vec![mn.saturating_sub(1)],
        ),
        (kernels::add_into(&t(&[m, n]), &t(&[m, n])), vec![mn]),
        (kernels::add_merge(&t(&[m, n])), vec![mn]),
        (kernels::scale(&t(&[m, n]), &t(&[m, n]), 0.5), vec![mn]),
        (kernels::scale_in_place(&t(&[m, n]), 0.5), vec![mn]),
        (kernels::axpy(&t(&[m, n]), &t(&[m, n]), 0.5), vec![mn]),
        (kernels::sgd_step(&t(&[m, n]), &t(&[m, n]), 0.1), vec![mn]),
        (kernels::relu(&t(&[m, n]), &t(&[m, n])), vec![mn]),
        (
            kernels::relu_backward(&t(&[m, n]), &t(&[m, n]), &t(&[m, n])),
            vec![mn],
        ),
        (
            kernels::mul(&t(&[m, n]), &t(&[m, n]), &t(&[m, n])),
            vec![mn],
        ),
        (kernels::add_row_bias(&t(&[m, n]), &t(&[n])), vec![mn]),
        (kernels::sum_rows(&t(&[n]), &t(&[m, n])), vec![n as u64]),
        (
            kernels::softmax_xent(&t(&[1]), &t(&[m, n]), &t(&[m, n]), &t(&[m, n]), 0.25),
            vec![if mn == 0 { 0 } else { m as u64 }, m as u64],
        ),
        (
            kernels::matmul(&t(&[m, n]), &t(&[m, k]), &t(&[k, n])),
            vec![mn],
        ),
        (
            kernels::matmul_tn(&t(&[m, n]), &t(&[k, m]), &t(&[k, n])),
            vec![mn],
        ),
        (
            kernels::matmul_nt(&t(&[m, n]), &t(&[m, k]), &t(&[n, k])),
            vec![mn],
        ),
    ];
    // Only the built-ins that support `dtype` (the constructors refuse the others, and
    // only for their dtype).
    out.into_iter()
        .filter_map(|(spec, items)| match spec {
            Ok(spec) => Some((spec, items)),
            Err(crate::Error::DTypeMismatch { .. }) => None,
            Err(e) => panic!("{dtype} {m}x{k}x{n}: {e}"),
        })
        .map(|(spec, items)| {
            // Launches over no items are dropped, except the loss of softmax_xent, which
            // always writes the loss.
            let softmax = matches!(spec.kernel, Kernel::Builtin(Builtin::SoftmaxXent { .. }));
            let last = items.len() - 1;
            let items = items
                .into_iter()
                .enumerate()
                .filter(|&(i, x)| x > 0 || (softmax && i == last))
                .map(|(_, x)| x)
                .collect();
            (spec, items)
        })
        .collect()
}

/// Simulates the loop of `launch`: every item is visited exactly once. Threads stride by
/// the grid's thread count over 1-D blocks' items, blocks by the grid's block count over
/// 2-D blocks' items (tiles).
fn covers_each_item_once(launch: &Launch) -> bool {
    let stride = if launch.block[1] > 1 {
        u64::from(launch.grid[0])
    } else {
        u64::from(launch.grid[0]) * u64::from(launch.block[0])
    };
    let mut seen = vec![0u8; launch.items as usize];
    for t in 0..stride {
        let mut i = t;
        while i < launch.items {
            seen[i as usize] += 1;
            i += stride;
        }
    }
    seen.iter().all(|&c| c == 1)
}

/// The output tiles of a tiled matmul launch of `b`.
fn tiles(b: &Builtin) -> u64 {
    let tile = u64::from(source::TILE);
    match *b {
        Builtin::Matmul { m, n, .. }
        | Builtin::MatmulTn { m, n, .. }
        | Builtin::MatmulNt { m, n, .. } => (m as u64).div_ceil(tile) * (n as u64).div_ceil(tile),
        _ => panic!("{} is not tiled", b.name()),
    }
}

fn check_launch(launch: &Launch, dtype: DType, args: usize, merge: bool, limits: &LaunchLimits) {
    let what = &launch.entry_point;
    assert_eq!(launch.program, Program::Builtins(dtype), "{what}");
    let source = launch.program.cuda_c().unwrap();
    let sig = signature(&source, &launch.entry_point);
    let types: Vec<&str> = launch.params.iter().map(LaunchParam::c_type).collect();
    assert_eq!(types, sig, "{what}: parameters against the C signature");
    for p in &launch.params {
        match p {
            LaunchParam::Buffer(i) => assert!(*i < args, "{what}: argument {i} of {args}"),
            LaunchParam::Merge => assert!(merge, "{what}: merge without a merge buffer"),
            _ => {}
        }
    }
    for axis in 0..3 {
        assert!(launch.grid[axis] >= 1 && launch.grid[axis] <= limits.max_grid[axis]);
        assert!(launch.block[axis] >= 1 && launch.block[axis] <= limits.max_block[axis]);
    }
    let threads: u32 = launch.block.iter().product();
    assert!(
        threads <= limits.max_threads_per_block,
        "{what}: {threads} threads"
    );
    assert!(launch.grid[0] <= limits.multiprocessor_count * BLOCKS_PER_MULTIPROCESSOR);
    assert_eq!(launch.shared_mem_bytes, 0);
    assert!(covers_each_item_once(launch), "{what}: coverage");
}

#[test]
fn every_builtin_launches_what_its_signature_takes_and_covers_its_items() {
    let mut checked = 0;
    for limits in [BIG, TINY, TWO_BLOCKS, LaunchLimits::MINIMUM] {
        for dtype in DType::ALL {
            for (m, k, n) in [(3, 5, 7), (1, 1, 1), (0, 4, 3), (2, 0, 3), (40, 3, 33)] {
                for (spec, items) in cases(dtype, m, k, n) {
                    let Kernel::Builtin(b) = &spec.kernel else {
                        unreachable!()
                    };
                    let (args, merge) = bindings(&spec);
                    let launches =
                        kernel_launches(&spec.kernel, &args, merge.as_ref(), &NONE, &limits)
                            .unwrap_or_else(|e| panic!("{} {dtype} {m}x{k}x{n}: {e}", spec.name));
                    let got: Vec<u64> = launches.iter().map(|l| l.items).collect();
                    // Tiled matmuls cover tiles, the others what `cases` says.
                    let items: Vec<u64> = match launches.first() {
                        Some(l) if l.block[1] > 1 => vec![tiles(b)],
                        _ => items,
                    };
                    assert_eq!(got, items, "{} {dtype} {m}x{k}x{n}: items", b.name());
                    for l in &launches {
                        assert!(l.entry_point.ends_with(&format!("_{}", dtype.name())));
                        check_launch(l, dtype, args.len(), merge.is_some(), &limits);
                    }
                    checked += 1;
                }
            }
        }
    }
    // Per shape and limits: 3 built-ins for u8, 5 for i32 (add_merge and add_into too),
    // all 18 for each float.
    assert_eq!(checked, 4 * 5 * (3 + 5 + 18 * 4));
}

#[test]
fn every_entry_point_of_the_source_is_used_by_some_builtin() {
    for dtype in DType::ALL {
        let source = Program::Builtins(dtype).cuda_c().unwrap().into_owned();
        let defined: std::collections::BTreeSet<String> = source
            .split("extern \"C\" __global__ void ")
            .skip(1)
            .map(|s| s.split('(').next().unwrap().to_string())
            .collect();
        let mut used = std::collections::BTreeSet::new();
        for limits in [BIG, TINY] {
            for (spec, _) in cases(dtype, 2, 3, 4) {
                let (args, merge) = bindings(&spec);
                for l in
                    kernel_launches(&spec.kernel, &args, merge.as_ref(), &NONE, &limits).unwrap()
                {
                    used.insert(l.entry_point);
                }
            }
        }
        assert_eq!(used, defined, "{dtype}");
        // Deterministic text per key, so the runtime may cache by key.
        assert_eq!(Program::Builtins(dtype).cuda_c().unwrap(), source);
    }
}

#[test]
fn huge_tensors_get_capped_grids_and_64_bit_counts() {
    let n = 1usize << 40;
    let dst = binding(0, DType::F32, &[n], Access::ReadWrite);
    let src = binding(1, DType::F32, &[n], Access::Read);
    let l = builtin_launches(&Builtin::AddInto, &[dst, src], None, &BIG).unwrap();
    assert_eq!(l.len(), 1);
    assert_eq!(l[0].grid, [132 * BLOCKS_PER_MULTIPROCESSOR, 1, 1]);
    assert_eq!(l[0].block, [source::ELEMENTWISE_BLOCK, 1, 1]);
    assert_eq!(l[0].params[2], LaunchParam::U64(n as u64));
    let l = builtin_launches(
        &Builtin::Fill { value: 0.0 },
        &[binding(0, DType::U8, &[n], Access::Write)],
        None,
        &TINY,
    )
    .unwrap();
    assert_eq!((l[0].grid, l[0].block), ([3, 1, 1], [32, 1, 1]));
}

#[test]
fn fill_values_are_converted_as_on_the_cpu() {
    let fill = |dtype: DType, value: f64| {
        let dst = binding(0, dtype, &[4], Access::Write);
        let l = builtin_launches(&Builtin::Fill { value }, &[dst], None, &BIG).unwrap();
        l[0].params[2]
    };
    assert_eq!(fill(DType::F16, 1.0), LaunchParam::U32(0x3c00));
    assert_eq!(fill(DType::BF16, -2.0), LaunchParam::U32(0xc000));
    assert_eq!(fill(DType::F32, 0.1), LaunchParam::U32(0.1f32.to_bits()));
    assert_eq!(fill(DType::F64, 0.1), LaunchParam::U64(0.1f64.to_bits()));
    assert_eq!(fill(DType::I32, f64::NAN), LaunchParam::U32(0));
    assert_eq!(fill(DType::I32, -1.0), LaunchParam::U32(u32::MAX));
    assert_eq!(fill(DType::U8, 300.0), LaunchParam::U32(255));
    // f64 fills with 8-byte bits, the others with 4-byte words.
    for dtype in DType::ALL {
        let sig = signature(
            &Program::Builtins(dtype).cuda_c().unwrap(),
            &format!("fill_{}", dtype.name()),
        );
        assert_eq!(sig[2], fill(dtype, 1.0).c_type());
    }
}

#[test]
fn scalars_are_in_the_computation_type() {
    let launch = |dtype: DType| {
        let y = binding(0, dtype, &[4], Access::ReadWrite);
        let x = binding(1, dtype, &[4], Access::Read);
        builtin_launches(&Builtin::Axpy { alpha: 0.1 }, &[y, x], None, &BIG).unwrap()[0]
            .params
            .clone()
    };
    assert_eq!(launch(DType::F64)[2], LaunchParam::F64(0.1));
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        assert_eq!(launch(dtype)[2], LaunchParam::F32(0.1f32));
    }
}

#[test]
fn add_merge_reads_the_merge_buffer() {
    let dst = binding(0, DType::I32, &[5], Access::ReadWrite);
    let merge = binding(1, DType::I32, &[5], Access::Read);
    let l = builtin_launches(
        &Builtin::AddMerge,
        std::slice::from_ref(&dst),
        Some(&merge),
        &BIG,
    )
    .unwrap();
    assert_eq!(
        l[0].params,
        vec![
            LaunchParam::Buffer(0),
            LaunchParam::Merge,
            LaunchParam::U64(5)
        ]
    );
    let err =
        builtin_launches(&Builtin::AddMerge, std::slice::from_ref(&dst), None, &BIG).unwrap_err();
    assert!(err.contains("merge"), "{err}");
    let short = binding(1, DType::I32, &[4], Access::Read);
    let err = builtin_launches(&Builtin::AddMerge, &[dst], Some(&short), &BIG).unwrap_err();
    assert!(err.contains("merge buffer has 4 elements"), "{err}");
}

#[test]
fn disagreeing_bindings_are_refused() {
    let f = |i, shape: &[usize], access| binding(i, DType::F32, shape, access);
    let (r, w, rw) = (Access::Read, Access::Write, Access::ReadWrite);
    let refuse = |b: Builtin, args: Vec<ArgBinding>, needle: &str| {
        let err = builtin_launches(&b, &args, None, &BIG).unwrap_err();
        assert!(err.contains(needle), "{}: {err}", b.name());
    };
    refuse(
        Builtin::Copy,
        vec![f(0, &[4], w)],
        "1 arguments given, 2 expected",
    );
    refuse(
        Builtin::Copy,
        vec![f(0, &[4], r), f(1, &[4], r)],
        "declared Read",
    );
    refuse(
        Builtin::Copy,
        vec![f(0, &[4], w), f(1, &[5], r)],
        "has 5 elements",
    );
    let i = binding(0, DType::I32, &[4], w);
    let j = binding(1, DType::I32, &[4], r);
    refuse(Builtin::Scale { alpha: 1.0 }, vec![i, j], "not supported");
    let mixed = binding(1, DType::F64, &[4], r);
    refuse(Builtin::Copy, vec![f(0, &[4], w), mixed], "holds f64");
    let mut bad_bytes = f(1, &[4], r);
    bad_bytes.bytes = 15;
    refuse(Builtin::Copy, vec![f(0, &[4], w), bad_bytes], "15 bytes");
    let range = Builtin::CopyRange {
        dst_offset: 2,
        src_offset: 0,
        len: 3,
    };
    refuse(range, vec![f(0, &[4], rw), f(1, &[4], r)], "range outside");
    let mm = Builtin::Matmul { m: 2, k: 3, n: 2 };
    refuse(
        mm,
        vec![f(0, &[2, 2], w), f(1, &[2, 2], r), f(2, &[3, 2], r)],
        "a has 4 elements, expected 6",
    );
}

#[test]
fn user_kernels_take_buffers_then_merge_then_scalars() {
    let k = CudaKernel::cuda_c(
        "extern \"C\" __global__ void k() {}",
        "k",
        [4, 2, 1],
        [32, 4, 1],
    )
    .with_scalars([CudaScalar::F32(0.5), CudaScalar::U64(7)])
    .with_shared_mem_bytes(256);
    let args = [
        binding(0, DType::F32, &[8], Access::ReadWrite),
        binding(1, DType::U8, &[3], Access::Read),
    ];
    let merge = binding(2, DType::F32, &[8], Access::Read);
    let kernel = Kernel::Cuda(k.clone());
    let l = kernel_launches(&kernel, &args, Some(&merge), &NONE, &BIG).unwrap();
    assert_eq!(l.len(), 1);
    let l = &l[0];
    assert_eq!(
        l.program,
        Program::UserCudaC("extern \"C\" __global__ void k() {}".into())
    );
    assert_eq!(l.program.nvrtc_options(), &[] as &[&str]);
    assert_eq!(
        (l.grid, l.block, l.shared_mem_bytes),
        ([4, 2, 1], [32, 4, 1], 256)
    );
    assert_eq!(
        l.params,
        vec![
            LaunchParam::Buffer(0),
            LaunchParam::Buffer(1),
            LaunchParam::Merge,
            LaunchParam::F32(0.5),
            LaunchParam::U64(7),
        ]
    );
    assert_eq!(l.items, 8 * 128);
    // Without a merge buffer, the scalars follow the buffers.
    let l = user_launches(&k, &args, None, &NONE, &BIG).unwrap();
    assert_eq!(l[0].params[2], LaunchParam::F32(0.5));
    // PTX is loaded as it is.
    let ptx = CudaKernel::ptx(".version 8.0", "k", [1, 1, 1], [1, 1, 1]);
    let l = user_launches(&ptx, &args, None, &NONE, &BIG).unwrap();
    assert_eq!(l[0].program.ptx(), Some(".version 8.0"));
    assert!(l[0].program.cuda_c().is_none());
    // An empty grid launches nothing.
    let empty = CudaKernel::cuda_c("", "k", [0, 1, 1], [32, 1, 1]);
    assert!(user_launches(&empty, &args, None, &NONE, &BIG)
        .unwrap()
        .is_empty());
}

#[test]
fn index_values_follow_the_scalars_in_declaration_order() {
    let k = CudaKernel::cuda_c("", "k", [1, 1, 1], [32, 1, 1]).with_scalars([CudaScalar::F32(0.5)]);
    let args = [binding(0, DType::F32, &[8], Access::Write)];
    let spec = RoutineSpec::cuda(
        "k",
        vec![(TensorNode::new("y", DType::F32, [8]), Access::Write)],
        None,
        k.clone(),
    )
    .unwrap()
    .with_index("t")
    .unwrap()
    .with_index_typed("o", kernels::IndexType::I32)
    .unwrap()
    .with_index_typed("w", kernels::IndexType::I64)
    .unwrap();
    let b = spec
        .bindings()
        .with("w", -(1 << 40))
        .unwrap()
        .with("o", -3)
        .unwrap()
        .with("t", 4_000_000_000)
        .unwrap();
    let l = user_launches(&k, &args, None, &b, &BIG).unwrap();
    assert_eq!(
        l[0].params,
        vec![
            LaunchParam::Buffer(0),
            LaunchParam::F32(0.5),
            LaunchParam::U32(4_000_000_000),
            LaunchParam::I32(-3),
            LaunchParam::I64(-(1 << 40)),
        ]
    );
    // Incomplete bindings (made by hand) fail the plan instead of launching garbage.
    let err = user_launches(&k, &args, None, &spec.bindings(), &BIG).unwrap_err();
    assert!(err.contains("index t has no value"), "{err}");
    // Built-ins ignore them.
    let fill = kernels::fill(&TensorNode::new("y", DType::F32, [8]), 1.0).unwrap();
    let a = kernel_launches(&fill.kernel, &args, None, &b, &BIG).unwrap();
    let n = kernel_launches(&fill.kernel, &args, None, &NONE, &BIG).unwrap();
    assert_eq!(a, n);
}

#[test]
fn user_kernels_beyond_the_limits_are_refused() {
    let args = [binding(0, DType::F32, &[8], Access::ReadWrite)];
    let refuse = |k: CudaKernel, needle: &str| {
        let err = user_launches(&k, &args, None, &NONE, &TINY).unwrap_err();
        assert!(err.contains(needle), "{err}");
    };
    let k = |grid, block| CudaKernel::cuda_c("src", "k", grid, block);
    refuse(
        k([4, 1, 1], [1, 1, 1]),
        "4 blocks along x, the device allows 3",
    );
    refuse(k([1, 1, 1], [1, 1, 9]), "9 threads per block along z");
    refuse(
        k([1, 1, 1], [40, 2, 1]),
        "80 threads per block, the device allows 48",
    );
    refuse(
        k([1, 1, 1], [1, 1, 1]).with_shared_mem_bytes(2048),
        "2048 bytes of dynamic shared memory",
    );
    refuse(CudaKernel::cuda_c("a\0b", "k", [1; 3], [1; 3]), "NUL");
    refuse(CudaKernel::cuda_c("src", "", [1; 3], [1; 3]), "entry point");
}

#[test]
fn closures_and_shaders_are_not_cuda_kernels() {
    let a = TensorNode::new("a", DType::F32, [2]);
    let cpu = RoutineSpec::custom("c", vec![(a.clone(), Access::Write)], None, |_| Ok(())).unwrap();
    let shader = RoutineSpec::shader(
        "s",
        vec![(a, Access::Write)],
        None,
        ShaderKernel::wgsl("", [1, 1, 1]),
    )
    .unwrap();
    for spec in [cpu, shader] {
        let why = unsupported_on_cuda(&spec.kernel).unwrap();
        let (args, _) = bindings(&spec);
        assert_eq!(
            kernel_launches(&spec.kernel, &args, None, &NONE, &BIG).unwrap_err(),
            why
        );
    }
    assert!(unsupported_on_cuda(&Kernel::Builtin(Builtin::Copy)).is_none());
}

#[test]
fn block_sizes_are_chosen_per_kernel() {
    let f = |i, shape: &[usize], access| binding(i, DType::F32, shape, access);
    let (r, w) = (Access::Read, Access::Write);
    let launch = |b: &Builtin, args: &[ArgBinding], limits: &LaunchLimits| {
        builtin_launches(b, args, None, limits).unwrap()
    };
    let block = |b: Builtin, args: Vec<ArgBinding>| -> Vec<u32> {
        launch(&b, &args, &BIG).iter().map(|l| l.block[0]).collect()
    };
    // Matmuls: 16 x 16 tiles where a block holds one, else a thread per output.
    let mm = Builtin::Matmul { m: 40, k: 8, n: 33 };
    let mm_args = vec![f(0, &[40, 33], w), f(1, &[40, 8], r), f(2, &[8, 33], r)];
    let tiled = launch(&mm, &mm_args, &BIG);
    assert_eq!(tiled[0].entry_point, "matmul_tiled_f32");
    assert_eq!(tiled[0].block, [source::TILE, source::TILE, 1]);
    assert_eq!((tiled[0].items, tiled[0].grid[0]), (3 * 3, 9));
    let capped = launch(&mm, &mm_args, &TWO_BLOCKS);
    assert_eq!((capped[0].items, capped[0].grid[0]), (9, 2));
    let simple = launch(&mm, &mm_args, &TINY);
    assert_eq!(simple[0].entry_point, "matmul_f32");
    assert_eq!((simple[0].block, simple[0].items), ([32, 1, 1], 40 * 33));
    let no_tile = LaunchLimits {
        max_threads_per_block: 255,
        ..LaunchLimits::MINIMUM
    };
    assert_eq!(
        launch(&mm, &mm_args, &no_tile)[0].block,
        [source::MATMUL_BLOCK, 1, 1]
    );
    let sum = Builtin::SumRows { m: 100, n: 1000 };
    assert_eq!(
        block(sum, vec![f(0, &[1000], w), f(1, &[100, 1000], r)]),
        vec![source::ROWS_BLOCK]
    );
    let sx = Builtin::SoftmaxXent {
        m: 8,
        c: 10,
        grad_scale: 1.0,
    };
    let sx_args = vec![
        f(0, &[1], w),
        f(1, &[8, 10], w),
        f(2, &[8, 10], r),
        f(3, &[8, 10], r),
    ];
    assert_eq!(
        block(sx, sx_args),
        vec![source::ROWS_BLOCK, source::LOSS_BLOCK]
    );
    assert_eq!(
        block(Builtin::Relu, vec![f(0, &[4096], w), f(1, &[4096], r)]),
        vec![source::ELEMENTWISE_BLOCK]
    );
}
