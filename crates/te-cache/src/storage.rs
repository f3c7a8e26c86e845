//! Typed cache storage whose dtype is chosen at run time.

use half::{bf16, f16};
use std::any::Any;
use te_kernels::{DType, Element};

/// One cache tensor (`[num_pages, page_size, h_kv, d]`) in its storage dtype.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Storage {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl Storage {
    /// `len` zeros of `dtype`.
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => Storage::F32(vec![0.0; len]),
            DType::F16 => Storage::F16(vec![f16::ZERO; len]),
            DType::BF16 => Storage::BF16(vec![bf16::ZERO; len]),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Storage::F32(v) => v.len(),
            Storage::F16(v) => v.len(),
            Storage::BF16(v) => v.len(),
        }
    }

    /// The elements as `&[T]`, or `None` when `T` is not the storage dtype.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        let any: &dyn Any = match self {
            Storage::F32(v) => v,
            Storage::F16(v) => v,
            Storage::BF16(v) => v,
        };
        any.downcast_ref::<Vec<T>>().map(Vec::as_slice)
    }

    /// The elements as `&mut [T]`, or `None` when `T` is not the storage dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Option<&mut [T]> {
        let any: &mut dyn Any = match self {
            Storage::F32(v) => v,
            Storage::F16(v) => v,
            Storage::BF16(v) => v,
        };
        any.downcast_mut::<Vec<T>>().map(Vec::as_mut_slice)
    }

    /// Copies `rows` rows of `row_len` elements from row `src` to row `dst`
    /// (ranges must not overlap).
    pub fn copy_rows(&mut self, src: usize, dst: usize, rows: usize, row_len: usize) {
        let range = src * row_len..(src + rows) * row_len;
        match self {
            Storage::F32(v) => v.copy_within(range, dst * row_len),
            Storage::F16(v) => v.copy_within(range, dst * row_len),
            Storage::BF16(v) => v.copy_within(range, dst * row_len),
        }
    }
}
