//! A seeded mutation fuzzer on stable Rust, std only: each target has seed inputs (valid files) and a
//! dictionary of hostile fragments; every iteration mutates a seed and runs the target on it.
//!
//! What every target must hold for every input:
//! - no panic (each run is under `catch_unwind`; a panic fails with the input, saved to a file);
//! - no hang: each run takes less than [`Target::max_seconds`];
//! - no unbounded allocation: the fuzz binary's global allocator ([`Limited`]) refuses any single allocation
//!   above [`ALLOCATION_LIMIT`] and reports the input before the process aborts on it; the peak of live
//!   bytes per input is checked against [`PEAK_LIMIT`];
//! - errors are typed and say something: a target returns `Result<(), String>` from the crate's typed error's
//!   `Display`, which must be one non-empty line.
//!
//! Iterations: each target's `ci_iterations` by default (the bounded run of `cargo test`), or
//! `GLM5_FUZZ_ITERS` (the long run, optionally cut off after `GLM5_FUZZ_SECONDS`); the seed of the random generator is `GLM5_FUZZ_SEED` (default fixed,
//! so a CI failure reproduces). `GLM5_FUZZ_TIME_SCALE` multiplies every target's time limit, for a long
//! run at low priority on a busy machine, where an input's wall time says little about its work.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

/// The largest single allocation a target may make while it runs.
pub const ALLOCATION_LIMIT: usize = 1 << 30;
/// The most bytes a target may hold at once while it runs (beyond what it held before).
pub const PEAK_LIMIT: usize = 2 << 30;

/// The code under test: an input in, `Err` with the typed error's message.
pub type Run = dyn Fn(&[u8]) -> Result<(), String>;

/// One fuzz target: seeds to mutate, fragments to splice in, and the code under test.
pub struct Target {
    pub name: &'static str,
    pub seeds: Vec<Vec<u8>>,
    /// Hostile fragments: numbers at and past limits, path tricks, syntax of the format.
    pub dictionary: Vec<Vec<u8>>,
    /// Runs the code under test; `Err` carries the typed error's message.
    pub run: Box<Run>,
    /// Iterations of the bounded run inside `cargo test`.
    pub ci_iterations: u64,
    /// The longest one input may take.
    pub max_seconds: f64,
}

/// What a run of a target found.
#[derive(Debug, Default)]
pub struct Report {
    pub iterations: u64,
    pub ok: u64,
    pub errors: u64,
    pub slowest: Duration,
    pub peak_bytes: usize,
    pub elapsed: Duration,
}

/// Runs `target` for its iterations; panics with the saved input on the first failure.
pub fn fuzz(target: Target) -> Report {
    let iterations = std::env::var("GLM5_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(target.ci_iterations);
    let seed = std::env::var("GLM5_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_0f61_6d35_u64);
    // A wall-clock budget for long runs on a shared machine: stop early, report what ran.
    let budget = std::env::var("GLM5_FUZZ_SECONDS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .map(Duration::from_secs_f64);
    let mut rng = Rng(seed ^ fnv(target.name.as_bytes()));
    let mut report = Report::default();
    let started = Instant::now();
    // The seeds themselves first: they must pass or fail cleanly as well.
    let inputs = target
        .seeds
        .clone()
        .into_iter()
        .chain(std::iter::repeat_with(|| mutate(&mut rng, &target)))
        .take(iterations.max(target.seeds.len() as u64) as usize);
    for input in inputs {
        run_one(&target, &input, &mut report);
        if budget.is_some_and(|b| started.elapsed() > b) {
            break;
        }
    }
    report.elapsed = started.elapsed();
    eprintln!(
        "fuzz {}: {} inputs ({} accepted, {} typed errors) in {:.1} s; slowest {:.1} ms, peak {} KiB",
        target.name,
        report.iterations,
        report.ok,
        report.errors,
        report.elapsed.as_secs_f64(),
        report.slowest.as_secs_f64() * 1e3,
        report.peak_bytes >> 10
    );
    report
}

fn run_one(target: &Target, input: &[u8], report: &mut Report) {
    // GLM5_FUZZ_TRACE=DIR: each input is written to DIR/<target> before it runs, so that one that kills the
    // process (a stack overflow) can be found again.
    if let Ok(dir) = std::env::var("GLM5_FUZZ_TRACE") {
        let _ = std::fs::write(std::path::Path::new(&dir).join(target.name), input);
    }
    CURRENT.set((input.as_ptr(), input.len()));
    let base = LIVE.get();
    PEAK.set(base);
    let started = Instant::now();
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| (target.run)(input)));
    let took = started.elapsed();
    CURRENT.set((std::ptr::null(), 0));
    let peak = (PEAK.get() - base).max(0) as usize;
    report.iterations += 1;
    report.slowest = report.slowest.max(took);
    report.peak_bytes = report.peak_bytes.max(peak);
    let fail = |what: String| -> ! {
        let path = save(target.name, input);
        panic!(
            "fuzz {}: {what}\ninput ({} bytes) saved to {}:\n{}",
            target.name,
            input.len(),
            path,
            String::from_utf8_lossy(&input[..input.len().min(2000)])
        )
    };
    match result {
        Ok(Ok(())) => report.ok += 1,
        Ok(Err(message)) => {
            report.errors += 1;
            if message.trim().is_empty() || message.contains('\n') {
                fail(format!("the error is not one line of text: {message:?}"));
            }
        }
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            fail(format!("panicked: {message}"));
        }
    }
    let max_seconds = target.max_seconds * time_scale();
    if took.as_secs_f64() > max_seconds {
        fail(format!(
            "took {:.2} s, more than {max_seconds} s",
            took.as_secs_f64(),
        ));
    }
    if peak > PEAK_LIMIT {
        fail(format!("held {peak} bytes at once, more than {PEAK_LIMIT}"));
    }
}

