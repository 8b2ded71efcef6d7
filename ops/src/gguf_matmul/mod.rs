//! `gguf_matmul(x, w) -> y`: a linear layer whose weight stays in one of the GGUF block formats glm5 decodes
//! itself: llama.cpp's i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS) and the
//! K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), multiplied with the weight dequantised in the kernel (weight-only:
//! activations are not quantised, except Q4_K times one bf16 row on CUDA, below).
//!
//! candle 0.11 has no i-quant types (`GgmlDType` cannot hold them), and the published GLM-5 GGUFs use them
//! (unsloth's `UD-IQ*` files, IQ4_XS / IQ3_S / IQ2_S expert mixes), so glm5 keeps their blocks as raw bytes
//! and decodes them itself. candle has the K-quants, the bulk of Q4_K_M, Q5_K_M and `UD-Q2_K_XL`, but its CUDA
//! mat-vec reads GLM-5's Q4_K projections at 19-30% of the copy bandwidth (`glm5-bench matvec`) and
//! candle-nn's GGUF MoE kernels its experts at 2-14x their floor, so they are decoded here too; Q8_0 and the
//! legacy 32-value types stay with candle's `QMatMul` (`quantized_matmul`).
//!
//! # Contract
//!
//! * `w` is [`GgufWeight`]: `blocks` `U8 [out, in / block_values · block_bytes]`, each row the ggml blocks of
//!   one output row exactly as the GGUF file stores them, and its [`GgufFormat`]. `in` is a multiple of the
//!   format's block (256 values; IQ4_NL: 32).
//! * The weight stands for the values ggml's own dequantisation gives (`dequantize_row_iq*` in ggml-quants.c;
//!   the formats in [`reference`], the lookup tables in `glm5_kernels::iq_grids`), computed in f32 in ggml's
//!   order, so they equal gguf-py's `quants.dequantize` bit for bit.
//! * `x` is `[.., in]`, f32 or bf16 (f16 is converted to f32 first); `y = x · Wᵀ`, `[.., out]`, in `x`'s dtype,
//!   accumulated in f32.
//! * CPU: the reference ([`reference::dequantize`] to f32, then a matmul). CUDA: rows `<= MAX_ROWS` run the
//!   mat-vec kernel (each weight byte read once, decoded in registers); more rows dequantise the matrix to
//!   `x`'s dtype in a transient buffer and use candle's matmul.
//! * CUDA, Q4_K times one bf16 row (batch-1 decode): on the int8 tensor cores, `x` quantised per 32 values as
//!   llama.cpp's mat-vecs quantise it (its q8_1: d = max |x| / 127, q = x / d rounded half to even), so `y` is
//!   `(d · q) · Wᵀ` accumulated in f32: ~0.4% of a projection's scale from `x · Wᵀ`, as llama.cpp's.
//! * Which implementation runs is checked per weight when the graph is built ([`dispatch`]).

mod entries;
pub mod reference;

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

pub use entries::{backends, dispatch};

use candle_core::{DType, Tensor};

use crate::error::{OpError, Result};

/// Rows of `x` the CUDA mat-vec kernel takes in one launch.
pub const MAX_ROWS: usize = glm5_kernels::interface::weight_only::MAX_ROWS;

/// Values sharing one scale (and decoded together) inside a block: the kernels' unit of work.
pub const SUB_BLOCK: usize = 32;

/// One of the GGUF block formats glm5 decodes: its name, ggml type id and block geometry (ggml-common.h's
/// `block_iq*`, `block_q2_K` ... `block_q6_K`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufFormat {
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    Iq1M,
    /// Q4_K, a K-quant (candle has it, but its CUDA mat-vec reaches 19-30% of the copy bandwidth on GLM-5's
    /// projections; this family's reaches the FP8/NVFP4 mat-vecs' rate).
    Q4K,
    /// Q6_K, the K-quant a Q4_K_M file keeps for `output` and about half the `ffn_down` (candle has it too;
    /// in this family a layer mixing it with Q4_K runs every projection on glm5's kernels).
    Q6K,
    /// Q2_K, Q3_K: the routed experts of unsloth's `UD-Q2_K_XL` (gate/up, down); Q5_K: Q5_K_M's. candle has
    /// them; in this family their experts run glm5's grouped kernels, not candle-nn's.
    Q2K,
    Q3K,
    Q5K,
}

impl GgufFormat {
    pub const ALL: [GgufFormat; 14] = [
        GgufFormat::Iq2Xxs,
        GgufFormat::Iq2Xs,
        GgufFormat::Iq3Xxs,
        GgufFormat::Iq1S,
        GgufFormat::Iq4Nl,
        GgufFormat::Iq3S,
        GgufFormat::Iq2S,
        GgufFormat::Iq4Xs,
        GgufFormat::Iq1M,
        GgufFormat::Q4K,
        GgufFormat::Q6K,
        GgufFormat::Q2K,
        GgufFormat::Q3K,
        GgufFormat::Q5K,
    ];

