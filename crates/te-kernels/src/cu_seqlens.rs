//! Validation of `cu_seqlens` offsets (`[b + 1]` i32, from 0,
//! non-decreasing), shared by every op that takes packed sequences.

use crate::error::KernelError;

/// Checks `cu_seqlens: [batch + 1]`, starting at 0 and non-decreasing.
pub(crate) fn check_cu_seqlens(
    op: &'static str,
    cu_seqlens: &[i32],
    batch: usize,
) -> Result<(), KernelError> {
    if cu_seqlens.len() != batch + 1 {
        return Err(KernelError::ShapeMismatch {
            op,
            arg: "cu_seqlens",
            expected: vec![batch + 1],
            got: vec![cu_seqlens.len()],
        });
    }
    if cu_seqlens[0] != 0 {
        return Err(KernelError::InvalidArgument {
            op,
            arg: "cu_seqlens",
            reason: format!("cu_seqlens[0] = {}, expected 0", cu_seqlens[0]),
        });
    }
    if let Some(b) = (0..batch).find(|&b| cu_seqlens[b + 1] < cu_seqlens[b]) {
        return Err(KernelError::InvalidArgument {
            op,
            arg: "cu_seqlens",
            reason: format!(
                "sequence {b} has negative length {}",
                cu_seqlens[b + 1] - cu_seqlens[b]
            ),
        });
    }
    Ok(())
}
