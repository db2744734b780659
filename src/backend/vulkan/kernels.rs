//! Kernels on Vulkan: lowering a routine's kernel to dispatches or copies, compiling WGSL to
//! SPIR-V with naga once per process, and making compute pipelines once per device.

use std::{
    collections::HashMap,
    ffi::CString,
    sync::{Arc, Mutex},
};

use ash::vk;

use super::{
    instance::{lock, LogicalDevice},
    memory::Region,
    shaders::{self, Op, Ty},
};
use crate::{
    kernels::{Bindings, Builtin, IndexDecl, Kernel, ShaderKernel, ShaderSource},
    node::DType,
};

/// A kernel argument resolved to its buffer range.
pub(super) type Arg = crate::backend::gpu_stream::Arg<Region>;

/// A compiled module, or why it does not compile.
type Compiled = Result<Arc<[u32]>, String>;

/// SPIR-V modules compiled from WGSL, shared by every device of a backend.
#[derive(Default)]
pub(super) struct SpirvCache {
    map: Mutex<HashMap<String, Compiled>>,
}

impl SpirvCache {
    /// The SPIR-V of `key`, compiling `source()` on first use (errors are cached too).
    fn get(
        &self,
        key: &str,
        float64: bool,
        source: impl FnOnce() -> String,
    ) -> Result<Arc<[u32]>, String> {
        if let Some(r) = lock(&self.map).get(key) {
            return r.clone();
        }
        // Compile outside the lock (naga takes milliseconds); a racing compile of the same
        // key produces the same words.
        let src = source();
        let result = compile_wgsl(&src, float64).map(Arc::from);
        lock(&self.map)
            .entry(key.to_string())
            .or_insert(result)
            .clone()
    }
}

/// Compiles WGSL to SPIR-V 1.3 with naga (`IMMEDIATES` for push constants, `FLOAT64` when
/// the device has `shaderFloat64`).
pub(super) fn compile_wgsl(src: &str, float64: bool) -> Result<Vec<u32>, String> {
    use naga::valid::{Capabilities, ValidationFlags, Validator};
    let module = naga::front::wgsl::parse_str(src)
        .map_err(|e| format!("WGSL does not parse: {}", e.emit_to_string(src)))?;
    let mut caps = Capabilities::IMMEDIATES;
    if float64 {
        caps |= Capabilities::FLOAT64;
    }
    let info = Validator::new(ValidationFlags::all(), caps)
        .validate(&module)
        .map_err(|e| format!("WGSL does not validate: {}", e.emit_to_string(src)))?;
    let options = naga::back::spv::Options {
        lang_version: (1, 3),
        // Our loops are bounded by their counts; the injected counters cost time per
        // iteration for nothing.
        force_loop_bounding: false,
        ..Default::default()
    };
    naga::back::spv::write_vec(&module, &info, &options, None)
        .map_err(|e| format!("SPIR-V generation failed: {e}"))
}

/// The push-constant size of a shader with `immediates` bytes of immediates and indices
/// `decls`: each index at the next multiple of its size after the immediates (where a
/// further WGSL struct member would be), the whole rounded up to 4 bytes.
pub(super) fn push_constant_size(immediates: usize, decls: &[IndexDecl]) -> usize {
    decls
        .iter()
        .fold(immediates, |end, d| {
            let size = d.ty().size_in_bytes();
            end.next_multiple_of(size) + size
        })
        .next_multiple_of(4)
}

/// The push constants of a shader: its immediates, then the values of its indices laid
/// out as [`push_constant_size`] says (little-endian, zero padding).
pub(super) fn push_constants(immediates: &[u8], bindings: &Bindings) -> Vec<u8> {
    let mut push = immediates.to_vec();
    for (d, v) in bindings.iter() {
        let size = d.ty().size_in_bytes();
        // Little-endian, so the low `size` bytes of the `i64` are the value in its type
        // (which it fits: the protocol checked it).
        let bytes = v.unwrap_or(0).to_le_bytes();
        push.resize(push.len().next_multiple_of(size), 0);
        push.extend_from_slice(&bytes[..size]);
    }
    push.resize(push.len().next_multiple_of(4), 0);
    push
}