    /// The format of ggml type id `id`, if glm5 decodes it.
    pub fn from_ggml_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.ggml_id() == id)
    }

    /// `GGMLQuantizationType` id.
    pub fn ggml_id(self) -> u32 {
        match self {
            GgufFormat::Iq2Xxs => 16,
            GgufFormat::Iq2Xs => 17,
            GgufFormat::Iq3Xxs => 18,
            GgufFormat::Iq1S => 19,
            GgufFormat::Iq4Nl => 20,
            GgufFormat::Iq3S => 21,
            GgufFormat::Iq2S => 22,
            GgufFormat::Iq4Xs => 23,
            GgufFormat::Iq1M => 29,
            GgufFormat::Q4K => 12,
            GgufFormat::Q6K => 14,
            GgufFormat::Q2K => 10,
            GgufFormat::Q3K => 11,
            GgufFormat::Q5K => 13,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgufFormat::Iq2Xxs => "IQ2_XXS",
            GgufFormat::Iq2Xs => "IQ2_XS",
            GgufFormat::Iq3Xxs => "IQ3_XXS",
            GgufFormat::Iq1S => "IQ1_S",
            GgufFormat::Iq4Nl => "IQ4_NL",
            GgufFormat::Iq3S => "IQ3_S",
            GgufFormat::Iq2S => "IQ2_S",
            GgufFormat::Iq4Xs => "IQ4_XS",
            GgufFormat::Iq1M => "IQ1_M",
            GgufFormat::Q4K => "Q4_K",
            GgufFormat::Q6K => "Q6_K",
            GgufFormat::Q2K => "Q2_K",
            GgufFormat::Q3K => "Q3_K",
            GgufFormat::Q5K => "Q5_K",
        }
    }

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            GgufFormat::Iq4Nl => 32,
            _ => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgufFormat::Iq2Xxs => 66,
            GgufFormat::Iq2Xs => 74,
            GgufFormat::Iq3Xxs => 98,
            GgufFormat::Iq1S => 50,
            GgufFormat::Iq4Nl => 18,
            GgufFormat::Iq3S => 110,
            GgufFormat::Iq2S => 82,
            GgufFormat::Iq4Xs => 136,
            GgufFormat::Iq1M => 56,
            GgufFormat::Q4K => 144,
            GgufFormat::Q6K => 210,
            GgufFormat::Q2K => 84,
            GgufFormat::Q3K => 110,
            GgufFormat::Q5K => 176,
        }
    }

    /// Writes `d` (f16 bits), the block's super-scale, where the format keeps it: the first two bytes, Q6_K's
    /// last two, IQ1_M's split over the top nibbles of its four scale words (bytes 48..56). For random blocks
    /// (tests, benches) whose scale must be finite.
    pub fn set_super_scale(self, block: &mut [u8], d: u16) {
        match self {
            GgufFormat::Iq1M => {
                for i in 0..4 {
                    let at = 48 + 2 * i;
                    let word = u16::from_le_bytes([block[at], block[at + 1]]);
                    let word = (word & 0x0fff) | (((d >> (4 * i)) & 0xf) << 12);
                    block[at..at + 2].copy_from_slice(&word.to_le_bytes());
                }
            }
            GgufFormat::Q6K => block[208..210].copy_from_slice(&d.to_le_bytes()),
            GgufFormat::Q2K => block[80..82].copy_from_slice(&d.to_le_bytes()),
            GgufFormat::Q3K => block[108..110].copy_from_slice(&d.to_le_bytes()),
            _ => block[..2].copy_from_slice(&d.to_le_bytes()),
        }
    }

    /// Writes `dmin` (f16 bits), the scale of the block's mins, where the format has one (Q2_K, Q4_K, Q5_K;
    /// the others have none and are left as they are).
    pub fn set_min_scale(self, block: &mut [u8], dmin: u16) {
        let at = match self {
            GgufFormat::Q4K | GgufFormat::Q5K => 2,
            GgufFormat::Q2K => 82,
            _ => return,
        };
        block[at..at + 2].copy_from_slice(&dmin.to_le_bytes());
    }

    /// Bytes of one row of `in_dim` values (`None` unless `in_dim` is a whole number of blocks).
    pub fn row_bytes(self, in_dim: usize) -> Option<usize> {
        in_dim
            .is_multiple_of(self.block_values())
            .then(|| in_dim / self.block_values() * self.block_bytes())
    }
}

