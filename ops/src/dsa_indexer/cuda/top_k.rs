//! The top-k stage: the cluster top-k (one thread-block cluster per query, rows of up to 32K positions
//! whose clusters fit the GPU at once) or the chain of three kernels (candidates, exact threshold, ordered
//! emit), each launched as a programmatic dependent of the one before.

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaStream};
use candle_core::cuda_backend::CudaDevice;

use super::{
    launch_config, Params, CLUSTER_SHARED_BYTES, MODULE, SEGMENT_THREADS, THRESHOLD_STAGE_BYTES,
    TOPK_THREADS,
};
use crate::cuda::{kernel, launch_dependent, resident_blocks, resident_clusters};
use crate::dsa_indexer::policy::emit::{self, SEGMENT};
use crate::dsa_indexer::policy::top_k::{self, CLUSTER_BLOCKS, CLUSTER_THREADS};
use crate::dsa_indexer::{DsaIndexerLaunch, TopKPath};

/// The cluster top-k's entry point with `e` scores per thread.
fn cluster_kernel_name(e: usize) -> String {
    format!("dsa_topk_cluster_e{e}")
}

/// The cluster top-k's scores per thread for `tokens` rows of up to `positions`, where it takes them
/// (the pin, else `policy::top_k::chosen`).
fn cluster_scores_per_thread(
    dev: &CudaDevice,
    positions: usize,
    tokens: usize,
    launch: &DsaIndexerLaunch,
) -> candle_core::Result<Option<usize>> {
    Ok(match launch.top_k_path {
        TopKPath::Chain => None,
        TopKPath::Cluster => top_k::scores_per_thread(positions),
        TopKPath::Policy => match top_k::scores_per_thread(positions) {
            Some(e) => {
                let at_once = resident_clusters(
                    dev,
                    ("dsa_indexer", MODULE),
                    &cluster_kernel_name(e),
                    CLUSTER_THREADS as u32,
                    CLUSTER_SHARED_BYTES as u32,
                    Some(CLUSTER_BLOCKS),
                )?[CLUSTER_BLOCKS];
                top_k::chosen(positions, tokens, at_once)
            }
            None => None,
        },
    })
}

/// What a call's top-k stage runs.
pub(super) enum TopKStage {
    /// The cluster top-k.
    Cluster(CudaFunction),
    /// The chain, with the emit kernels' resident blocks (for `policy::emit`).
    Chain {
        candidates: CudaFunction,
        threshold: CudaFunction,
        emit: CudaFunction,
        emit_block: CudaFunction,
        emit_resident: usize,
    },
}

impl TopKStage {
    /// The top-k for chunks of `tokens` rows of up to `positions`, as the launch policy or `launch`'s pin
    /// says.
    pub fn choose(
        dev: &CudaDevice,
        positions: usize,
        tokens: usize,
        launch: &DsaIndexerLaunch,
    ) -> candle_core::Result<Self> {
        let [candidates, threshold, emit, emit_block] = [
            "dsa_topk_candidates",
            "dsa_topk_threshold",
            "dsa_topk_emit",
            "dsa_topk_emit_block",
        ]
        .map(|name| kernel(dev, "dsa_indexer", MODULE, name));
        let (candidates, threshold, emit, emit_block) =
            (candidates?, threshold?, emit?, emit_block?);
        let emit_resident = resident_blocks(
            dev,
            "dsa_indexer",
            MODULE,
            "dsa_topk_emit",
            SEGMENT_THREADS,
            0,
        )?;
        let cluster = cluster_scores_per_thread(dev, positions, tokens, launch)?
            .map(|e| kernel(dev, "dsa_indexer", MODULE, &cluster_kernel_name(e)))
            .transpose()?;
        Ok(match cluster {
            Some(function) => Self::Cluster(function),
            None => Self::Chain {
                candidates,
                threshold,
                emit,
                emit_block,
                emit_resident,
            },
        })
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }

    /// Selects the top `k` of `len` rows of up to `positions` scores (`params` of their chunk). The
    /// kernels start before their predecessor finishes (the cluster top-k as the score kernel starts:
    /// `cluster_topk`) and wait for its writes.
    pub fn launch(
        &self,
        stream: &CudaStream,
        params: &Params,
        len: usize,
        positions: usize,
        k: usize,
    ) -> candle_core::Result<()> {
        match self {
            Self::Cluster(function) => {
                let cfg = launch_config(
                    (CLUSTER_BLOCKS, len),
                    CLUSTER_THREADS as u32,
                    CLUSTER_SHARED_BYTES,
                );
                // SAFETY: `params` mirrors DsaParams, every pointer in it live for this call (the kernel's
                // cluster shape is fixed at compile time).
                unsafe { launch_dependent(function, stream, cfg, params) }
            }
            Self::Chain {
                candidates,
                threshold,
                emit,
                emit_block,
                emit_resident,
            } => {
                let segments = positions.div_ceil(SEGMENT);
                // The emit's segments: a row's output slots (K) or its positions, whichever is more.
                let emit_segments = positions.max(k).div_ceil(SEGMENT);
                let (emit, emit_blocks) = if emit::by_blocks(len, positions, k, *emit_resident) {
                    (emit_block, emit_segments)
                } else {
                    (emit, emit_segments.div_ceil(emit::EMIT_SEGMENTS))
                };
                let chain = [
                    (
                        candidates,
                        launch_config((segments, len), SEGMENT_THREADS, 0),
                    ),
                    (
                        threshold,
                        launch_config((len, 1), TOPK_THREADS, THRESHOLD_STAGE_BYTES),
                    ),
                    (emit, launch_config((emit_blocks, len), SEGMENT_THREADS, 0)),
                ];
                for (function, cfg) in chain {
                    // SAFETY: as above; each top-k kernel takes one DsaParams.
                    unsafe { launch_dependent(function, stream, cfg, params) }?;
                }
                Ok(())
            }
        }
    }
}
