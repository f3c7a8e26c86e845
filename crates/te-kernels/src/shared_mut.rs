//! [`SharedMut`]: a raw pointer that parallel tasks share to write
//! disjoint elements of one buffer.

/// A raw pointer that rayon tasks may share; every user writes disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(pub *mut T);
unsafe impl<T: Send> Send for SharedMut<T> {}
unsafe impl<T: Send> Sync for SharedMut<T> {}
