//! Pools and staging buffers: `VkBuffer`s with their own gpu-allocator allocations, and the
//! host side of transfers. A transfer is direct where the memory is mapped and coherent, and
//! staged otherwise.

use std::{ptr::NonNull, sync::Arc};

use ash::vk;
use gpu_allocator::{
    vulkan::{Allocation, AllocationCreateDesc, AllocationScheme},
    MemoryLocation,
};

use super::{
    conv::{map_alloc_err, map_oom_and_lost},
    instance::{lock, LogicalDevice},
};
use crate::error::DeviceError;

/// A pointer to mapped, host-coherent memory.
#[derive(Clone, Copy)]
struct HostPtr(NonNull<u8>);

/// SAFETY: the pointer is the persistent mapping of device memory owned by a [`Buffer`];
/// moving the address to another thread is harmless, and every access through it is
/// ordered by the protocol's events (see the `unsafe` blocks that use it).
unsafe impl Send for HostPtr {}
/// SAFETY: as for `Send`: shared references only expose the address.
unsafe impl Sync for HostPtr {}

/// A `VkBuffer` bound to its own allocation.
pub(super) struct Buffer {
    core: Arc<LogicalDevice>,
    buffer: vk::Buffer,
    allocation: std::sync::Mutex<Option<Allocation>>,
    /// Size of the buffer in bytes (the requested size rounded up to 16).
    size: u64,
    /// The mapping, when the memory is host-visible and coherent (and we may use it).
    host: Option<HostPtr>,
}

impl Buffer {
    /// A pool: device memory (`GpuOnly`), usable directly by the host where the driver's
    /// device memory is host-visible and coherent, unless `no_host_access`.
    pub(super) fn pool(
        core: &Arc<LogicalDevice>,
        bytes: u64,
        no_host_access: bool,
    ) -> Result<Buffer, DeviceError> {
        let b = Buffer::new(core, bytes, MemoryLocation::GpuOnly, "tributary pool", true)?;
        Ok(if no_host_access { b.without_host() } else { b })
    }

    /// Device memory for a kernel's temporary values (not host-accessible).
    pub(super) fn scratch(core: &Arc<LogicalDevice>, bytes: u64) -> Result<Buffer, DeviceError> {
        Ok(Buffer::new(
            core,
            bytes,
            MemoryLocation::GpuOnly,
            "tributary scratch",
            false,
        )?
        .without_host())
    }

    /// A staging buffer in host-visible memory.
    pub(super) fn staging(core: &Arc<LogicalDevice>, bytes: u64) -> Result<Buffer, DeviceError> {
        let b = Buffer::new(
            core,
            bytes,
            MemoryLocation::CpuToGpu,
            "tributary staging",
            false,
        )?;
        if b.host.is_none() {
            return Err(DeviceError::Unexpected(
                "staging memory is not host-visible and coherent".into(),
            ));
        }
        Ok(b)
    }

    fn without_host(mut self) -> Buffer {
        self.host = None;
        self
    }

    fn new(
        core: &Arc<LogicalDevice>,
        bytes: u64,
        location: MemoryLocation,
        name: &str,
        dedicated: bool,
    ) -> Result<Buffer, DeviceError> {
        let size = bytes
            .max(16)
            .checked_next_multiple_of(16)
            .ok_or(DeviceError::OutOfMemory { requested: bytes })?;
        let d = &core.device;
        let info = vk::BufferCreateInfo::default()
            .size(size)
            .usage(
                vk::BufferUsageFlags::STORAGE_BUFFER
                    | vk::BufferUsageFlags::TRANSFER_SRC
                    | vk::BufferUsageFlags::TRANSFER_DST,
            )
            .sharing_mode(vk::SharingMode::EXCLUSIVE);
        // SAFETY: valid device and create info.
        let buffer = unsafe { d.create_buffer(&info, None) }
            .map_err(|r| map_oom_and_lost("vkCreateBuffer", size, r))?;
        // SAFETY: `buffer` was just created on this device.
        let requirements = unsafe { d.get_buffer_memory_requirements(buffer) };
        let allocated = core.with_allocator(|a| {
            a.allocate(&AllocationCreateDesc {
                name,
                requirements,
                location,
                linear: true,
                allocation_scheme: if dedicated {
                    AllocationScheme::DedicatedBuffer(buffer)
                } else {
                    AllocationScheme::GpuAllocatorManaged
                },
            })
            .map_err(|e| map_alloc_err(size, e))
        });
        let allocation = match allocated {
            Ok(a) => a,
            Err(e) => {
                // SAFETY: the buffer is unused and unbound.
                unsafe { d.destroy_buffer(buffer, None) };
                return Err(e);
            }
        };
        // SAFETY: the allocation satisfies the buffer's requirements (gpu-allocator
        // allocated it from them) and is not bound to anything else.
        let bound =
            unsafe { d.bind_buffer_memory(buffer, allocation.memory(), allocation.offset()) };
        if let Err(r) = bound {
            let _ = core.with_allocator(|a| a.free(allocation).map_err(|e| map_alloc_err(0, e)));
            // SAFETY: the buffer is unused.
            unsafe { d.destroy_buffer(buffer, None) };
            return Err(map_oom_and_lost("vkBindBufferMemory", size, r));
        }
        let coherent = allocation.memory_properties().contains(
            vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT,
        );
        let host = allocation
            .mapped_ptr()
            .filter(|_| coherent && allocation.size() >= size)
            .map(|p| HostPtr(p.cast::<u8>()));
        Ok(Buffer {
            core: core.clone(),
            buffer,
            allocation: std::sync::Mutex::new(Some(allocation)),
            size,
            host,
        })
    }

