//! CUDA kernel blobs for glm5's custom ops.
//!
//! With the `cuda` feature, `build.rs` compiles every `src/*.cu` into one fatbin (sm_90 + sm_120 SASS and
//! compute_120 PTX) and this crate exposes them as `pub const` byte blobs. Without the feature it is empty:
//! the CPU build needs no CUDA toolchain. No kernel exists yet; the crate is here so the layering
//! (kernels → ops → models → runtime) is in place.
