//! The fixed tree that sums sixteen f32 lanes: the last step of every
//! exact reduction in this crate (the matrix products of [`crate::matmul`]
//! and [`crate::int8`], RMSNorm's sum of squares), so that a result does
//! not depend on the path that computed its lanes.

/// `s8[l] = a[l] + a[l + 8]`, `s4[l] = s8[l] + s8[l + 4]`, `s2[l] = s4[l] +
/// s4[l + 2]`, result `s2[0] + s2[1]`.
#[inline(always)]
pub fn reduce16(a: &[f32; 16]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
    let s4: [f32; 4] = std::array::from_fn(|l| s8[l] + s8[l + 4]);
    let s2: [f32; 2] = std::array::from_fn(|l| s4[l] + s4[l + 2]);
    s2[0] + s2[1]
}