/// A compute pipeline with its own layout: `bindings` storage buffers (push descriptors)
/// and `push_size` bytes of push constants.
pub(super) struct Pipeline {
    core: Arc<LogicalDevice>,
    set_layout: vk::DescriptorSetLayout,
    layout: vk::PipelineLayout,
    pipeline: vk::Pipeline,
    push_size: u32,
}

impl Pipeline {
    fn new(
        core: &Arc<LogicalDevice>,
        spirv: &[u32],
        entry: &str,
        bindings: u32,
        push_size: u32,
    ) -> Result<Pipeline, String> {
        let d = &core.device;
        let entry = CString::new(entry).map_err(|_| "entry point name contains NUL")?;
        let binding_info: Vec<_> = (0..bindings)
            .map(|b| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(b)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        let set_info = vk::DescriptorSetLayoutCreateInfo::default()
            .flags(vk::DescriptorSetLayoutCreateFlags::PUSH_DESCRIPTOR_KHR)
            .bindings(&binding_info);
        // SAFETY: valid device; `binding_info` outlives the call.
        let set_layout = unsafe { d.create_descriptor_set_layout(&set_info, None) }
            .map_err(|r| format!("vkCreateDescriptorSetLayout: {r}"))?;
        let mut p = Pipeline {
            core: core.clone(),
            set_layout,
            layout: vk::PipelineLayout::null(),
            pipeline: vk::Pipeline::null(),
            push_size,
        };
        // From here on, `Drop for Pipeline` destroys what was created if we return early.
        let ranges = [vk::PushConstantRange::default()
            .stage_flags(vk::ShaderStageFlags::COMPUTE)
            .offset(0)
            .size(push_size)];
        let set_layouts = [set_layout];
        let mut layout_info = vk::PipelineLayoutCreateInfo::default().set_layouts(&set_layouts);
        if push_size > 0 {
            layout_info = layout_info.push_constant_ranges(&ranges);
        }
        // SAFETY: valid device and create info.
        p.layout = unsafe { d.create_pipeline_layout(&layout_info, None) }
            .map_err(|r| format!("vkCreatePipelineLayout: {r}"))?;
        let module_info = vk::ShaderModuleCreateInfo::default().code(spirv);
        // SAFETY: `spirv` is SPIR-V from naga (or the user's words, which the driver
        // validates as far as it does); the create info outlives the call.
        let module = unsafe { d.create_shader_module(&module_info, None) }
            .map_err(|r| format!("vkCreateShaderModule: {r}"))?;
        let stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(module)
            .name(&entry);
        let info = [vk::ComputePipelineCreateInfo::default()
            .stage(stage)
            .layout(p.layout)];
        // SAFETY: the module and layout are live; the create infos outlive the call.
        let created = unsafe { d.create_compute_pipelines(vk::PipelineCache::null(), &info, None) };
        // SAFETY: the module is no longer needed once the pipeline is created (or not).
        unsafe { d.destroy_shader_module(module, None) };
        let pipelines = created.map_err(|(_, r)| format!("vkCreateComputePipelines: {r}"))?;
        p.pipeline = pipelines
            .first()
            .copied()
            .ok_or("vkCreateComputePipelines returned no pipeline")?;
        Ok(p)
    }

    /// Records this pipeline's dispatch of `groups` over `bindings` with `push` bytes.
    ///
    /// # Safety
    ///
    /// `cb` is recording on this pipeline's device; the bound buffers outlive the execution
    /// of `cb` (the caller keeps them alive until its completion is observed).
    pub(super) unsafe fn record(
        &self,
        cb: vk::CommandBuffer,
        bindings: &[Region],
        push: &[u8],
        groups: [u32; 3],
    ) {
        let d = &self.core.device;
        let infos: Vec<[vk::DescriptorBufferInfo; 1]> = bindings
            .iter()
            .map(|r| {
                [vk::DescriptorBufferInfo {
                    buffer: r.buffer.handle(),
                    offset: r.offset,
                    range: r.bytes,
                }]
            })
            .collect();
        let writes: Vec<vk::WriteDescriptorSet> = infos
            .iter()
            .enumerate()
            .map(|(i, info)| {
                vk::WriteDescriptorSet::default()
                    .dst_binding(i as u32)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .buffer_info(info)
            })
            .collect();
        // SAFETY: per this function's contract; the layout matches (bindings counted at
        // lowering, push bytes sized to the layout's range).
        unsafe {
            d.cmd_bind_pipeline(cb, vk::PipelineBindPoint::COMPUTE, self.pipeline);
            if !writes.is_empty() {
                self.core.push_descriptor.cmd_push_descriptor_set(
                    cb,
                    vk::PipelineBindPoint::COMPUTE,
                    self.layout,
                    0,
                    &writes,
                );
            }
            if self.push_size > 0 {
                d.cmd_push_constants(cb, self.layout, vk::ShaderStageFlags::COMPUTE, 0, push);
            }
            d.cmd_dispatch(cb, groups[0], groups[1], groups[2]);
        }
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        let d = &self.core.device;
        // SAFETY: a pipeline is dropped only when no in-flight work holds it (work keeps an
        // `Arc<Pipeline>` until its completion is observed, and leaks it when it cannot
        // observe that: `LogicalDevice::leak`); null handles are ignored.
        unsafe {
            d.destroy_pipeline(self.pipeline, None);
            d.destroy_pipeline_layout(self.layout, None);
            d.destroy_descriptor_set_layout(self.set_layout, None);
        }
    }
}

/// The compute pipelines of one device, by key.
#[derive(Default)]
pub(super) struct PipelineCache {
    map: Mutex<HashMap<String, Arc<Pipeline>>>,
}

impl PipelineCache {
    fn get(
        &self,
        key: &str,
        make: impl FnOnce() -> Result<Pipeline, String>,
    ) -> Result<Arc<Pipeline>, String> {
        if let Some(p) = lock(&self.map).get(key) {
            return Ok(p.clone());
        }
        let p = Arc::new(make()?);
        Ok(lock(&self.map).entry(key.to_string()).or_insert(p).clone())
    }

