// Work cannot be constructed with fields (its variants are non-exhaustive).
use tributary::{
    protocol::{GlobalLoc, Work},
    BufferLoc, DeviceId, PoolId,
};

fn main() {
    let loc = GlobalLoc { device: DeviceId(0), loc: BufferLoc { pool: PoolId(0), offset: 0 } };
    let _copy = Work::Copy { src: loc, dst: loc, bytes: 4 };
}
