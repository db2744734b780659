// A kernel binding cannot be constructed with fields (they are private).
use tributary::{
    kernels::Access,
    protocol::{ArgBinding, GlobalLoc},
    BufferLoc, DType, DeviceId, PoolId,
};

fn main() {
    let loc = GlobalLoc { device: DeviceId(0), loc: BufferLoc { pool: PoolId(0), offset: 0 } };
    let _arg = ArgBinding { loc, bytes: 4, dtype: DType::F32, shape: [1].into(), access: Access::Write };
}
