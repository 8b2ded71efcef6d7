//! `write_attention_rows`: a layer's three row steps between its projections and the indexer, for the same
//! tokens, in one call: the latent rows ([`crate::latent_rows`]), the indexer keys
//! ([`crate::index_key_rows`]) and the indexer query's RoPE ([`crate::rope_leading`]).
//!
//! # Contract
//!
//! Each step's inputs and result as its own op's contract says, with the RoPE tables `cos`, `sin`
//! `[T, R / 2]` shared (one position per token) and one [`CacheRows`] for both cache writes (a token's latent
//! row and key are stored at the same position). Returns the rotated indexer query `[T, H, D]`.
//!
//! # Implementations
//!
//! The three ops one after another (three launches on CUDA, more by their candle-op references elsewhere).
//! On CUDA for bf16 and f32, keys of at most [`crate::index_key_rows::MAX_CUDA_DIM`] values (even), one
//! kernel (`attention_rows_*` in `kernels/src/attention_rows.cu`): at decode each step is a few KB of work,
//! so a launch's start-up latency, not its bytes, was each one's time.

use candle_core::Tensor;

use crate::cache_rows::CacheRows;
use crate::error::Result;
use crate::index_key_rows::write_index_key_rows;
use crate::index_keys::IndexKeys;
use crate::latent_rows::write_latent_rows;
use crate::rope_leading::rope_leading;

#[cfg(feature = "cuda")]
mod cuda;

/// The latent rows' step: `kv_a` `[T, lora + R]`, `kv_a_layernorm`'s weight `[lora]` and epsilon, and the
/// latent cache `[N, lora + R]` (`latent_rows`' contract).
#[derive(Clone, Copy)]
pub struct LatentRowsStep<'a> {
    pub kv_a: &'a Tensor,
    pub norm_weight: &'a Tensor,
    pub eps: f64,
    pub cache: &'a Tensor,
}

/// The indexer keys' step: `wk`'s output `[T, D]`, `k_norm`'s weight and bias `[D]` and epsilon, and the key
/// cache (`index_key_rows`' contract).
#[derive(Clone, Copy)]
pub struct IndexKeyStep<'a> {
    pub k: &'a Tensor,
    pub layer_norm: (&'a Tensor, &'a Tensor),
    pub eps: f64,
    pub cache: IndexKeys<'a>,
}

/// Writes the latent rows and the indexer keys of the call's tokens at `rows` and returns the indexer query
/// `index_q` `[T, H, D]` with RoPE on its leading dims (contract above).
pub fn write_attention_rows(
    latent: LatentRowsStep<'_>,
    key: IndexKeyStep<'_>,
    index_q: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    rows: CacheRows<'_>,
) -> Result<Tensor> {
    crate::latent_rows::check(
        latent.kv_a,
        latent.norm_weight,
        (cos, sin),
        latent.cache,
        rows,
    )?;
    crate::index_key_rows::check(key.k, key.layer_norm, (cos, sin), key.cache, rows)?;
    // Each check ties its op's tokens and dtype to the shared tables': together they agree.
    crate::rope_leading::check_tables("index_q", index_q, cos, sin)?;
    #[cfg(feature = "cuda")]
    if index_q.device().is_cuda()
        && index_q.dim(0)? > 0
        && matches!(
            index_q.dtype(),
            candle_core::DType::BF16 | candle_core::DType::F32
        )
        && key.k.dim(1)? <= crate::index_key_rows::MAX_CUDA_DIM
        && key.k.dim(1)? % 2 == 0
    {
        return cuda::write_attention_rows(latent, key, index_q, (cos, sin), rows);
    }
    write_latent_rows(
        latent.kv_a,
        latent.norm_weight,
        latent.eps,
        (cos, sin),
        latent.cache,
        rows,
    )?;
    write_index_key_rows(key.k, key.layer_norm, key.eps, (cos, sin), key.cache, rows)?;
    rope_leading(index_q, cos, sin)
}
