//! Server metrics in Prometheus' text format (`GET /metrics`).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// A histogram over fixed bucket bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistogramState>,
}

#[derive(Default)]
struct HistogramState {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            inner: Mutex::new(HistogramState {
                counts: vec![0; bounds.len()],
                ..Default::default()
            }),
        }
    }

    /// Records one observation.
    pub fn observe(&self, seconds: f64) {
        let mut state = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for (bound, count) in self.bounds.iter().zip(state.counts.iter_mut()) {
            if seconds <= *bound {
                *count += 1;
            }
        }
        state.sum += seconds;
        state.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let state = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, count) in self.bounds.iter().zip(&state.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", state.count);
        let _ = writeln!(out, "{name}_sum {}", state.sum);
        let _ = writeln!(out, "{name}_count {}", state.count);
    }
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Counters and gauges shared by the HTTP side and the engine.
pub struct Metrics {
    /// Finished requests by outcome: `[ok, client error, server error / refused]`.
    requests: [AtomicU64; 3],
    /// Prompt tokens admitted.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub generation_tokens: AtomicU64,
    /// Sequences stopped because their client went away.
    pub cancelled: AtomicU64,
    /// Sequences waiting for admission.
    pub waiting: AtomicUsize,
    /// Sequences running.
    pub running: AtomicUsize,
    /// KV blocks held by running sequences.
    pub kv_blocks_in_use: AtomicUsize,
    /// KV rows written by running sequences.
    pub kv_tokens_used: AtomicUsize,
    /// KV blocks kept from finished sequences for prefix reuse.
    pub kv_blocks_cached: AtomicUsize,
    /// Blocks of the KV pool.
    pub kv_blocks_total: usize,
    /// Tokens per KV block.
    pub kv_block_tokens: usize,
    /// Running sequences whose blocks were freed to make room (to be recomputed).
    pub preemptions: AtomicU64,
    /// Steps by how they ran (decode graphs unless `--enforce-eager`): `[replayed, captured, eager]`.
    graph_steps: [AtomicU64; 3],
    /// Engine step durations.
    pub step_seconds: Histogram,
    /// Of a step, picking its sequences' next tokens on the host after the device's work: the logits' read-back
    /// and the sampling rules (a flat distribution's top-p sorts most of the vocabulary).
    pub sample_seconds: Histogram,
    /// Time from a request's arrival to its first token.
    pub ttft_seconds: Histogram,
    /// Whole request durations.
    pub request_seconds: Histogram,
}

impl Metrics {
    /// Zeroed metrics for a server whose KV pool has `kv_blocks_total` blocks of `kv_block_tokens` tokens.
    pub fn new(kv_blocks_total: usize, kv_block_tokens: usize) -> Self {
        Self {
            requests: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            kv_blocks_in_use: AtomicUsize::new(0),
            kv_tokens_used: AtomicUsize::new(0),
            kv_blocks_cached: AtomicUsize::new(0),
            kv_blocks_total,
            kv_block_tokens,
            preemptions: AtomicU64::new(0),
            graph_steps: Default::default(),
            step_seconds: Histogram::new(LATENCY_BUCKETS),
            sample_seconds: Histogram::new(LATENCY_BUCKETS),
            ttft_seconds: Histogram::new(LATENCY_BUCKETS),
            request_seconds: Histogram::new(LATENCY_BUCKETS),
        }
    }

    /// Records an engine step.
    pub fn observe_step(&self, step: Duration) {
        self.step_seconds.observe(step.as_secs_f64());
    }

    /// Records the decode graphs' counts so far.
    pub fn observe_graphs(&self, stats: &crate::GraphStats) {
        for (slot, count) in
            self.graph_steps
                .iter()
                .zip([stats.replayed, stats.captured, stats.eager])
        {
            slot.store(count as u64, Ordering::Relaxed);
        }
    }

    /// Counts a finished request by its HTTP status.
    pub fn count_request(&self, status: u16) {
        let slot = match status {
            200..=399 => 0,
            400..=499 if status != 429 => 1,
            _ => 2,
        };
        self.requests[slot].fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP glm5_requests_total Finished HTTP requests by outcome.\n# TYPE glm5_requests_total counter"
        );
        for (outcome, count) in ["success", "client_error", "server_error_or_refused"]
            .iter()
            .zip(&self.requests)
        {
            let _ = writeln!(
                out,
                "glm5_requests_total{{outcome=\"{outcome}\"}} {}",
                load(count)
            );
        }
        let _ = writeln!(
            out,
            "# HELP glm5_engine_steps_by_path_total Engine steps by how they ran (decode graphs unless --enforce-eager): replayed from a decode graph, captured, or eager.\n# TYPE glm5_engine_steps_by_path_total counter"
        );
        for (path, count) in ["graph_replay", "graph_capture", "eager"]
            .iter()
            .zip(&self.graph_steps)
        {
            let _ = writeln!(
                out,
                "glm5_engine_steps_by_path_total{{path=\"{path}\"}} {}",
                load(count)
            );
        }
        let counters = [
            (
                "glm5_prompt_tokens_total",
                "Prompt tokens admitted.",
                load(&self.prompt_tokens),
            ),
            (
                "glm5_generation_tokens_total",
                "Tokens generated.",
                load(&self.generation_tokens),
            ),
            (
                "glm5_sequences_cancelled_total",
                "Sequences stopped because their client disconnected.",
                load(&self.cancelled),
            ),
            (
                "glm5_preemptions_total",
                "Running sequences whose KV blocks were freed to make room, to be recomputed.",
                load(&self.preemptions),
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        }
        let get = |a: &AtomicUsize| a.load(Ordering::Relaxed);
        let gauges = [
            (
                "glm5_queue_length",
                "Sequences waiting for admission (preempted ones included).",
                get(&self.waiting),
            ),
            (
                "glm5_running_sequences",
                "Sequences being generated.",
                get(&self.running),
            ),
            (
                "glm5_kv_blocks_in_use",
                "KV blocks held by running sequences.",
                get(&self.kv_blocks_in_use),
            ),
            (
                "glm5_kv_blocks_cached",
                "KV blocks kept from finished sequences for prefix reuse.",
                get(&self.kv_blocks_cached),
            ),
            (
                "glm5_kv_blocks_total",
                "KV blocks of the pool.",
                self.kv_blocks_total,
            ),
            (
                "glm5_kv_block_tokens",
                "Tokens per KV block.",
                self.kv_block_tokens,
            ),
            (
                "glm5_kv_tokens_in_use",
                "KV rows written by running sequences.",
                get(&self.kv_tokens_used),
            ),
        ];
        for (name, help, value) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        }
        self.step_seconds.render(
            &mut out,
            "glm5_step_seconds",
            "Duration of one engine step.",
        );
        self.sample_seconds.render(
            &mut out,
            "glm5_sample_seconds",
            "Of an engine step, picking the sequences' next tokens on the host once the device's work is done.",
        );
        self.ttft_seconds.render(
            &mut out,
            "glm5_time_to_first_token_seconds",
            "From request arrival to its first generated token.",
        );
        self.request_seconds.render(
            &mut out,
            "glm5_request_seconds",
            "Duration of generation requests.",
        );
        out
    }
}
