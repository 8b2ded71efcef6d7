//! The CUDA launcher's choices, as pure functions so that CPU tests check them: which top-k runs after the
//! scores (`top_k`), which emit kernel writes a chain top-k's rows (`emit`), and when a one-sequence call's
//! queries are scored in groups (`score`).

/// Which top-k the CUDA launcher runs after the scores.
pub mod top_k {
    /// Blocks per cluster and threads per block of the cluster top-k (`CLUSTER_BLOCKS`,
    /// `CLUSTER_THREADS` in the .cu file), and the scores per thread it is instantiated for.
    pub use glm5_kernels::interface::dsa_indexer::{CLUSTER_BLOCKS, CLUSTER_THREADS};
    pub const CLUSTER_SCORES_PER_THREAD: [usize; 5] = [4, 8, 16, 32, 64];
    /// The most scores per thread the launcher's choice gives the cluster top-k: its eight blocks do a
    /// row's per-score work on eight SMs, which from 32 per thread (128K rows) on costs more than the
    /// chain's two kernel boundaries save; up to 8 (32K rows) it is the faster of the two.
    pub const CHOSEN_MAX_SCORES_PER_THREAD: usize = 8;

    /// The cluster kernel's scores per thread for rows of up to `positions` (none past its longest row).
    pub fn scores_per_thread(positions: usize) -> Option<usize> {
        CLUSTER_SCORES_PER_THREAD
            .into_iter()
            .find(|e| CLUSTER_BLOCKS * CLUSTER_THREADS * e >= positions)
    }

    /// The launcher's choice for `tokens` rows of up to `positions` when the device runs `at_once`
    /// clusters together: the cluster top-k (its scores per thread) where rows are short enough and every
    /// token's cluster runs in one wave (a second wave costs more than the chain), else the chain
    /// (`None`).
    pub fn chosen(positions: usize, tokens: usize, at_once: usize) -> Option<usize> {
        scores_per_thread(positions)
            .filter(|&e| e <= CHOSEN_MAX_SCORES_PER_THREAD && tokens <= at_once)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn rows_up_to_the_longest_get_the_fewest_scores_per_thread_that_cover_them() {
            assert_eq!(scores_per_thread(1), Some(4));
            assert_eq!(scores_per_thread(16_384), Some(4));
            assert_eq!(scores_per_thread(16_385), Some(8));
            assert_eq!(scores_per_thread(131_072), Some(32));
            let longest = CLUSTER_BLOCKS * CLUSTER_THREADS * 64;
            assert_eq!(scores_per_thread(longest), Some(64));
            assert_eq!(scores_per_thread(longest + 1), None);
        }

        #[test]
        fn the_choice_takes_short_rows_in_one_wave_and_leaves_the_rest_to_the_chain() {
            assert_eq!(chosen(32_768, 8, 16), Some(8));
            assert_eq!(chosen(8192, 1, 16), Some(4));
            assert_eq!(chosen(32_768, 64, 16), None, "a second wave");
            assert_eq!(chosen(131_072, 1, 16), None, "32 scores per thread");
            assert_eq!(chosen(32_768, 1, 0), None, "no cluster fits the device");
        }
    }
}

/// Which emit kernel writes a chain top-k's rows.
pub mod emit {
    /// Selected positions above which a segment is dense (`DIRECT_STORES` in the .cu file).
    pub use glm5_kernels::interface::dsa_indexer::DIRECT_STORES;
    /// Segments a block of the warp-a-segment emit (`EMIT_SEGMENTS` in the .cu file).
    pub use glm5_kernels::interface::dsa_indexer::EMIT_SEGMENTS;
    /// Positions per top-k segment (`SEG` in the .cu file).
    pub use glm5_kernels::interface::dsa_indexer::SEGMENT;

    /// Whether the block-a-segment emit writes `rows` rows seeing up to `positions` positions each, top `k`: where
    /// the rows' segments are dense on average (more than DIRECT_STORES of a segment's positions selected) and the
    /// warp-a-segment emit's grid would not fill the `resident` blocks the device holds at once (decode steps at
    /// 2K-16K positions; a prefill chunk keeps the warp a segment, whose stores are coalesced).
    pub fn by_blocks(rows: usize, positions: usize, k: usize, resident: usize) -> bool {
        let dense = positions > k && positions * DIRECT_STORES <= k * SEGMENT;
        dense && rows * positions.div_ceil(SEGMENT).div_ceil(EMIT_SEGMENTS) < resident
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn blocks_a_segment_for_small_grids_of_dense_rows() {
            let h200 = 132 * 6; // the warp-a-segment emit: 6 blocks an SM
            assert!(by_blocks(64, 8192, 2048, h200), "8K batch 64");
            assert!(
                by_blocks(64, 16_384, 2048, h200),
                "16K batch 64: 256 a segment"
            );
            assert!(by_blocks(1, 2049, 2048, h200), "one row just past K");
            assert!(
                !by_blocks(64, 32_768, 2048, h200),
                "32K batch 64: sparse segments"
            );
            assert!(!by_blocks(64, 1024, 2048, h200), "rows that see at most K");
            assert!(
                !by_blocks(4096, 8192, 2048, h200),
                "an 8K prefill chunk fills the device"
            );
            assert!(
                by_blocks(512, 8192, 2048, h200),
                "a short prefill chunk does not"
            );
        }
    }
}

/// When the CUDA launcher scores a one-sequence call's queries in groups.
pub mod score {
    /// Queries per block of the grouped prefill score kernel (`GROUP_TOKENS` in the .cu file).
    pub use glm5_kernels::interface::dsa_indexer::GROUP_TOKENS;
    /// The fewest tiles each grouped block must get, the grid filling the device, for the grouped kernel to
    /// pay for its longer start (four queries' Q, twice the histogram): on the H200 it loses at 8 tiles a
    /// block, breaks even around there and gains a fifth or more from 32 on.
    pub const GROUP_MIN_TILES_PER_BLOCK: usize = 16;

    /// Whether `queries` queries of one sequence over rows of `tiles` key tiles go four to a block, the device
    /// holding `resident` grouped blocks at once.
    pub fn groups_queries(queries: usize, tiles: usize, resident: usize) -> bool {
        resident > 0
            && queries.div_ceil(GROUP_TOKENS) * tiles >= GROUP_MIN_TILES_PER_BLOCK * resident
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn groups_where_each_block_gets_sixteen_tiles() {
            let h200 = 264; // 132 SMs x 2 blocks
            assert!(!groups_queries(1, 2048, h200), "a decode step");
            assert!(!groups_queries(64, 128, h200), "8K x 64: 8 tiles a block");
            assert!(!groups_queries(16, 512, h200), "32K x 16: 8 tiles a block");
            assert!(groups_queries(64, 512, h200), "32K x 64");
            assert!(groups_queries(16, 2048, h200), "128K x 16");
            assert!(groups_queries(4096, 128, h200), "8K x 4096");
            assert!(!groups_queries(4096, 128, 0), "the kernel does not fit");
        }
    }
}
