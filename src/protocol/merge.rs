//! How a device-to-device copy delivers its node. The protocol plans each kind differently;
//! see DESIGN.md §2, "Merge buffer", and §3.

use super::Routine;

/// How a device-to-device operation delivers the node (DESIGN.md §2, "Merge buffer").
#[derive(Clone, Debug)]
pub enum MergeBufferUse {
    /// Copy into the node's own buffer in the destination context.
    No,
    /// Copy into the destination stream's merge buffer.
    Copy,
    /// No copy: schedule this routine (linked in the destination context, expecting the
    /// node as its merge input) reading the source buffer in place.
    StreamingFor(Routine),
}
