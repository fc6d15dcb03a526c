//! A hint to the CPU to start loading memory that will be read soon.

/// Starts loading the cache lines of `value` into the nearest cache, so that
/// several misses overlap instead of each stalling its reader in turn. A hint
/// only: it changes no result, and does nothing on other architectures.
#[inline]
pub(crate) fn prefetch<T: ?Sized>(value: &T) {
    prefetch_into(value, false)
}

/// [`prefetch`] into the core's second-level cache: a miss then waits there,
/// not in one of the first level's few fill buffers, so more of them overlap
/// (for lines read a little later, from the second level).
#[inline]
pub(crate) fn prefetch_l2<T: ?Sized>(value: &T) {
    prefetch_into(value, true)
}

#[inline(always)]
fn prefetch_into<T: ?Sized>(value: &T, l2: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let start = (value as *const T).cast::<i8>();
        for offset in (0..std::mem::size_of_val(value)).step_by(64) {
            let line = start.wrapping_add(offset);
            // SAFETY: a prefetch never faults and makes no value visible; the
            // address lies inside `value`.
            unsafe {
                if l2 {
                    _mm_prefetch::<_MM_HINT_T1>(line)
                } else {
                    _mm_prefetch::<_MM_HINT_T0>(line)
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (value, l2);
}