    /// Drops every pipeline (device teardown).
    pub(super) fn clear(&self) {
        lock(&self.map).clear();
    }
}

/// One recorded dispatch.
pub(super) struct Dispatch {
    pub(super) pipeline: Arc<Pipeline>,
    pub(super) bindings: Vec<Region>,
    pub(super) push: Vec<u8>,
    pub(super) groups: [u32; 3],
}

/// What a kernel becomes on the command buffer.
pub(super) enum Lowered {
    /// Compute dispatches in one command buffer, in order, with a memory barrier between
    /// consecutive ones.
    Dispatches(Vec<Dispatch>),
    /// A buffer copy `(src, dst, bytes)`.
    Copy(Region, Region, u64),
    /// Nothing to do (no elements).
    Nothing,
}

/// What lowering needs from the device.
pub(super) struct Lowering<'a> {
    pub(super) core: &'a Arc<LogicalDevice>,
    pub(super) pipelines: &'a PipelineCache,
    pub(super) spirv: &'a SpirvCache,
}

/// The push-constant block of the built-ins: `n, m, k, c: u32`, then `a, b` as `f32` (24
/// bytes) or `f64` (32 bytes, 8-aligned).
fn push_block(ty: Ty, n: u64, m: u64, k: u64, c: u64, a: f64, b: f64) -> Result<Vec<u8>, String> {
    let word = |x: u64| -> Result<[u8; 4], String> {
        u32::try_from(x)
            .map(u32::to_le_bytes)
            .map_err(|_| format!("dimension {x} exceeds 2^32 - 1"))
    };
    let mut out = Vec::with_capacity(32);
    for x in [n, m, k, c] {
        out.extend_from_slice(&word(x)?);
    }
    if ty.wide_scalars() {
        out.extend_from_slice(&a.to_le_bytes());
        out.extend_from_slice(&b.to_le_bytes());
    } else {
        out.extend_from_slice(&(a as f32).to_le_bytes());
        out.extend_from_slice(&(b as f32).to_le_bytes());
    }
    Ok(out)
}

