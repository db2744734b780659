// The host table's use records and catch-up stamps cannot be changed from outside: only
// the checked `commit_write` / `read_bytes` touch a host array.
use tributary::{protocol::HostTable, DType, TensorNode};

fn main() {
    let node = TensorNode::new("x", DType::F32, [4]);
    let mut table = HostTable::default();
    let record = table.record(&node).unwrap();
    record.uses.clear_all();
    record.version += 1;
    record.host_caught_up(None, 7);
}