    /// The buffer handle.
    pub(super) fn handle(&self) -> vk::Buffer {
        self.buffer
    }

    /// Its size in bytes.
    pub(super) fn size(&self) -> u64 {
        self.size
    }

    /// The device it lives on.
    pub(super) fn core(&self) -> &Arc<LogicalDevice> {
        &self.core
    }

    /// The mapped address of byte `offset` (`None` unless host-accessible and in range).
    fn host_ptr(&self, offset: u64, bytes: u64) -> Option<*mut u8> {
        let host = self.host?;
        let end = offset.checked_add(bytes)?;
        if end > self.size {
            return None;
        }
        // SAFETY: `offset + bytes <= size` and the mapping covers `size` bytes (checked at
        // creation), so the result stays inside the mapping.
        Some(unsafe { host.0.as_ptr().add(offset as usize) })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: a `Buffer` is only dropped when no recorded work refers to it any more:
        // in-flight work holds an `Arc` to it until its completion is observed, and leaks
        // that `Arc` (`LogicalDevice::leak`) when it cannot observe it. So the buffer can be
        // destroyed; then its memory is returned to the allocator.
        unsafe { self.core.device.destroy_buffer(self.buffer, None) };
        if let Some(a) = lock(&self.allocation).take() {
            let _ = self
                .core
                .with_allocator(|al| al.free(a).map_err(|e| map_alloc_err(0, e)));
        }
    }
}

/// A byte range of a buffer.
#[derive(Clone)]
pub(super) struct Region {
    pub(super) buffer: Arc<Buffer>,
    pub(super) offset: u64,
    pub(super) bytes: u64,
}

impl Region {
    /// A checked range of `buffer`.
    pub(super) fn new(buffer: Arc<Buffer>, offset: u64, bytes: u64) -> Result<Region, String> {
        match offset.checked_add(bytes) {
            Some(end) if end <= buffer.size() => Ok(Region {
                buffer,
                offset,
                bytes,
            }),
            _ => Err(format!(
                "range {offset}+{bytes} outside a buffer of {} bytes",
                buffer.size()
            )),
        }
    }