impl Lowering<'_> {
    /// Workgroups covering `items` grid-stride items in x.
    fn groups(&self, items: u64) -> [u32; 3] {
        let want = items.div_ceil(u64::from(shaders::WORKGROUP)).max(1);
        let max = u64::from(self.core.physical.limits.max_workgroups_x);
        [want.min(max) as u32, 1, 1]
    }

    /// Refuses a dispatch whose invocations would run more loop iterations than the driver
    /// allows (llvmpipe silently stops an invocation after 65535 iterations in all, which
    /// would leave results half computed): `items` grid-stride items over `groups`, each
    /// running `per_item` inner iterations.
    fn check_loops(&self, items: u64, groups: [u32; 3], per_item: u64) -> Result<(), String> {
        let Some(limit) = self.core.physical.limits.max_loop_iterations else {
            return Ok(());
        };
        let invocations = u64::from(groups[0]) * u64::from(shaders::WORKGROUP);
        let rounds = items.div_ceil(invocations.max(1));
        let total = rounds.saturating_mul(per_item.saturating_add(1));
        if total > limit {
            return Err(format!(
                "one invocation would run {total} loop iterations, more than the {limit} that \
                 {} runs before stopping it (the problem is too large for this driver)",
                self.core.physical.name
            ));
        }
        Ok(())
    }

    /// Checks a binding against the device's limits: offset alignment and range.
    fn check_binding(&self, r: &Region, what: &str) -> Result<(), String> {
        let limits = &self.core.physical.limits;
        if r.offset % limits.min_storage_offset_alignment != 0 {
            return Err(format!(
                "{what} is at offset {} of its pool, not a multiple of the device's \
                 minStorageBufferOffsetAlignment {} (raise PoolConfig::min_alignment)",
                r.offset, limits.min_storage_offset_alignment
            ));
        }
        if r.bytes > limits.max_storage_range {
            return Err(format!(
                "{what} has {} bytes, more than the device's maxStorageBufferRange {}",
                r.bytes, limits.max_storage_range
            ));
        }
        Ok(())
    }

    /// Binding ranges rounded up to whole words (storage arrays of `u32`), within the pool.
    fn bind(&self, r: &Region, what: &str) -> Result<Region, String> {
        self.check_binding(r, what)?;
        let range = r
            .bytes
            .max(4)
            .next_multiple_of(4)
            .min(r.buffer.size() - r.offset);
        Ok(Region {
            buffer: r.buffer.clone(),
            offset: r.offset,
            bytes: range,
        })
    }

    fn pipeline_builtin(&self, op: Op, ty: Ty) -> Result<Arc<Pipeline>, String> {
        if ty.needs_f64() && !self.core.physical.float64 {
            return Err(format!(
                "{} lacks shaderFloat64: f64 kernels cannot run on it",
                self.core.physical.name
            ));
        }
        let key = shaders::key(op, ty);
        let push = if ty.wide_scalars() { 32 } else { 24 };
        self.pipelines.get(&key, || {
            let spirv = self
                .spirv
                .get(&key, ty.needs_f64(), || shaders::source(op, ty))?;
            Pipeline::new(self.core, &spirv, "main", op.writes().len() as u32, push)
        })
    }

    /// Lowers `kernel` over resolved arguments (checked like the CPU backend checks its
    /// views), failing with a message for the plan's failure.
    pub(super) fn lower(
        &self,
        kernel: &Kernel,
        args: &[Arg],
        merge: Option<&Arg>,
        bindings: &Bindings,
    ) -> Result<Lowered, String> {
        match kernel {
            // Built-ins read no index (they declare none).
            Kernel::Builtin(b) => self
                .builtin(b, args, merge)
                .map_err(|e| format!("{}: {e}", b.name())),
            Kernel::Shader(s) => self.shader(s, args, merge, bindings),
            Kernel::Cpu(_) => Err(CPU_KERNEL_ON_VULKAN.to_string()),
            Kernel::Cuda(_) => Err(CUDA_KERNEL_ON_VULKAN.to_string()),
        }
    }

    fn shader(
        &self,
        s: &ShaderKernel,
        args: &[Arg],
        merge: Option<&Arg>,
        bindings: &Bindings,
    ) -> Result<Lowered, String> {
        let float64 = self.core.physical.float64;
        let (key, words) = match &s.source {
            ShaderSource::Wgsl(src) => {
                let key = format!("wgsl:{}:{src}", s.entry_point);
                let words = self.spirv.get(&key, float64, || src.to_string())?;
                (key, words)
            }
            ShaderSource::SpirV(words) => {
                let text: Vec<String> = words.iter().map(|w| format!("{w:x}")).collect();
                (
                    format!("spirv:{}:{}", s.entry_point, text.join(",")),
                    words.clone(),
                )
            }
        };
        let max_push = self.core.physical.limits.max_push_constants;
        let push = push_constants(&s.immediates, bindings);
        let push_size = push.len();
        if push_size > max_push as usize {
            return Err(format!(
                "{push_size} bytes of push constants ({} of immediates, then the indices), \
                 the device allows {max_push}",
                s.immediates.len()
            ));
        }
        let mut bindings = Vec::with_capacity(args.len() + 1);
        for (i, a) in args.iter().enumerate() {
            bindings.push(self.bind(&a.region, &format!("argument {i}"))?);
        }
        if let Some(m) = merge {
            bindings.push(self.bind(&m.region, "the merge buffer")?);
        }
        let n = bindings.len() as u32;
        let pipeline = self.pipelines.get(&format!("{key}#{n}#{push_size}"), || {
            Pipeline::new(self.core, &words, &s.entry_point, n, push_size as u32)
        })?;
        if s.workgroups.contains(&0) {
            return Ok(Lowered::Nothing);
        }
        Ok(Lowered::Dispatches(vec![Dispatch {
            pipeline,
            bindings,
            push,
            groups: s.workgroups,
        }]))
    }

    fn builtin(&self, b: &Builtin, args: &[Arg], merge: Option<&Arg>) -> Result<Lowered, String> {
        let accesses = b.accesses();
        if args.len() != accesses.len() {
            return Err(format!(
                "{} arguments given, {} expected",
                args.len(),
                accesses.len()
            ));
        }
        for (i, (a, &want)) in args.iter().zip(accesses).enumerate() {
            if a.binding.access != want {
                return Err(format!(
                    "argument {i} is declared {:?}, expected {want:?}",
                    a.binding.access
                ));
            }
        }
        if b.uses_merge() && merge.is_none() {
            return Err("no merge buffer given".into());
        }
        let dtype = args
            .first()
            .map(|a| a.binding.dtype)
            .ok_or("no arguments")?;
        if !b.dtypes().contains(&dtype) {
            return Err(format!("dtype {dtype} is not supported"));
        }
        // Element counts, checked against the bytes (as the CPU backend's views do).
        let mut lens = Vec::with_capacity(args.len());
        for (i, a) in args
            .iter()
            .chain(merge.filter(|_| b.uses_merge()))
            .enumerate()
        {
            if a.binding.dtype != dtype {
                return Err(format!(
                    "argument {i} holds {}, not {dtype}",
                    a.binding.dtype
                ));
            }
            let n = a
                .binding
                .shape
                .numel()
                .filter(|n| n.checked_mul(dtype.size_in_bytes()) == Some(a.binding.bytes as usize))
                .ok_or_else(|| {
                    format!(
                        "argument {i} has {} bytes for shape {} of {dtype}",
                        a.binding.bytes, a.binding.shape
                    )
                })?;
            lens.push(n as u64);
        }
        let len = |i: usize| lens.get(i).copied().unwrap_or(0);
        let expect = |what: &str, got: u64, want: u64| -> Result<(), String> {
            if got == want {
                Ok(())
            } else {
                Err(format!("{what} has {got} elements, expected {want}"))
            }
        };
        let prod = |a: usize, b: usize| -> Result<u64, String> {
            a.checked_mul(b)
                .map(|x| x as u64)
                .ok_or_else(|| format!("dimensions {a} x {b} overflow"))
        };
        let region = |i: usize| args.get(i).map(|a| &a.region).ok_or("missing argument");
        let bytes = |i: usize| {
            args.get(i)
                .map(|a| a.binding.bytes)
                .ok_or("missing argument")
        };
        match *b {
            Builtin::Fill { value } => self.fill(region(0)?, dtype, value),
            Builtin::Copy => {
                expect("the source (bytes)", bytes(1)?, bytes(0)?)?;
                self.copy(region(1)?, 0, region(0)?, 0, bytes(0)?)
            }
            Builtin::CopyMerge => {
                // A buffer copy (vkCmdCopyBuffer), bitwise like the CPU built-in.
                let m = merge.ok_or("no merge buffer given")?;
                expect("the merge buffer (bytes)", m.binding.bytes, bytes(0)?)?;
                self.copy(&m.region, 0, region(0)?, 0, bytes(0)?)
            }
            Builtin::CopyRange {
                dst_offset,
                src_offset,
                len: count,
            } => {
                let size = dtype.size_in_bytes() as u64;
                let range = |off: usize| -> Result<(u64, u64), String> {
                    let start = (off as u64).checked_mul(size).ok_or("offset overflows")?;
                    let bytes = (count as u64).checked_mul(size).ok_or("range overflows")?;
                    start
                        .checked_add(bytes)
                        .map(|end| (start, end))
                        .ok_or_else(|| "range overflows".to_string())
                };
                let ((ds, de), (ss, se)) = (range(dst_offset)?, range(src_offset)?);
                if de > bytes(0)? || se > bytes(1)? {
                    return Err("range outside the buffers".into());
                }
                self.copy(region(1)?, ss, region(0)?, ds, de - ds)
            }
            Builtin::AddInto | Builtin::AddMerge => {
                expect("the addend", len(1), len(0))?;
                let mut regs = vec![region(0)?.clone()];
                regs.push(match merge {
                    Some(m) if b.uses_merge() => m.region.clone(),
                    _ => region(1)?.clone(),
                });
                self.elementwise(Op::Add, dtype, &regs, len(0), [0, 0, 0], 0.0)
            }
            Builtin::Scale { alpha } => {
                expect("argument 1", len(1), len(0))?;
                self.elementwise(Op::Scale, dtype, &regions(args), len(0), [0; 3], alpha)
            }
            Builtin::ScaleInPlace { alpha } => self.elementwise(
                Op::ScaleInPlace,
                dtype,
                &regions(args),
                len(0),
                [0; 3],
                alpha,
            ),
            Builtin::Axpy { alpha } => {
                expect("argument 1", len(1), len(0))?;
                self.elementwise(Op::Axpy, dtype, &regions(args), len(0), [0; 3], alpha)
            }
            Builtin::SgdStep { lr } => {
                expect("argument 1", len(1), len(0))?;
                self.elementwise(Op::SgdStep, dtype, &regions(args), len(0), [0; 3], lr)
            }
            Builtin::Relu => {
                expect("argument 1", len(1), len(0))?;
                self.elementwise(Op::Relu, dtype, &regions(args), len(0), [0; 3], 0.0)
            }
            Builtin::ReluBackward | Builtin::Mul => {
                expect("argument 1", len(1), len(0))?;
                expect("argument 2", len(2), len(0))?;
                let op = if *b == Builtin::Mul {
                    Op::Mul
                } else {
                    Op::ReluBackward
                };
                self.elementwise(op, dtype, &regions(args), len(0), [0; 3], 0.0)
            }
            Builtin::Matmul { m, k, n }
            | Builtin::MatmulTn { m, k, n }
            | Builtin::MatmulNt { m, k, n } => {
                let (op, a_len, b_len) = match b {
                    Builtin::Matmul { .. } => (Op::Matmul, prod(m, k)?, prod(k, n)?),
                    Builtin::MatmulTn { .. } => (Op::MatmulTn, prod(k, m)?, prod(k, n)?),
                    _ => (Op::MatmulNt, prod(m, k)?, prod(n, k)?),
                };
                expect("c", len(0), prod(m, n)?)?;
                expect("a", len(1), a_len)?;
                expect("b", len(2), b_len)?;
                let dims = [m as u64, k as u64, n as u64];
                self.elementwise(op, dtype, &regions(args), len(0), dims, 0.0)
            }
            Builtin::AddRowBias { m, n } => {
                expect("dst", len(0), prod(m, n)?)?;
                expect("bias", len(1), n as u64)?;
                let dims = [m as u64, 0, n as u64];
                self.elementwise(Op::AddRowBias, dtype, &regions(args), len(0), dims, 0.0)
            }
            Builtin::SumRows { m, n } => {
                expect("dst", len(0), n as u64)?;
                expect("src", len(1), prod(m, n)?)?;
                let dims = [m as u64, 0, 0];
                self.elementwise(Op::SumRows, dtype, &regions(args), len(0), dims, 0.0)
            }
            Builtin::SoftmaxXent { m, c, grad_scale } => {
                let mc = prod(m, c)?;
                expect("loss", len(0), 1)?;
                expect("dlogits", len(1), mc)?;
                expect("logits", len(2), mc)?;
                expect("labels", len(3), mc)?;
                if m == 0 || c == 0 {
                    // No rows or no classes: the loss is 0 and dlogits is empty.
                    return self.fill(region(0)?, dtype, 0.0);
                }
                let ty = Ty::of(dtype).ok_or("unsupported dtype")?;
                let comp = if ty.wide_scalars() { 8 } else { 4 };
                let scratch = super::memory::Buffer::scratch(self.core, m as u64 * comp)
                    .map_err(|e| format!("scratch of {m} rows: {e}"))?;
                let scratch = Region::new(Arc::new(scratch), 0, m as u64 * comp)?;
                let mut regs = regions(args);
                regs.push(scratch);
                let dims = [m as u64, 0, c as u64];
                let mut out = Vec::new();
                // Rows, then their sum (after a barrier); the gradient is independent.
                for (op, count) in [
                    (Op::SoftmaxGrad, mc),
                    (Op::SoftmaxRows, m as u64),
                    (Op::SoftmaxLoss, 1),
                ] {
                    if let Lowered::Dispatches(mut d) =
                        self.elementwise(op, dtype, &regs, count, dims, grad_scale)?
                    {
                        out.append(&mut d);
                    }
                }
                Ok(Lowered::Dispatches(out))
            }
        }
    }

    /// A built-in shader over `count` output elements; `dims` are `(m, k, c)`.
    fn elementwise(
        &self,
        op: Op,
        dtype: DType,
        regions: &[Region],
        count: u64,
        dims: [u64; 3],
        scalar: f64,
    ) -> Result<Lowered, String> {
        let ty = Ty::of(dtype).ok_or_else(|| format!("dtype {dtype} is not supported"))?;
        let [m, k, c] = dims;
        // Loop iterations of one element's `body` (see `shaders::Op::body`).
        let inner = match op {
            Op::SumRows | Op::SoftmaxLoss => m,
            Op::Matmul | Op::MatmulTn | Op::MatmulNt => k,
            Op::SoftmaxGrad => 2 * c,
            Op::SoftmaxRows => 3 * c,
            _ => 0,
        };
        if regions.len() != op.writes().len() {
            return Err(format!(
                "{} buffers for a shader of {}",
                regions.len(),
                op.writes().len()
            ));
        }
        if count == 0 {
            return Ok(Lowered::Nothing);
        }
        let bindings = regions
            .iter()
            .enumerate()
            .map(|(i, r)| self.bind(r, &format!("argument {i}")))
            .collect::<Result<Vec<_>, _>>()?;
        let push = push_block(ty, count, m, k, c, scalar, 0.0)?;
        let pipeline = self.pipeline_builtin(op, ty)?;
        let items = shaders::items(ty, count);
        let groups = self.groups(items);
        let per_item = if ty.packed() { 2 * inner } else { inner };
        self.check_loops(items, groups, per_item)?;
        Ok(Lowered::Dispatches(vec![Dispatch {
            pipeline,
            bindings,
            push,
            groups,
        }]))
    }

    fn fill(&self, dst: &Region, dtype: DType, value: f64) -> Result<Lowered, String> {
        // The element's bytes, converted exactly as the CPU backend converts them.
        let pattern: u64 = match dtype {
            DType::F32 => u64::from((value as f32).to_bits()) * 0x1_0000_0001,
            DType::F64 => value.to_bits(),
            DType::F16 => {
                u64::from(crate::node::F16::from_f32(value as f32).to_bits())
                    * 0x0001_0001_0001_0001
            }
            DType::BF16 => {
                u64::from(crate::node::Bf16::from_f32(value as f32).to_bits())
                    * 0x0001_0001_0001_0001
            }
            DType::I32 => u64::from((value as i32) as u32) * 0x1_0000_0001,
            DType::U8 => u64::from(value as u8) * 0x0101_0101_0101_0101,
        };
        if dst.bytes == 0 {
            return Ok(Lowered::Nothing);
        }
        let binding = self.bind(dst, "argument 0")?;
        let push = push_block(
            Ty::F32,
            dst.bytes,
            0,
            pattern & 0xffff_ffff,
            pattern >> 32,
            0.0,
            0.0,
        )?;
        let pipeline = self.pipelines.get(shaders::FILL_KEY, || {
            let spirv = self
                .spirv
                .get(shaders::FILL_KEY, false, shaders::fill_source)?;
            Pipeline::new(self.core, &spirv, "main", 1, 24)
        })?;
        Ok(Lowered::Dispatches(vec![Dispatch {
            pipeline,
            bindings: vec![binding],
            push,
            groups: self.groups(dst.bytes.div_ceil(4)),
        }]))
    }

    fn copy(
        &self,
        src: &Region,
        src_off: u64,
        dst: &Region,
        dst_off: u64,
        bytes: u64,
    ) -> Result<Lowered, String> {
        if bytes == 0 {
            return Ok(Lowered::Nothing);
        }
        let sub = |r: &Region, off: u64| Region::new(r.buffer.clone(), r.offset + off, bytes);
        Ok(Lowered::Copy(sub(src, src_off)?, sub(dst, dst_off)?, bytes))
    }
}