/// `GLM5_FUZZ_TIME_SCALE`, else 1.
fn time_scale() -> f64 {
    std::env::var("GLM5_FUZZ_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 1.0)
        .unwrap_or(1.0)
}

/// Writes a failing input under the target dir, for the regression test it becomes.
fn save(name: &str, input: &[u8]) -> String {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("{name}-{:016x}.bin", fnv(input)));
    let _ = std::fs::write(&path, input);
    path.display().to_string()
}

/// Splitmix64: small, seeded, good enough to pick mutations.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Numbers that break arithmetic, and fragments that break formats, for every target.
const COMMON: &[&str] = &[
    "0",
    "-1",
    "1",
    "2",
    "255",
    "256",
    "65535",
    "65536",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "340282366920938463463374607431768211456",
    "1e308",
    "-1e308",
    "1e-320",
    "NaN",
    "Infinity",
    "null",
    "true",
    "\"\"",
    "[]",
    "{}",
    "\"../../../../x\"",
    "\"/etc/passwd\"",
    "\\u0000",
    "\u{feff}",
    "\u{10ffff}",
    "\"\\ud800\"",
];

/// One to four mutations of a random seed: byte flips and sets, cuts, duplications, splices of another
/// seed, dictionary fragments inserted or put in place of a number or a string.
pub fn mutate(rng: &mut Rng, target: &Target) -> Vec<u8> {
    let mut data = target.seeds[rng.below(target.seeds.len())].clone();
    for _ in 0..=rng.below(4) {
        let len = data.len();
        let at = if len == 0 { 0 } else { rng.below(len) };
        let pick = |rng: &mut Rng| -> Vec<u8> {
            let n = target.dictionary.len() + COMMON.len();
            let i = rng.below(n);
            if i < target.dictionary.len() {
                target.dictionary[i].clone()
            } else {
                COMMON[i - target.dictionary.len()].as_bytes().to_vec()
            }
        };
        match rng.below(10) {
            0 if len > 0 => data[at] ^= 1 << rng.below(8),
            1 if len > 0 => data[at] = rng.next() as u8,
            2 if len > 0 => {
                let end = (at + 1 + rng.below(64)).min(len);
                data.drain(at..end);
            }
            3 if len > 0 => {
                let end = (at + 1 + rng.below(256)).min(len);
                let copy = data[at..end].to_vec();
                let to = rng.below(data.len() + 1);
                data.splice(to..to, copy);
            }
            4 => {
                let other = &target.seeds[rng.below(target.seeds.len())];
                if !other.is_empty() {
                    let from = rng.below(other.len());
                    let end = (from + 1 + rng.below(512)).min(other.len());
                    let to = rng.below(data.len() + 1);
                    data.splice(to..to, other[from..end].iter().copied());
                }
            }
            5 if len > 0 => data.truncate(at),
            6 | 7 => {
                // A number in place of a number: sizes, ids, offsets, counts.
                if let Some((start, end)) = find_run(&data, at, |b| b.is_ascii_digit()) {
                    let value = pick(rng);
                    data.splice(start..end, value);
                } else {
                    let value = pick(rng);
                    data.splice(at..at, value);
                }
            }
            8 => {
                // A string's contents replaced: names, paths, template text.
                if let Some((start, end)) = find_string(&data, at) {
                    let value = pick(rng);
                    data.splice(start..end, value);
                } else {
                    let value = pick(rng);
                    data.splice(at..at, value);
                }
            }
            _ => {
                let value = pick(rng);
                let to = rng.below(data.len() + 1);
                data.splice(to..to, value);
            }
        }
    }
    data
}

/// The run of bytes matching `class` at or after `from`.
fn find_run(data: &[u8], from: usize, class: impl Fn(u8) -> bool) -> Option<(usize, usize)> {
    let start = (from..data.len()).find(|&i| class(data[i]))?;
    let end = (start..data.len())
        .find(|&i| !class(data[i]))
        .unwrap_or(data.len());
    Some((start, end))
}

/// The inside of the next `"..."` at or after `from`.
fn find_string(data: &[u8], from: usize) -> Option<(usize, usize)> {
    let open = (from..data.len()).find(|&i| data[i] == b'"')? + 1;
    let close = (open..data.len()).find(|&i| data[i] == b'"')?;
    Some((open, close))
}

// The allocator of the fuzz binary: counts the bytes each thread holds (the targets run on the test
// threads, in parallel), and refuses (reporting the input) a single allocation above the limit, which would
// otherwise be a target asking for memory without bound. Const-initialised thread-locals without drop: safe
// to use inside the allocator.
thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
    static CURRENT: Cell<(*const u8, usize)> = const { Cell::new((std::ptr::null(), 0)) };
}

fn count(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

/// Counting, limiting wrapper of the system allocator.
pub struct Limited;

unsafe impl GlobalAlloc for Limited {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOCATION_LIMIT {
            refused(layout.size());
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded as is.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            count(layout.size() as isize);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as isize));
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOCATION_LIMIT {
            refused(new_size);
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded as is.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        new
    }
}

/// Reports the input being run, without allocating (the process aborts right after).
fn refused(size: usize) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "fuzz: an allocation of {size} bytes (more than {ALLOCATION_LIMIT}) was refused; the input:"
    );
    let (ptr, len) = CURRENT.try_with(Cell::get).unwrap_or((std::ptr::null(), 0));
    if !ptr.is_null() && len > 0 {
        // SAFETY: `run_one` publishes the input's buffer for exactly as long as the target runs on it.
        let input = unsafe { std::slice::from_raw_parts(ptr, len.min(4000)) };
        let _ = err.write_all(input);
        let _ = writeln!(err);
    }
}
