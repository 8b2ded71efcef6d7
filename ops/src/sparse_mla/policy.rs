//! How the bf16 launchers divide each token's top-k among blocks and merge the parts (pure, so it is
//! tested without a GPU).

use super::limits::{MAX_SPLITS, MAX_TILES_PER_SPLIT};

/// Most splits merged in a thread-block cluster. On the H200 clusters of 2 merge faster than the
/// combine kernel, of 4 as fast, of 16 slower, even as a first level before the combine.
pub const MAX_MERGE_CLUSTER: usize = 4;

/// Flash-decoding: split the top-k of `tiles` tiles when `blocks` blocks alone would leave SMs idle.
/// The split minimises waves x (tiles per block + a block's fixed cost in tiles: Q, index and
/// block-table loads, the epilogue) -- a last, partly filled wave costs a whole one -- preferring fewer
/// splits (less to combine; one split needs no combine at all). `resident`: blocks the device runs at
/// once. A block resolves its split's rows up front, so `fits(tiles per split)` says whether its row
/// table fits in shared memory.
pub fn tiles_per_split(
    tiles: usize,
    blocks: usize,
    resident: usize,
    block_cost: usize,
    fits: impl Fn(usize) -> bool,
) -> usize {
    (1..=tiles.min(MAX_SPLITS))
        .map(|splits| tiles.div_ceil(splits))
        .filter(|&per| fits(per))
        .min_by_key(|&per| (blocks * tiles.div_ceil(per)).div_ceil(resident) * (per + block_cost))
        .unwrap_or(MAX_TILES_PER_SPLIT)
}

/// Warps per block of the narrow kernel for `tokens` queries of `top_k` slots, or `None` where its grid
/// (one split of 16 x warps keys per block, every row copied at once) would take more than one wave or
/// more splits than the combine merges. `resident(warps)`: blocks of that size the device holds at once
/// (0 where one does not fit). Of the sizes that fit, the one leaving the fewest keys on the busiest of
/// the `sms` SMs (its copies are the block's time), then the fewest splits to merge, then the smallest.
pub fn narrow_warps(
    tokens: usize,
    top_k: usize,
    sms: usize,
    resident: impl Fn(usize) -> usize,
) -> Option<usize> {
    use super::limits::narrow::{NARROW_KEYS, NARROW_WARPS};
    NARROW_WARPS
        .iter()
        .filter_map(|&warps| {
            let keys = NARROW_KEYS * warps;
            let splits = top_k.div_ceil(keys).max(1);
            let blocks = tokens * splits;
            (splits <= MAX_SPLITS && blocks <= resident(warps)).then(|| {
                let busiest = blocks.div_ceil(sms) * keys.min(top_k);
                (busiest, splits, warps)
            })
        })
        .min()
        .map(|(_, _, warps)| warps)
}

/// Whether a token's `splits` splits are few enough to merge in one thread-block cluster.
pub fn cluster_may_merge(splits: usize) -> bool {
    (2..=MAX_MERGE_CLUSTER).contains(&splits)
}

/// Whether `blocks` clusters of `splits` blocks, `at_once` of which the device runs together, take no
/// more waves than the same blocks launched alone (`resident` at once).
pub fn cluster_keeps_waves(splits: usize, blocks: usize, resident: usize, at_once: usize) -> bool {
    at_once > 0 && blocks.div_ceil(at_once) <= (blocks * splits).div_ceil(resident)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GLM-5's top-k 2048 = 64 tiles of 32 keys, 2 blocks per SM of the H200's 132, a block's fixed
    /// cost of 2 tiles, every split size fitting.
    fn glm5_split(blocks: usize) -> usize {
        tiles_per_split(64, blocks, 264, 2, |_| true)
    }

    #[test]
    fn small_batches_split_until_the_device_is_full() {
        // Batch 1: 64 one-tile blocks (1 + 2 tiles' time) beat 32 two-tile ones (2 + 2).
        assert_eq!(glm5_split(1), 1);
        // Batch 8: 32 splits = 256 blocks, one wave of two-tile blocks; 64 splits would need two waves.
        assert_eq!(glm5_split(8), 2);
        // Batch 64: 4 splits = 256 blocks of 16 tiles; 2 splits (128 blocks of 32) cost 34 > 18.
        assert_eq!(glm5_split(64), 16);
        // Batch 128: 2 splits = 256 blocks, one wave of 32 tiles (34) against one split's 66.
        assert_eq!(glm5_split(128), 32);
        // Batch 512: one split, two waves of 66 (132), against 2 splits' four waves of 34 (136).
        assert_eq!(glm5_split(512), 64);
    }

    #[test]
    fn split_size_respects_the_row_table() {
        // A row table of at most 8 tiles: batch 128 takes 8 splits of 8 tiles instead of 2 of 32.
        assert_eq!(tiles_per_split(64, 128, 264, 2, |per| per <= 8), 8);
        // Nothing fits: the largest split the registry assumes.
        assert_eq!(
            tiles_per_split(64, 1, 264, 2, |_| false),
            MAX_TILES_PER_SPLIT
        );
    }

    /// The H200: 132 SMs holding 1, 2 or 4 narrow blocks of 8, 4 or 2 warps each.
    fn h200_narrow(tokens: usize, top_k: usize) -> Option<usize> {
        narrow_warps(tokens, top_k, 132, |warps| 132 * 8 / warps)
    }

    #[test]
    fn narrow_blocks_fill_the_device_in_one_wave() {
        // Batch 8, top-k 2048: every size puts 128 keys on the busiest SM; 8 warps have the fewest splits.
        assert_eq!(h200_narrow(8, 2048), Some(8));
        // Batch 1: 64 blocks of 32 keys spread the rows over the most SMs.
        assert_eq!(h200_narrow(1, 2048), Some(2));
        // Batch 3: 96 blocks of 64 keys, as few on the busiest SM as 192 of 32 and half the splits.
        assert_eq!(h200_narrow(3, 2048), Some(4));
        // A short top-k: one split, no combine.
        assert_eq!(h200_narrow(8, 7), Some(2));
        // Batch 64 would take several waves; 24,576 slots more splits than the combine merges.
        assert_eq!(h200_narrow(64, 2048), None);
        assert_eq!(h200_narrow(1, 24576), None);
        // A size that does not fit the device is never picked.
        assert_eq!(
            narrow_warps(8, 2048, 132, |w| if w == 8 { 0 } else { 132 * 8 / w }),
            Some(4)
        );
    }

    #[test]
    fn clusters_merge_a_few_splits_without_adding_waves() {
        assert!(!cluster_may_merge(1));
        assert!(cluster_may_merge(2) && cluster_may_merge(MAX_MERGE_CLUSTER));
        assert!(!cluster_may_merge(MAX_MERGE_CLUSTER + 1));
        // 128 tokens x 2 splits: 256 blocks are one wave of 264; 132 clusters of 2 at once keep it one.
        assert!(cluster_keeps_waves(2, 128, 264, 132));
        // ... 60 clusters at once would take three waves.
        assert!(!cluster_keeps_waves(2, 128, 264, 60));
        // A size the device cannot form.
        assert!(!cluster_keeps_waves(2, 128, 264, 0));
    }
}
