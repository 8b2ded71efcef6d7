//! Opt-in timing of a forward's parts, for benchmarks: while a profile is active on this thread, each part
//! synchronises its device before and after and adds its wall time to the part's total. Off by default, and
//! then free: no synchronisation, one thread-local read per part.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use candle_core::Device;

/// The parts of a decoder layer that are timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// MLA attention, the indexer included (see [`Profile::attention_without_indexer`]).
    Attention,
    /// The DSA lightning indexer.
    Indexer,
    /// The mixture of experts (router, routed and shared experts).
    Moe,
    /// The dense MLP of the leading dense layers.
    DenseMlp,
}

/// Wall time per part, summed over the layers and forwards run while it was active.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Profile {
    pub attention: Duration,
    pub indexer: Duration,
    pub moe: Duration,
    pub dense_mlp: Duration,
}

impl Profile {
    pub fn attention_without_indexer(&self) -> Duration {
        self.attention.saturating_sub(self.indexer)
    }

    /// The parts' total.
    pub fn layers(&self) -> Duration {
        self.attention + self.moe + self.dense_mlp
    }
}

thread_local! {
    static ACTIVE: RefCell<Option<Profile>> = const { RefCell::new(None) };
}

/// Starts (or restarts) a profile on this thread.
pub fn start() {
    ACTIVE.with(|p| *p.borrow_mut() = Some(Profile::default()));
}

/// Ends this thread's profile and returns it (`None` if none was started).
pub fn finish() -> Option<Profile> {
    ACTIVE.with(|p| p.borrow_mut().take())
}

/// Whether a profile is active on this thread (its parts synchronise, which a CUDA graph cannot capture).
pub(crate) fn is_active() -> bool {
    ACTIVE.with(|p| p.borrow().is_some())
}

/// Runs `f` as `part` on `device`, timed when a profile is active.
pub(crate) fn time<T, E: From<candle_core::Error>>(
    part: Part,
    device: &Device,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    if !is_active() {
        return f();
    }
    device.synchronize()?;
    let start = Instant::now();
    let out = f()?;
    device.synchronize()?;
    let elapsed = start.elapsed();
    ACTIVE.with(|p| {
        if let Some(profile) = p.borrow_mut().as_mut() {
            *match part {
                Part::Attention => &mut profile.attention,
                Part::Indexer => &mut profile.indexer,
                Part::Moe => &mut profile.moe,
                Part::DenseMlp => &mut profile.dense_mlp,
            } += elapsed;
        }
    });
    Ok(out)
}
