//! The score stage: which score kernel a call runs (f32 FMA; bf16 or FP8 by mma.sync; on Hopper the FP8
//! TMA kernel by wgmma, per query or four queries a block) and its launch over one chunk of queries.

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaStream, PushKernelArg};
use candle_core::cuda_backend::CudaDevice;
use candle_core::DType;

use super::{
    launch_config, Params, GROUP_SHARED_BYTES, MODULE, MODULE_SM90, SCORE_THREADS, TILE_KEYS,
};
use crate::cuda::{cuda_err, device_info, kernel, resident_blocks};
use crate::device::ComputeCapability;
use crate::dsa_indexer::policy::score::{self, GROUP_TOKENS};
use crate::dsa_indexer::{DsaIndexerLaunch, ScoreKernel};

/// The grouped prefill score kernel (Hopper only).
const GROUPED_NAME: &str = "dsa_scores_fp8_wgmma_g4_d128";

/// What a call's score stage runs.
pub(super) struct ScoreStage {
    function: CudaFunction,
    /// Four queries a block (the grouped kernel).
    grouped: bool,
    /// The f32 FMA kernel (one block per key tile).
    f32_scores: bool,
    /// Blocks of the kernel the device holds at once (mma kernels).
    resident: usize,
    /// Dynamic shared memory of a block.
    shared: usize,
}

/// The inputs' shape as the score stage sees it.
pub(super) struct ScoreShape {
    pub heads: usize,
    pub dim: usize,
    pub block_size: usize,
    /// Sequences in the block table (the grouped kernel needs one).
    pub batch: usize,
    pub fp8: bool,
    pub dtype: DType,
    /// Queries per chunk, and the positions each row scores.
    pub chunk: usize,
    pub positions: usize,
}

impl ScoreShape {
    /// GLM-5's cache (FP8 rows of 128 in pages of 64): whole-tile copies by TMA.
    pub fn tma(&self) -> bool {
        self.fp8 && self.dim == 128 && self.block_size.is_multiple_of(TILE_KEYS)
    }
}

impl ScoreStage {
    /// The score kernel for `shape` on `dev`, as the launch policy or `launch`'s pin says.
    pub fn choose(
        dev: &CudaDevice,
        shape: &ScoreShape,
        launch: &DsaIndexerLaunch,
    ) -> candle_core::Result<Self> {
        let ScoreShape { heads, dim, .. } = *shape;
        let tma = shape.tma();
        let name = match (shape.fp8, shape.dtype) {
            (false, DType::F32) => "dsa_scores_f32".to_string(),
            (true, _) if tma => format!("dsa_scores_fp8_tma_d128_mt{}", heads.div_ceil(16)),
            (fp8, _) => format!(
                "dsa_scores_{}_d{dim}_mt{}",
                if fp8 { "fp8" } else { "bf16" },
                heads.div_ceil(16)
            ),
        };
        // On Hopper, 17 to 32 heads (GLM-5's 32): the same TMA kernel by warpgroup MMA (unless pinned), and
        // for a prefill chunk of one sequence (a block table of one row: the grouped kernel's promise) the
        // grouped kernel, four queries a block, where `policy::score` takes it.
        let pin = launch.score_kernel;
        let wgmma = tma
            && heads.div_ceil(16) == 2
            && pin != ScoreKernel::MmaSync
            && device_info(dev)?.capability == ComputeCapability::SM90;
        let grouped = wgmma
            && shape.batch == 1
            && (pin == ScoreKernel::Grouped
                || pin == ScoreKernel::Policy && {
                    let resident = resident_blocks(
                        dev,
                        "dsa_indexer_sm90",
                        MODULE_SM90,
                        GROUPED_NAME,
                        SCORE_THREADS,
                        GROUP_SHARED_BYTES as u32,
                    )?;
                    score::groups_queries(
                        shape.chunk,
                        shape.positions.div_ceil(TILE_KEYS),
                        resident,
                    )
                });
        let (module, name) = if grouped {
            (("dsa_indexer_sm90", MODULE_SM90), GROUPED_NAME.to_string())
        } else if wgmma {
            (
                ("dsa_indexer_sm90", MODULE_SM90),
                "dsa_scores_fp8_wgmma_d128_mt2".to_string(),
            )
        } else {
            (("dsa_indexer", MODULE), name)
        };
        let shared = if grouped { GROUP_SHARED_BYTES } else { 0 };
        let function = kernel(dev, module.0, module.1, &name)?;
        let f32_scores = shape.dtype == DType::F32 && !shape.fp8;
        // mma score blocks stream a strided share of a row's tiles: as many blocks as the SMs hold.
        let resident = if f32_scores {
            0
        } else {
            resident_blocks(dev, module.0, module.1, &name, SCORE_THREADS, shared as u32)?
        };
        Ok(Self {
            function,
            grouped,
            f32_scores,
            resident,
            shared,
        })
    }

    /// Scores `len` queries (`params` of their chunk) over rows of `positions`.
    pub fn launch(
        &self,
        stream: &CudaStream,
        params: &Params,
        len: usize,
        positions: usize,
        heads: usize,
        dim: usize,
    ) -> candle_core::Result<()> {
        let tiles = positions.div_ceil(TILE_KEYS);
        // Score blocks per row, and the rows along x: queries, or groups of queries.
        let rows = if self.grouped {
            len.div_ceil(GROUP_TOKENS)
        } else {
            len
        };
        let (score_blocks, score_smem) = if self.f32_scores {
            (tiles, (heads * dim + heads) * 4)
        } else {
            // Whole waves: rounding the blocks per token up would leave a second, nearly empty wave
            // (64 tokens on 528 slots: 9 each = 576 blocks, the last 48 running alone). At least two
            // tiles per block: every block copies and converts the token's Q, which one-tile blocks
            // (32K, batch 1) would pay for a single tile.
            (
                tiles.div_ceil(2).min(self.resident / rows).max(1),
                self.shared,
            )
        };
        // The mma kernels: tokens along x, a row's blocks along y (see the kernel); the f32 kernel's one
        // block per tile: tiles along x (a row's 65,536 at the most visible keys exceed y's limit).
        let grid = if self.f32_scores {
            (score_blocks, len)
        } else {
            (rows, score_blocks)
        };
        let config = launch_config(grid, SCORE_THREADS, score_smem);
        let mut builder = stream.launch_builder(&self.function);
        builder.arg(params);
        // SAFETY: `params` mirrors DsaParams; every pointer in it is live for this call.
        unsafe { builder.launch(config) }.map_err(cuda_err)?;
        Ok(())
    }
}
