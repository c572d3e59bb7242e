//! Memory that every request writes, kept apart per thread.
//!
//! On a runtime of several workers, a cache line that two cores both write moves from one to
//! the other on every write, and each move costs about as much as a hundred instructions. A
//! counter every request bumps, or an `Arc` every request clones, is such a line. What the
//! layer counts or samples per request is therefore written in the stripe of the thread that
//! runs the request, and summed over the stripes when read.

use std::{
    ops::Deref,
    sync::atomic::{AtomicUsize, Ordering::Relaxed},
};

/// How many stripes a striped value has: threads past that share them.
pub(crate) const STRIPES: usize = 8;

/// `T` alone on its cache lines: 128 bytes, as CPUs that fetch lines in adjacent pairs see them
/// (crossbeam's `CachePadded` picks the same size for x86-64 and aarch64).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> Deref for Padded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

/// The stripe of the calling thread: threads take the stripes in turn as they first ask, so
/// that a runtime's workers (up to [`STRIPES`] of them) each write their own.
pub(crate) fn mine() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: usize = NEXT.fetch_add(1, Relaxed) % STRIPES;
    }
    MINE.with(|mine| *mine)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_keeps_its_stripe_and_new_threads_take_others() {
        let here = mine();
        assert_eq!(mine(), here);
        let theirs: Vec<usize> = (0..STRIPES)
            .map(|_| std::thread::spawn(mine).join().unwrap())
            .collect();
        assert!(theirs.iter().all(|&stripe| stripe < STRIPES));
        // Taken in turn (other tests' threads may take some in between): not all the same.
        assert!(
            theirs.iter().any(|&stripe| stripe != theirs[0]),
            "{theirs:?}"
        );
    }

    #[test]
    fn a_padded_value_starts_a_line_of_its_own() {
        assert_eq!(std::mem::align_of::<Padded<u8>>(), 128);
        assert_eq!(std::mem::size_of::<[Padded<u64>; 2]>(), 256);
    }
}
