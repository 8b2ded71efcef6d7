//! `glm5-bench`: GPU benchmarks of glm5's kernels at GLM-5's shapes, against the candle-ops reference path
//! and against the device's own ceilings (device-to-device copy bandwidth and the mma.sync bf16 rate of a
//! register-only microkernel), all measured in the same run. Needs a GPU (built with `--features cuda`).
//!
//! Columns: "wall" is the median of several rounds, each round `n` back-to-back calls then a device sync:
//! it includes the host's launch overhead, as an eager decode step pays it. "GPU" is the period of
//! back-to-back calls replayed from CUDA graphs (as a graph-captured decode step runs them): the device's
//! time, launch gaps included, host excluded. Throughput columns use the GPU time. "cold" times one call with
//! the L2 emptied first (device time, CUDA events), and "%cold" is the copy-bandwidth share at that time:
//! back-to-back calls on the same inputs keep small problems' data in L2 (50 MB on an H200), which a decode
//! step does not. sparse_mla rows name their kernel: "mma" is the mma.sync launcher's own pick; with at most
//! 8 heads also its head-tile kernel ("tiles") and its narrow kernel with 2, 4 and 8 warps per block ("n2",
//! "n4", "n8"); on an sm_90 GPU also wgmma where it serves (heads a multiple of 64). "vs mma" is the "mma"
//! row's GPU time over this row's. The indexer's "scores" and "top-k" split a call's device time by CUDA
//! events between the two stages (`glm5::ops::time_stages`; the events keep the stages from overlapping, so
//! they sum to a little more). Inputs are random (never zeros). `docs/performance.md` has the tables.

mod ceilings;
mod e2e;
mod fp8_prefill;
mod indexer;
mod matvec;
mod moe;
mod serve;
mod slice;
mod sparse_mla;
mod timing;

use clap::{Parser, Subcommand, ValueEnum};

/// GLM-5's top-k and paged-cache block size.
const TOP_K: usize = 2048;
const BLOCK_SIZE: usize = 64;