    /// Copies `self` into `out`, which must be exactly as long (a size mismatch is a bug,
    /// reported as [`DeviceError::Unexpected`] naming both sizes, never a truncation), on
    /// the host.
    ///
    /// The caller guarantees that every writer of the region has completed (its event
    /// observed, which makes its writes visible to the host) and that nobody writes it
    /// during the call.
    pub(super) fn read_to_host(&self, out: &mut [u8]) -> Result<(), DeviceError> {
        let n = same_size(self.bytes, out.len() as u64)?;
        if let Some(p) = self.buffer.host_ptr(self.offset, n) {
            // SAFETY: `p` points to `n` mapped, coherent bytes (checked by `host_ptr`);
            // `out` is a distinct host allocation; the caller excludes concurrent writers.
            unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), n as usize) };
            return Ok(());
        }
        let core = self.buffer.core().clone();
        let staging = Arc::new(Buffer::staging(&core, n)?);
        let (src, dst, off) = (self.buffer.handle(), staging.handle(), self.offset);
        core.run_sync(
            |cb| {
                let region = [vk::BufferCopy {
                    src_offset: off,
                    dst_offset: 0,
                    size: n,
                }];
                // SAFETY: `cb` is recording; both buffers are live until the copy is
                // observed complete (`run_sync` holds them, and leaks them if it cannot
                // observe that); the ranges are in bounds (region checked at creation,
                // staging sized `n`).
                unsafe { core.device.cmd_copy_buffer(cb, src, dst, &region) };
            },
            (staging.clone(), self.buffer.clone()),
        )?;
        staging
            .host_ptr(0, n)
            .map(|p| {
                // SAFETY: the copy completed (fenced) and its writes were made visible to
                // the host by the barrier `run_sync` appends; `p` covers `n` bytes.
                unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), n as usize) }
            })
            .ok_or_else(|| DeviceError::Unexpected("staging buffer not mapped".into()))
    }

    /// Copies `data` into `self`, which must be exactly as long (see
    /// [`read_to_host`](Self::read_to_host)), on the host (direct or staged).
    ///
    /// The caller guarantees that every other use of the region has completed and that
    /// nobody uses it during the call.
    pub(super) fn write_from_host(&self, data: &[u8]) -> Result<(), DeviceError> {
        let n = same_size(data.len() as u64, self.bytes)?;
        if let Some(p) = self.buffer.host_ptr(self.offset, n) {
            // SAFETY: `p` points to `n` mapped, coherent bytes; `data` is a distinct host
            // allocation; the caller excludes every concurrent use of the region. The next
            // queue submission makes these writes visible to the device.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, n as usize) };
            return Ok(());
        }
        let core = self.buffer.core().clone();
        let staging = Arc::new(Buffer::staging(&core, n)?);
        let p = staging
            .host_ptr(0, n)
            .ok_or_else(|| DeviceError::Unexpected("staging buffer not mapped".into()))?;
        // SAFETY: `p` covers `n` bytes of the staging buffer, which nobody else uses.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, n as usize) };
        let (src, dst, off) = (staging.handle(), self.buffer.handle(), self.offset);
        core.run_sync(
            |cb| {
                let region = [vk::BufferCopy {
                    src_offset: 0,
                    dst_offset: off,
                    size: n,
                }];
                // SAFETY: `cb` is recording; both buffers are live until the copy is
                // observed complete (held, or leaked, by `run_sync`); ranges in bounds.
                unsafe { core.device.cmd_copy_buffer(cb, src, dst, &region) };
            },
            (staging.clone(), self.buffer.clone()),
        )
    }

    /// Copies `bytes` from `self` to `dst` through the host, for regions on different
    /// devices: one `memcpy` when both are mapped, otherwise staged legs through `host`, a
    /// buffer the caller keeps between calls (so its pages are touched once, not per copy).
    /// Both regions must be `bytes` long (a mismatch is an error, not a truncation).
    ///
    /// The caller guarantees what [`read_to_host`](Self::read_to_host) and
    /// [`write_from_host`](Self::write_from_host) require.
    pub(super) fn copy_across(
        &self,
        dst: &Region,
        bytes: u64,
        host: &mut Vec<u8>,
    ) -> Result<(), DeviceError> {
        same_size(self.bytes, bytes)?;
        let n = same_size(bytes, dst.bytes)?;
        let direct = (
            self.buffer.host_ptr(self.offset, n),
            dst.buffer.host_ptr(dst.offset, n),
        );
        match direct {
            (Some(s), Some(d)) => {
                // SAFETY: both pointers cover `n` mapped bytes; distinct devices have
                // distinct allocations, so the ranges do not overlap (`copy` tolerates it
                // anyway); the caller excludes concurrent writers of both.
                unsafe { std::ptr::copy(s, d, n as usize) };
                Ok(())
            }
            (Some(s), None) => {
                // SAFETY: `s` covers `n` mapped bytes that nobody writes during the call.
                let src = unsafe { std::slice::from_raw_parts(s, n as usize) };
                dst.write_from_host(src)
            }
            (None, Some(d)) => {
                // SAFETY: `d` covers `n` mapped bytes that nobody uses during the call.
                let out = unsafe { std::slice::from_raw_parts_mut(d, n as usize) };
                self.read_to_host(out)
            }
            (None, None) => {
                if host.len() < n as usize {
                    host.resize(n as usize, 0);
                }
                let tmp = &mut host[..n as usize];
                self.read_to_host(tmp)?;
                dst.write_from_host(tmp)
            }
        }
    }

    /// Whether the region lives on the device `core`.
    pub(super) fn on_device(&self, core: &Arc<LogicalDevice>) -> bool {
        Arc::ptr_eq(self.buffer.core(), core)
    }
}

/// `src`, if it equals `dst`: the two sides of a copy must have the same size, and a
/// mismatch that reaches a copy is a bug to report, never a reason to copy less.
pub(super) fn same_size(src: u64, dst: u64) -> Result<u64, DeviceError> {
    if src == dst {
        Ok(src)
    } else {
        Err(DeviceError::Unexpected(format!(
            "size mismatch: copy from {src} bytes into {dst} bytes (not truncated)"
        )))
    }
}