impl std::fmt::Display for GgufFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// An i-quant weight (module contract).
#[derive(Debug, Clone)]
pub struct GgufWeight {
    pub format: GgufFormat,
    /// `U8 [out, row_bytes(in)]`.
    pub blocks: Tensor,
    /// `in`: values per row.
    pub in_dim: usize,
}

impl GgufWeight {
    /// Checks the bytes hold `[out, in_dim]` values of `format`.
    pub fn new(format: GgufFormat, blocks: Tensor, in_dim: usize) -> Result<Self> {
        let w = Self {
            format,
            blocks,
            in_dim,
        };
        w.check()?;
        Ok(w)
    }

    /// `(out, in)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        Ok((self.blocks.dims2()?.0, self.in_dim))
    }

    /// Checks the parts agree with each other.
    pub fn check(&self) -> Result<()> {
        if self.blocks.dtype() != DType::U8 {
            return Err(OpError::Unsupported(format!(
                "gguf_matmul: {} blocks must be U8, found {:?}",
                self.format,
                self.blocks.dtype()
            )));
        }
        let out = self.blocks.dims2()?.0;
        match self.format.row_bytes(self.in_dim) {
            Some(row) if self.blocks.dims() == [out, row] => Ok(()),
            row => Err(OpError::Shape {
                arg: "blocks",
                expected: match row {
                    Some(row) => format!(
                        "U8 [{out}, {row}] ({} values of {} per row)",
                        self.in_dim, self.format
                    ),
                    None => format!(
                        "in = {} a multiple of {} ({}'s block)",
                        self.in_dim,
                        self.format.block_values(),
                        self.format
                    ),
                },
                found: self.blocks.dims().to_vec(),
            }),
        }
    }
}

/// The CUDA kernel name's stem for `kind` ("matvec", "dequantize") of `format`: `gguf_<kind>_<format>`, as
/// `kernels/src/gguf_matmul.cu`'s `GGUF_KERNELS` names them (the launcher adds `_r1` and the dtype).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the CUDA launcher's, and this module's test
pub(crate) fn kernel_stem(kind: &str, format: GgufFormat) -> String {
    format!("gguf_{kind}_{}", format.name().to_ascii_lowercase())
}

/// `x · Wᵀ` in `x`'s dtype (see the module contract).
pub fn gguf_matmul(x: &Tensor, w: &GgufWeight) -> Result<Tensor> {
    crate::weight_only::apply("gguf_matmul", x, w.dims()?, |x2| {
        #[cfg(feature = "cuda")]
        if x2.device().is_cuda() {
            return cuda::gguf_matmul(&x2.contiguous()?, w);
        }
        reference::gguf_matmul(x2, w)
    })
}

/// [`gguf_matmul`] without the tensor-core kernels (Q4_K with bf16 rows takes the FFMA mat-vec as the other
/// formats do): the matvec bench's comparison of the two on one device.
#[doc(hidden)]
pub fn gguf_matmul_on_cuda_cores(x: &Tensor, w: &GgufWeight) -> Result<Tensor> {
    crate::weight_only::apply("gguf_matmul", x, w.dims()?, |x2| {
        #[cfg(feature = "cuda")]
        if x2.device().is_cuda() {
            return cuda::gguf_matmul_with(&x2.contiguous()?, w, false);
        }
        reference::gguf_matmul(x2, w)
    })
}

/// The whole weight as `dtype` on its device (the reference's f32 values, rounded once to `dtype`).
pub fn dequantize(w: &GgufWeight, dtype: DType) -> Result<Tensor> {
    w.check()?;
    if w.blocks.device().is_cuda() {
        #[cfg(feature = "cuda")]
        {
            return cuda::dequantize(w, dtype);
        }
    }
    Ok(reference::dequantize(w)?.to_dtype(dtype)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names the CUDA launcher asks for are the ones the kernel source defines (a rename on one side
    /// only fails here, on the CPU, not first on a GPU).
    #[test]
    fn launcher_kernel_names_are_the_sources() {
        let source = include_str!("../../../kernels/src/gguf_matmul.cu");
        for kind in ["matvec", "matvec_r1", "dequantize"] {
            let stem = kernel_stem(kind, GgufFormat::Q4K);
            let prefix = stem.trim_end_matches("q4_k");
            assert!(
                source.contains(&format!("{prefix}##NAME##_##SUFFIX(")),
                "gguf_matmul.cu defines no {prefix}<format>_<dtype> kernels"
            );
        }
        for format in GgufFormat::ALL {
            let name = format.name().to_ascii_lowercase();
            assert!(
                source.contains(&format!("GGUF_FORMAT({name}, ")),
                "gguf_matmul.cu instantiates no {name} kernels"
            );
        }
    }
}