#[derive(Parser)]
#[command(
    name = "glm5-bench",
    about = "GPU benchmarks of glm5's kernels against the reference path and the device's ceilings"
)]
struct Cli {
    /// What to measure (default: every sparse_mla row, then every indexer row).
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// sparse_mla decode rows: bf16, GLM-5's rows of 512 + 64, top-k 2048, paged (block 64).
    SparseMla {
        /// One shape only: CONTEXT BATCH HEADS (e.g. `32768 8 8`).
        #[arg(num_args = 3, value_names = ["CONTEXT", "BATCH", "HEADS"])]
        shape: Vec<usize>,
        /// One kernel row only (mma, tiles, n2, n4, n8, wgmma), e.g. under a profiler.
        #[arg(long)]
        kernel: Option<String>,
    },
    /// dsa_indexer rows: GLM-5's FP8 key cache, 32 heads of 128, top-k 2048, decode and prefill.
    Indexer {
        /// One shape only: CONTEXT BATCH [QUERIES per sequence, default 1] (e.g. `32768 1`, `32768 1 4096`).
        #[arg(num_args = 2..=3, value_names = ["CONTEXT", "BATCH", "QUERIES"])]
        shape: Vec<usize>,
        /// The score kernel every call runs (default: the launch policy).
        #[arg(long, value_enum, default_value = "policy")]
        score_kernel: ScoreKernelArg,
    },
    /// GLM-5's first LAYERS layers at real sizes (random weights) on one GPU and over two.
    Slice { layers: usize },
    /// One GLM-5 MoE layer's experts by each implementation, decode and prefill sizes.
    Moe,
    /// One GLM-5 MoE layer's experts as stacked Q4_K blocks by each of candle-nn's GGUF MoE kernels.
    MoeGguf,
    /// One GLM-5 projection at batch 1 in each weight format (bf16, FP8, NVFP4, i-quants, Q4_K): device time
    /// of the kernels alone and of the eager call, against the copy rate.
    Matvec,
    /// FP8 prefill through GLM-5's FP8 projections by each path (W8A8 on cuBLASLt's block-scaled FP8 GEMM,
    /// W8A16 dequantise + bf16 GEMM), in TFLOP/s against the FP8 GEMM peak measured in the same run.
    Fp8Prefill {
        /// Tokens of the prefill (activation rows).
        #[arg(long, default_value_t = 4096)]
        tokens: usize,
    },
    /// The whole model step on one GPU: decode and prefill of a GLM-5 slice against its weight-byte floor.
    E2e {
        /// Weights: bf16; q4k (random Q4_K blocks for every linear layer a Q4_K_M file quantises, glm5's
        /// kernels) or q4k-candle (the same blocks through candle's); q4_k_m / q4_k_m-candle (Q4_K_M's own mix,
        /// Q6_K for lm_head and the even layers' down_proj); fp8 or nvfp4 (the matrices the published
        /// GLM-5-FP8 / NVFP4 checkpoints quantise, in that format); an i-quant (iq4_xs, ...).
        #[arg(long, default_value = "bf16")]
        weights: e2e::WeightFormat,
        /// Layers of GLM-5 to build (the first ones: dense, then MoE).
        #[arg(long, default_value_t = 6)]
        layers: usize,
        /// Contexts to decode at (cache filled by prefill chunks first).
        #[arg(long, value_delimiter = ',', default_value = "4096,32768")]
        contexts: Vec<usize>,
        /// Timed decode steps per context.
        #[arg(long, default_value_t = 16)]
        steps: usize,
        /// Prefill length (and prefill chunk).
        #[arg(long, default_value_t = 4096)]
        prefill: usize,
        /// Batched decode: sequences per step (at the first context), over the paged pool.
        #[arg(long, value_delimiter = ',', default_value = "8,32,64")]
        batches: Vec<usize>,
        /// HF transformers' timing script (bench/hf_e2e.py) to run on the same slice afterwards.
        #[arg(long)]
        hf: Option<String>,
        /// Also load the MTP layer and time speculative decoding's steps (batch 1, the first context).
        #[arg(long)]
        mtp: bool,
        /// Quantise the projections the weights keep unquantised to FP8 at load (glm5 --fp8-projections).
        #[arg(long)]
        fp8_projections: bool,
    },
    /// `glm5 serve` in-process on e2e's GLM-5 slice, driven over loopback HTTP by concurrent streaming
    /// clients: tokens/s, time to first token and inter-token latency per stream count.
    Serve {
        /// Layers of GLM-5 to build (the first ones: dense, then MoE).
        #[arg(long, default_value_t = 6)]
        layers: usize,
        /// Concurrent clients of each level.
        #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
        streams: Vec<usize>,
        /// Prompt length of every request (random token ids).
        #[arg(long, default_value_t = 256)]
        prompt_tokens: usize,
        /// Tokens every request generates (greedy, end-of-sequence ignored).
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Requests each client sends, one after another.
        #[arg(long, default_value_t = 2)]
        requests: usize,
        /// The server's --prefill-chunk.
        #[arg(long, default_value_t = 512)]
        prefill_chunk: usize,
        /// The server's --enforce-eager: every step launched from the host, no decode graphs.
        #[arg(long)]
        enforce_eager: bool,
        /// Requests sample at temperature 1 with top-p 0.95 (GLM-5's defaults) instead of greedily.
        #[arg(long)]
        sampled: bool,
        /// The layers split evenly over this many devices that share GPU 0, each with its own stream (as the
        /// placement over several GPUs runs them, on one).
        #[arg(long, default_value_t = 1)]
        stages: usize,
        /// The server's --micro-batches (default: one per stage).
        #[arg(long)]
        micro_batches: Option<usize>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum ScoreKernelArg {
    Policy,
    PerQuery,
    Grouped,
    MmaSync,
}

fn cuda(e: impl std::fmt::Display) -> glm5::candle_core::Error {
    glm5::candle_core::Error::Cuda(e.to_string().into())
}

/// Each row's argmax read back, as a greedy generation loop takes it (`glm5::ops::argmax`, what `glm5
/// generate` runs).
trait Greedy {
    fn greedy(&self) -> glm5::candle_core::Result<Vec<u32>>;
}

impl Greedy for glm5::candle_core::Tensor {
    fn greedy(&self) -> glm5::candle_core::Result<Vec<u32>> {
        glm5::ops::argmax::argmax(self)
            .map_err(cuda)?
            .to_vec1::<u32>()
    }
}

/// splitmix64: reproducible indices without a rand dependency.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn main() -> glm5::candle_core::Result<()> {
    use glm5::candle_core::Device;
    use glm5::ops::ScoreKernel;

    let cli = Cli::parse();
    if let Some(Command::Slice { layers }) = cli.command {
        return slice::slice_rows(layers);
    }
    if let Some(Command::E2e {
        weights,
        layers,
        contexts,
        steps,
        prefill,
        batches,
        hf,
        mtp,
        fp8_projections,
    }) = &cli.command
    {
        return e2e::e2e_rows(&e2e::E2eArgs {
            weights: *weights,
            layers: *layers,
            contexts: contexts.clone(),
            steps: *steps,
            prefill: *prefill,
            batches: batches.clone(),
            hf_script: hf.clone(),
            mtp: *mtp,
            fp8_projections: *fp8_projections,
        });
    }
    if let Some(Command::Serve {
        layers,
        streams,
        prompt_tokens,
        max_tokens,
        requests,
        prefill_chunk,
        enforce_eager,
        sampled,
        stages,
        micro_batches,
    }) = &cli.command
    {
        return serve::serve_rows(&serve::ServeArgs {
            layers: *layers,
            streams: streams.clone(),
            prompt_tokens: *prompt_tokens,
            max_tokens: *max_tokens,
            requests: *requests,
            prefill_chunk: *prefill_chunk,
            cuda_graphs: !*enforce_eager,
            sampled: *sampled,
            stages: *stages,
            micro_batches: *micro_batches,
        });
    }
    let device = Device::new_cuda(0)?;
    // One stream: cross-stream event tracking would add driver calls to every launch.
    if let Device::Cuda(dev) = &device {
        // SAFETY: everything here runs on the device's single stream.
        unsafe { dev.disable_event_tracking() };
    }
    let copy = ceilings::copy_bandwidth(&device)?;
    let peak = ceilings::mma_peak(&device)?;
    println!(
        "device copy bandwidth: {:.0} GB/s   mma.sync bf16 peak: {:.0} TFLOP/s",
        copy / 1e9,
        peak / 1e12
    );
    match cli.command {
        Some(Command::SparseMla { shape, kernel }) => {
            let only = match shape[..] {
                [context, batch, heads] => Some((context, batch, heads)),
                _ => None,
            };
            sparse_mla::sparse_mla_rows(&device, copy, peak, only, kernel.as_deref())
        }
        Some(Command::Indexer {
            shape,
            score_kernel,
        }) => {
            let only = match shape[..] {
                [context, batch] => Some((context, batch, 1)),
                [context, batch, queries] => Some((context, batch, queries)),
                _ => None,
            };
            let score_kernel = match score_kernel {
                ScoreKernelArg::Policy => ScoreKernel::Policy,
                ScoreKernelArg::PerQuery => ScoreKernel::PerQuery,
                ScoreKernelArg::Grouped => ScoreKernel::Grouped,
                ScoreKernelArg::MmaSync => ScoreKernel::MmaSync,
            };
            if score_kernel != ScoreKernel::Policy {
                println!("score kernel pinned: {score_kernel:?}");
            }
            indexer::indexer_rows(&device, copy, peak, only, score_kernel)
        }
        Some(Command::Moe) => moe::moe_rows(&device, copy, e2e::gemm_peak(&device)?),
        Some(Command::MoeGguf) => moe::moe_gguf_rows(&device, copy),
        Some(Command::Matvec) => matvec::matvec_rows(&device, copy),
        Some(Command::Fp8Prefill { tokens }) => fp8_prefill::fp8_prefill_rows(&device, tokens),
        Some(Command::Slice { .. }) | Some(Command::E2e { .. }) | Some(Command::Serve { .. }) => {
            unreachable!("handled above")
        }
        None => {
            sparse_mla::sparse_mla_rows(&device, copy, peak, None, None)?;
            indexer::indexer_rows(&device, copy, peak, None, ScoreKernel::Policy)
        }
    }
}
