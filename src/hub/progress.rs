//! One progress bar per downloaded file, on stderr; a finished file leaves one line, so hundreds of
//! shards do not pile up bars.

use indicatif::{HumanBytes, MultiProgress, ProgressBar, ProgressStyle};
use std::sync::OnceLock;

/// The bar of one file, created on first use.
pub(super) struct Tracker {
    file: String,
    bars: Option<MultiProgress>,
    bar: OnceLock<ProgressBar>,
}

impl Tracker {
    pub(super) fn new(file: &str, bars: Option<MultiProgress>) -> Self {
        Self {
            file: file.to_string(),
            bars,
            bar: OnceLock::new(),
        }
    }

    /// The bar for a transfer of `total` bytes; `None` when progress is off.
    pub(super) fn bar(&self, total: u64) -> Option<&ProgressBar> {
        let bars = self.bars.as_ref()?;
        Some(self.bar.get_or_init(|| {
            let style = ProgressStyle::with_template(
                "{msg:32!} [{bar:30}] {bytes:>10}/{total_bytes:<10} {binary_bytes_per_sec:>12} {eta:>4}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            let bar = bars.add(ProgressBar::new(total).with_style(style));
            bar.set_message(self.file.clone());
            bar
        }))
    }

    /// The transfer failed: the bar stays where it stopped.
    pub(super) fn abandon(&self) {
        if let Some(bar) = self.bar.get().filter(|b| !b.is_finished()) {
            bar.abandon();
        }
    }

    /// The transfer of `bytes` finished: the bar becomes one line (`note` appended, e.g. where it resumed).
    pub(super) fn done(&self, bytes: u64, note: Option<&str>) {
        if let (Some(bar), Some(bars)) = (self.bar.get(), &self.bars) {
            bar.finish_and_clear();
            let _ = bars.println(format!(
                "{} ({}{})",
                self.file,
                HumanBytes(bytes),
                note.unwrap_or_default()
            ));
        }
    }
}
