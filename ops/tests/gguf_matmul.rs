//! The i-quant decoders against gguf-py's numpy dequantisation (ggml's own Python reader; fixture made by
//! tests/fixtures/gguf/make_iq_fixtures.py): every value of random blocks of every format, bit for bit; and
//! `gguf_matmul` on the CPU against the product with those values.

#[allow(dead_code)]
mod common;

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use glm5_ops::gguf_matmul::{self, reference, GgufFormat, GgufWeight};
use glm5_ops::{DeviceDesc, OpError};

fn fixture() -> std::collections::HashMap<String, Tensor> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/gguf/iq-blocks.safetensors");
    candle_core::safetensors::load(path, &Device::Cpu).expect("iq-blocks.safetensors")
}

fn parts(
    fixture: &std::collections::HashMap<String, Tensor>,
    format: GgufFormat,
) -> (Tensor, Tensor) {
    (
        fixture[&format!("{}.blocks", format.name())].clone(),
        fixture[&format!("{}.values", format.name())].clone(),
    )
}

#[test]
fn every_format_decodes_exactly_as_gguf_py() {
    let fixture = fixture();
    for format in GgufFormat::ALL {
        let (blocks, values) = parts(&fixture, format);
        let bytes = blocks.flatten_all().unwrap().to_vec1::<u8>().unwrap();
        let ours = reference::dequantize_bytes(format, &bytes);
        let theirs = values.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(ours.len(), theirs.len(), "{format}");
        let differing: Vec<(usize, f32, f32)> = ours
            .iter()
            .zip(&theirs)
            .enumerate()
            .filter(|(_, (a, b))| a.to_bits() != b.to_bits() && !(**a == 0.0 && **b == 0.0))
            .map(|(i, (a, b))| (i, *a, *b))
            .take(5)
            .collect();
        assert!(
            differing.is_empty(),
            "{format}: (index, glm5, gguf-py) {differing:?}"
        );
        // The fixture is not degenerate: many distinct values, both signs.
        let distinct: std::collections::BTreeSet<u32> =
            theirs.iter().map(|v| v.to_bits()).collect();
        assert!(
            distinct.len() > 200,
            "{format}: {} distinct values",
            distinct.len()
        );
        assert!(theirs.iter().any(|&v| v < 0.0) && theirs.iter().any(|&v| v > 0.0));
    }
}

#[test]
fn gguf_matmul_on_the_cpu_is_the_product_with_the_decoded_values() {
    let fixture = fixture();
    let mut rng = common::rng(7);
    for format in GgufFormat::ALL {
        let (blocks, values) = parts(&fixture, format);
        let (out, inp) = values.dims2().unwrap();
        let w = GgufWeight::new(format, blocks, inp).unwrap();
        assert_eq!(
            gguf_matmul::dispatch(&w, &DeviceDesc::cpu(1 << 30))
                .unwrap()
                .decode
                .name,
            "gguf-reference-cpu"
        );
        for rows in [1, 3] {
            let x = common::uniform(&mut rng, rows * inp);
            let y = gguf_matmul::gguf_matmul(
                &Tensor::from_vec(x.clone(), (rows, inp), &Device::Cpu).unwrap(),
                &w,
            )
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
            let wv = values.to_vec2::<f32>().unwrap();
            for r in 0..rows {
                for o in 0..out {
                    let exact: f64 = (0..inp)
                        .map(|i| x[r * inp + i] as f64 * wv[o][i] as f64)
                        .sum();
                    let scale: f64 = (0..inp)
                        .map(|i| (x[r * inp + i] as f64 * wv[o][i] as f64).abs())
                        .sum();
                    assert!(
                        (y[r][o] as f64 - exact).abs() <= 1e-5 * scale.max(f64::MIN_POSITIVE),
                        "{format} row {r} out {o}: {} vs {exact}",
                        y[r][o]
                    );
                }
            }
        }
        // bf16 activations: the output comes back in bf16.
        let x = Tensor::ones((2, inp), DType::BF16, &Device::Cpu).unwrap();
        assert_eq!(
            gguf_matmul::gguf_matmul(&x, &w).unwrap().dtype(),
            DType::BF16
        );
    }
}

#[test]
fn malformed_weights_are_typed_errors() {
    let bytes = Tensor::zeros((4, 136), DType::U8, &Device::Cpu).unwrap();
    // 256 values of IQ4_XS are 136 bytes: 512 would need 272.
    let err = GgufWeight::new(GgufFormat::Iq4Xs, bytes.clone(), 512).unwrap_err();
    assert!(matches!(err, OpError::Shape { arg: "blocks", .. }), "{err}");
    assert!(err.to_string().contains("272"), "{err}");
    // Not a whole number of blocks.
    let err = GgufWeight::new(GgufFormat::Iq4Xs, bytes.clone(), 100).unwrap_err();
    assert!(err.to_string().contains("multiple of 256"), "{err}");
    // Not bytes.
    let err =
        GgufWeight::new(GgufFormat::Iq4Xs, bytes.to_dtype(DType::F32).unwrap(), 256).unwrap_err();
    assert!(err.to_string().contains("U8"), "{err}");
    // x of the wrong width.
    let w = GgufWeight::new(GgufFormat::Iq4Xs, bytes, 256).unwrap();
    let x = Tensor::zeros((1, 128), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        gguf_matmul::gguf_matmul(&x, &w),
        Err(OpError::Shape { arg: "x", .. })
    ));
    // Integer activations.
    let x = Tensor::zeros((1, 256), DType::U8, &Device::Cpu).unwrap();
    assert!(matches!(
        gguf_matmul::gguf_matmul(&x, &w),
        Err(OpError::NotFloat { .. })
    ));
}

#[test]
fn formats_round_trip_through_their_ggml_ids() {
    for format in GgufFormat::ALL {
        assert_eq!(GgufFormat::from_ggml_id(format.ggml_id()), Some(format));
        assert_eq!(
            format.row_bytes(format.block_values()),
            Some(format.block_bytes())
        );
    }
    assert_eq!(GgufFormat::from_ggml_id(8), None); // Q8_0
}

#[test]
fn dispatch_names_the_backend_per_device_with_reasons() {
    let bytes = Tensor::zeros((4, 136), DType::U8, &Device::Cpu).unwrap();
    let w = GgufWeight::new(GgufFormat::Iq4Xs, bytes, 256).unwrap();
    for arch in ["sm_90", "sm_120"] {
        let device = DeviceDesc::assume(&format!("{arch}:96GB"), 0).unwrap();
        assert_eq!(
            gguf_matmul::dispatch(&w, &device).unwrap().decode.name,
            "gguf-w16-cuda",
            "{arch}"
        );
    }
    // No kernel is built for sm_80: the error names every backend and why.
    let err = gguf_matmul::dispatch(&w, &DeviceDesc::assume("sm_80:80GB", 0).unwrap()).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("gguf-w16-cuda") && text.contains("compute capability"),
        "{text}"
    );
    assert!(text.contains("gguf-reference-cpu"), "{text}");
}
