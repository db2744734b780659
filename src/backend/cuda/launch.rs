//! A kernel launch as the stream issues it: the launch description of `kernels.rs` with
//! each buffer resolved to its device pointer and each value stored at its C size.

use cudarc::driver::sys;

use super::{
    device::Gpu,
    kernels::{kernel_launches, LaunchParam, Program},
    memory::Region,
};
use crate::{backend::gpu_stream::Arg, kernels::Kernel, protocol::ArgBinding};

/// One parameter of a launch, by value, buffers resolved to device pointers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum KernelParam {
    /// A device pointer (`base + offset` of a resolved buffer).
    Pointer(sys::CUdeviceptr),
    /// `unsigned int`.
    U32(u32),
    /// `unsigned long long`.
    U64(u64),
    /// `int`.
    I32(i32),
    /// `long long`.
    I64(i64),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
}

/// A kernel launch with its buffers resolved: a [`Launch`] of the kernels module whose
/// `Buffer(i)` parameters became argument `i`'s device pointer (`Merge`: the merge
/// buffer's).
#[derive(Clone, Debug)]
pub(super) struct DeviceLaunch {
    pub(super) program: Program,
    pub(super) entry_point: String,
    pub(super) grid: [u32; 3],
    pub(super) block: [u32; 3],
    pub(super) shared_mem_bytes: u32,
    pub(super) params: Vec<KernelParam>,
}

/// The launches that run `kernel` over its resolved arguments: the kernels module computes
/// them from the bindings and the device's limits (and checks arity, accesses, dtypes and
/// sizes), the stream resolves their buffers.
pub(super) fn lower(
    kernel: &Kernel,
    args: &[Arg<Region>],
    merge: Option<&Arg<Region>>,
    indices: &crate::kernels::Bindings,
    gpu: &Gpu,
) -> std::result::Result<Vec<DeviceLaunch>, String> {
    let bindings: Vec<ArgBinding> = args.iter().map(|a| a.binding.clone()).collect();
    let launches = kernel_launches(
        kernel,
        &bindings,
        merge.map(|m| &m.binding),
        indices,
        &gpu.limits.launch_limits(),
    )?;
    launches
        .into_iter()
        .map(|l| {
            let params = resolve_params(
                &l.params,
                |i| args.get(i).map(|a| a.region.ptr()),
                merge.map(|m| m.region.ptr()),
            )?;
            Ok(DeviceLaunch {
                program: l.program,
                entry_point: l.entry_point,
                grid: l.grid,
                block: l.block,
                shared_mem_bytes: l.shared_mem_bytes,
                params,
            })
        })
        .collect()
}

/// A launch's parameters with `Buffer(i)` as `arg(i)`'s device pointer and `Merge` as the
/// merge buffer's; an error when one names a buffer that is not bound.
pub(super) fn resolve_params(
    params: &[LaunchParam],
    arg: impl Fn(usize) -> Option<sys::CUdeviceptr>,
    merge: Option<sys::CUdeviceptr>,
) -> std::result::Result<Vec<KernelParam>, String> {
    params
        .iter()
        .map(|p| {
            Ok(match *p {
                LaunchParam::Buffer(i) => {
                    KernelParam::Pointer(arg(i).ok_or_else(|| {
                        format!("a launch parameter names argument {i}, not bound")
                    })?)
                }
                LaunchParam::Merge => KernelParam::Pointer(
                    merge.ok_or("a launch parameter names the merge buffer, not bound")?,
                ),
                LaunchParam::U32(x) => KernelParam::U32(x),
                LaunchParam::U64(x) => KernelParam::U64(x),
                LaunchParam::I32(x) => KernelParam::I32(x),
                LaunchParam::I64(x) => KernelParam::I64(x),
                LaunchParam::F32(x) => KernelParam::F32(x),
                LaunchParam::F64(x) => KernelParam::F64(x),
            })
        })
        .collect()
}

/// Storage for one parameter, whose address `cuLaunchKernel` reads.
pub(super) enum ParamCell {
    U32(u32),
    U64(u64),
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
}

impl ParamCell {
    pub(super) fn of(p: KernelParam) -> ParamCell {
        match p {
            KernelParam::Pointer(ptr) => ParamCell::U64(ptr),
            KernelParam::U32(x) => ParamCell::U32(x),
            KernelParam::U64(x) => ParamCell::U64(x),
            KernelParam::I32(x) => ParamCell::I32(x),
            KernelParam::I64(x) => ParamCell::I64(x),
            KernelParam::F32(x) => ParamCell::F32(x),
            KernelParam::F64(x) => ParamCell::F64(x),
        }
    }

    pub(super) fn address(&mut self) -> *mut std::ffi::c_void {
        match self {
            ParamCell::U32(x) => (x as *mut u32).cast(),
            ParamCell::U64(x) => (x as *mut u64).cast(),
            ParamCell::I32(x) => (x as *mut i32).cast(),
            ParamCell::I64(x) => (x as *mut i64).cast(),
            ParamCell::F32(x) => (x as *mut f32).cast(),
            ParamCell::F64(x) => (x as *mut f64).cast(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_parameters_are_stored_at_their_c_size() {
        // cuLaunchKernel reads each parameter from its address at the size of the entry
        // point's parameter type: the bytes there must be the value's own, in native order.
        let read = |p: KernelParam, size: usize| -> Vec<u8> {
            let mut cell = ParamCell::of(p);
            let at = cell.address().cast::<u8>();
            // SAFETY: `at` points at the cell's value, at least `size` bytes (checked by
            // the expectations below, each the size of the stored type).
            unsafe { std::slice::from_raw_parts(at, size) }.to_vec()
        };
        assert_eq!(
            read(KernelParam::Pointer(0x1234_5678_9abc), 8),
            0x1234_5678_9abcu64.to_ne_bytes()
        );
        assert_eq!(read(KernelParam::U32(7), 4), 7u32.to_ne_bytes());
        assert_eq!(
            read(KernelParam::U64(u64::MAX - 1), 8),
            (u64::MAX - 1).to_ne_bytes()
        );
        assert_eq!(read(KernelParam::I32(-3), 4), (-3i32).to_ne_bytes());
        assert_eq!(read(KernelParam::I64(-5), 8), (-5i64).to_ne_bytes());
        assert_eq!(read(KernelParam::F32(1.5), 4), 1.5f32.to_ne_bytes());
        assert_eq!(read(KernelParam::F64(-2.25), 8), (-2.25f64).to_ne_bytes());
    }

    #[test]
    fn launch_buffers_resolve_to_their_pointers() {
        let ptrs = [0x1000u64, 0x2000];
        let arg = |i: usize| ptrs.get(i).copied();
        let params = [
            LaunchParam::Buffer(1),
            LaunchParam::Merge,
            LaunchParam::Buffer(0),
            LaunchParam::U64(9),
            LaunchParam::F32(0.5),
        ];
        assert_eq!(
            resolve_params(&params, arg, Some(0x3000)),
            Ok(vec![
                KernelParam::Pointer(0x2000),
                KernelParam::Pointer(0x3000),
                KernelParam::Pointer(0x1000),
                KernelParam::U64(9),
                KernelParam::F32(0.5),
            ])
        );
        let missing = resolve_params(&[LaunchParam::Buffer(2)], arg, None).expect_err("unbound");
        assert!(missing.contains("argument 2"), "{missing}");
        let no_merge = resolve_params(&params, arg, None).expect_err("no merge buffer");
        assert!(no_merge.contains("merge"), "{no_merge}");
    }
}