fn regions(args: &[Arg]) -> Vec<Region> {
    args.iter().map(|a| a.region.clone()).collect()
}

/// Why a [`Kernel::Cpu`] cannot run here (the failure message of such a plan).
pub(super) const CPU_KERNEL_ON_VULKAN: &str =
    "Rust closure kernels (Kernel::Cpu) run on CPU devices only; a Vulkan device runs \
     built-ins and shader kernels (Kernel::Shader)";

/// Why a [`Kernel::Cuda`] cannot run here (the failure message of such a plan).
pub(super) const CUDA_KERNEL_ON_VULKAN: &str =
    "CUDA kernels (CUDA C or PTX) run on CUDA devices only; a Vulkan device runs built-ins \
     and shader kernels (Kernel::Shader)";

#[cfg(all(test, not(tributary_loom)))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::{
        kernels::{Access, IndexType, RoutineSpec},
        node::TensorNode,
    };

    /// Indices follow the immediates like further members of a WGSL struct: each at the
    /// next multiple of its size, the block rounded up to whole words.
    #[test]
    fn push_constants_place_indices_after_the_immediates() {
        let y = TensorNode::new("y", DType::F32, [4]);
        let spec = RoutineSpec::shader(
            "s",
            vec![(y, Access::Write)],
            None,
            ShaderKernel::wgsl("", [1, 1, 1]).with_immediates(vec![0xAA; 6]),
        )
        .unwrap()
        .with_index("t")
        .unwrap()
        .with_index_typed("w", IndexType::I64)
        .unwrap()
        .with_index_typed("o", IndexType::I32)
        .unwrap();
        // 6 immediates, t at 8..12, w at 16..24, o at 24..28.
        assert_eq!(push_constant_size(6, spec.indices()), 28);
        let b = spec
            .bindings()
            .with("t", 0x0102_0304)
            .unwrap()
            .with("w", -2)
            .unwrap()
            .with("o", -3)
            .unwrap();
        let push = push_constants(&[0xAA; 6], &b);
        assert_eq!(push.len(), 28);
        assert_eq!(&push[..6], &[0xAA; 6]);
        assert_eq!(&push[6..8], &[0, 0]);
        assert_eq!(&push[8..12], &0x0102_0304u32.to_le_bytes());
        assert_eq!(&push[12..16], &[0; 4]);
        assert_eq!(&push[16..24], &(-2i64).to_le_bytes());
        assert_eq!(&push[24..28], &(-3i32).to_le_bytes());
        // No indices: the immediates rounded up to words, as before.
        assert_eq!(push_constant_size(5, &[]), 8);
        assert_eq!(
            push_constants(&[1; 5], &Bindings::none()),
            vec![1, 1, 1, 1, 1, 0, 0, 0]
        );
    }
}
