//! A hint to the CPU to start loading memory that will be read soon.

/// Starts loading the cache lines of `value` into the nearest cache, so that
/// several misses overlap instead of each stalling its reader in turn. A hint
/// only: it changes no result, and does nothing on other architectures.
#[inline]
pub(crate) fn prefetch<T: ?Sized>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let start = (value as *const T).cast::<i8>();
        for offset in (0..std::mem::size_of_val(value)).step_by(64) {
            // SAFETY: a prefetch never faults and makes no value visible; the
            // address lies inside `value`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(offset)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}
