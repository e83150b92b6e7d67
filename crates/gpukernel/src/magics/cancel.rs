//! Interrupting a running magic from another thread.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Set by an interrupt (message or SIGINT); checked by magics between steps.
#[derive(Clone, Default)]
pub struct CancelToken {
    inner: Arc<(Mutex<bool>, Condvar)>,
}

impl CancelToken {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn cancel(&self) {
        let (flag, wake) = &*self.inner;
        *flag.lock().unwrap_or_else(PoisonError::into_inner) = true;
        wake.notify_all();
    }

    /// Polled by long work (`%maxbatch`) between steps.
    pub fn is_cancelled(&self) -> bool {
        *self.inner.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sleeps up to `duration`; returns `false` as soon as the token is cancelled.
    pub fn sleep(&self, duration: Duration) -> bool {
        let deadline = Instant::now() + duration;
        let (flag, wake) = &*self.inner;
        let mut cancelled = flag.lock().unwrap_or_else(PoisonError::into_inner);
        while !*cancelled {
            let now = Instant::now();
            if now >= deadline {
                return true;
            }
            cancelled = wake
                .wait_timeout(cancelled, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cancel_wakes_a_sleeper() {
        let token = CancelToken::new();
        let other = token.clone();
        let start = Instant::now();
        let sleeper = std::thread::spawn(move || other.sleep(Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(50));
        token.cancel();
        assert!(!sleeper.join().unwrap());
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(!token.sleep(Duration::ZERO));
    }

    #[test]
    fn uncancelled_sleep_runs_to_the_end() {
        assert!(CancelToken::new().sleep(Duration::from_millis(10)));
    }
}
