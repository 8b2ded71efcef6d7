//! The indexer key cache layouts on the CPU: FP8 e4m3 quantisation against hand-computed bytes, and the
//! paged reference against the contiguous one (float and FP8 keys).

use candle_core::{DType, Device, Tensor};
use glm5_ops::{
    dsa_indexer, dsa_indexer_paged, dsa_indexer_paged_device_visible, quantize_fp8, IndexKeys,
    PagedIndexKeys,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

#[test]
fn fp8_bytes_and_scales_match_hand_computed_e4m3() {
    // amax 448 -> scale 1: 448 = 1.75·2^8 -> 0 1111 110; -224 = -1.75·2^7 -> 1 1110 110; 1 -> 0 0111 000;
    // 0.5 -> 0 0110 000; 0 -> 0. Second key: amax 2 -> scale 2/448, so 2 -> 448 and -1 -> -224. Third: zeros
    // -> scale 1.
    let keys = Tensor::new(
        &[
            [448f32, -224.0, 1.0, 0.5, 0.0],
            [2.0, -1.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ],
        &Device::Cpu,
    )
    .unwrap();
    let (bytes, scales) = quantize_fp8(&keys).unwrap();
    assert_eq!(
        bytes.to_vec2::<u8>().unwrap(),
        [
            [0x7E, 0xF6, 0x38, 0x30, 0x00],
            [0x7E, 0xF6, 0x00, 0x00, 0x00],
            [0, 0, 0, 0, 0]
        ]
    );
    assert_eq!(scales.to_vec1::<f32>().unwrap(), [1.0, 2.0 / 448.0, 1.0]);
    // Dequantised: exactly the inputs here (all representable).
    let back = IndexKeys::Fp8 {
        bytes: &bytes,
        scales: &scales,
    }
    .dequantize()
    .unwrap();
    assert_eq!(
        back.to_vec2::<f32>().unwrap(),
        keys.to_vec2::<f32>().unwrap()
    );
}

#[test]
fn fp8_round_trip_error_is_within_e4m3_precision() {
    let mut rng = StdRng::seed_from_u64(3);
    let values: Vec<f32> = (0..64 * 128)
        .map(|_| rng.random_range(-3.0f32..3.0))
        .collect();
    let keys = Tensor::from_vec(values.clone(), (64, 128), &Device::Cpu).unwrap();
    let (bytes, scales) = quantize_fp8(&keys).unwrap();
    let back = IndexKeys::Fp8 {
        bytes: &bytes,
        scales: &scales,
    }
    .dequantize()
    .unwrap()
    .to_vec2::<f32>()
    .unwrap();
    for (row, got) in values.chunks(128).zip(&back) {
        let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (x, y) in row.iter().zip(got) {
            // 3 mantissa bits: half an ulp is 2^-4 relative; subnormals (below 2^-6 of the scale) are
            // absolute steps of 2^-9 · scale.
            let tolerance = (x.abs() / 16.0).max(amax / 448.0 * 2f32.powi(-10));
            assert!(
                (x - y).abs() <= tolerance * 1.0001,
                "{x} -> {y} (amax {amax})"
            );
        }
    }
}

/// Keys of `seqs` sequences in shuffled blocks of `block_size`; returns the blocks, block table and the
/// per-sequence contiguous keys.
fn paged(
    rng: &mut StdRng,
    lens: &[usize],
    dim: usize,
    block_size: usize,
) -> (Tensor, Tensor, Vec<Tensor>) {
    let max_blocks = lens.iter().max().unwrap().div_ceil(block_size);
    let num_blocks = lens.len() * max_blocks;
    let mut order: Vec<i32> = (0..num_blocks as i32).collect();
    order.shuffle(rng);
    let mut blocks = vec![0f32; num_blocks * block_size * dim];
    let mut contiguous = Vec::new();
    for (b, &len) in lens.iter().enumerate() {
        let keys: Vec<f32> = (0..len * dim)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        for s in 0..len {
            let row = order[b * max_blocks + s / block_size] as usize * block_size + s % block_size;
            blocks[row * dim..][..dim].copy_from_slice(&keys[s * dim..][..dim]);
        }
        contiguous.push(Tensor::from_vec(keys, (len, dim), &Device::Cpu).unwrap());
    }
    (
        Tensor::from_vec(blocks, (num_blocks, block_size, dim), &Device::Cpu).unwrap(),
        Tensor::from_vec(order, (lens.len(), max_blocks), &Device::Cpu).unwrap(),
        contiguous,
    )
}

fn sorted_rows(t: &Tensor) -> Vec<Vec<i32>> {
    t.to_vec2::<i32>()
        .unwrap()
        .into_iter()
        .map(|mut r| {
            r.sort();
            r
        })
        .collect()
}

#[test]
fn paged_keys_select_what_the_contiguous_keys_select() {
    let mut rng = StdRng::seed_from_u64(11);
    let (heads, dim, top_k, block_size) = (4, 16, 8, 4);
    let lens = [23usize, 9];
    let (blocks, block_table, contiguous) = paged(&mut rng, &lens, dim, block_size);
    // Two queries per sequence; the second of sequence 0 sees only part of it.
    let token_seq = [0i32, 0, 1, 1];
    let visible = [23usize, 17, 9, 3];
    let q = Tensor::rand(-1f32, 1.0, (4, heads, dim), &Device::Cpu).unwrap();
    let w = Tensor::rand(-1f32, 1.0, (4, heads), &Device::Cpu).unwrap();
    let token_seq_t = Tensor::new(&token_seq, &Device::Cpu).unwrap();
    let got = dsa_indexer_paged(
        &q,
        &w,
        &PagedIndexKeys {
            keys: IndexKeys::Float(&blocks),
            block_table: &block_table,
            token_seq: &token_seq_t,
        },
        &visible,
        top_k,
    )
    .unwrap();
    for t in 0..4 {
        let want = dsa_indexer(
            &q.narrow(0, t, 1).unwrap(),
            &w.narrow(0, t, 1).unwrap(),
            &contiguous[token_seq[t] as usize],
            &visible[t..t + 1],
            top_k,
        )
        .unwrap();
        assert_eq!(
            got.narrow(0, t, 1).unwrap().to_vec2::<i32>().unwrap(),
            want.to_vec2::<i32>().unwrap(),
            "query {t}"
        );
    }

    // FP8 keys select what their dequantised values select.
    let flat = blocks.reshape(((), dim)).unwrap();
    let (bytes, scales) = quantize_fp8(&flat).unwrap();
    let bytes = bytes.reshape(blocks.dims()).unwrap();
    let scales = scales
        .reshape((blocks.dim(0).unwrap(), block_size))
        .unwrap();
    let fp8 = dsa_indexer_paged(
        &q,
        &w,
        &PagedIndexKeys {
            keys: IndexKeys::Fp8 {
                bytes: &bytes,
                scales: &scales,
            },
            block_table: &block_table,
            token_seq: &token_seq_t,
        },
        &visible,
        top_k,
    )
    .unwrap();
    let dequantized = IndexKeys::Fp8 {
        bytes: &bytes,
        scales: &scales,
    }
    .dequantize()
    .unwrap();
    let floats = dsa_indexer_paged(
        &q,
        &w,
        &PagedIndexKeys {
            keys: IndexKeys::Float(&dequantized),
            block_table: &block_table,
            token_seq: &token_seq_t,
        },
        &visible,
        top_k,
    )
    .unwrap();
    assert_eq!(sorted_rows(&fp8), sorted_rows(&floats));
    assert_eq!(fp8.dtype(), DType::I32);
}

#[test]
fn paged_input_errors_name_the_argument() {
    let dev = Device::Cpu;
    let blocks = Tensor::zeros((2, 4, 16), DType::F32, &dev).unwrap();
    let q = Tensor::zeros((1, 2, 16), DType::F32, &dev).unwrap();
    let w = Tensor::zeros((1, 2), DType::F32, &dev).unwrap();
    let table = Tensor::new(&[[0i32, 1]], &dev).unwrap();
    let bad_seq = Tensor::new(&[3i32], &dev).unwrap();
    let cache = PagedIndexKeys {
        keys: IndexKeys::Float(&blocks),
        block_table: &table,
        token_seq: &bad_seq,
    };
    let err = dsa_indexer_paged(&q, &w, &cache, &[4], 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("token_seq"), "{err}");
    let seq = Tensor::new(&[0i32], &dev).unwrap();
    let cache = PagedIndexKeys {
        token_seq: &seq,
        ..cache
    };
    let err = dsa_indexer_paged(&q, &w, &cache, &[9], 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("visible_keys[0] = 9"), "{err}");
    let floats = Tensor::zeros((2, 4), DType::F32, &dev).unwrap();
    let cache = PagedIndexKeys {
        keys: IndexKeys::Fp8 {
            bytes: &blocks,
            scales: &floats,
        },
        ..cache
    };
    let err = dsa_indexer_paged(&q, &w, &cache, &[4], 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("U8"), "{err}");
}

#[test]
fn device_visible_counts_select_what_host_counts_select() {
    let mut rng = StdRng::seed_from_u64(12);
    let (heads, dim, top_k, block_size) = (4, 16, 8, 4);
    let lens = [23usize, 9];
    let (blocks, block_table, _) = paged(&mut rng, &lens, dim, block_size);
    let token_seq = Tensor::new(&[0i32, 0, 1, 1], &Device::Cpu).unwrap();
    let q = Tensor::rand(-1f32, 1.0, (4, heads, dim), &Device::Cpu).unwrap();
    let w = Tensor::rand(-1f32, 1.0, (4, heads), &Device::Cpu).unwrap();
    let cache = PagedIndexKeys {
        keys: IndexKeys::Float(&blocks),
        block_table: &block_table,
        token_seq: &token_seq,
    };
    // Counts above the bound (30 > 20) are read as the bound, negative ones as 0.
    let counts = Tensor::new(&[30i32, 17, 9, -2], &Device::Cpu).unwrap();
    let got = dsa_indexer_paged_device_visible(&q, &w, &cache, &counts, 20, top_k).unwrap();
    let want = dsa_indexer_paged(&q, &w, &cache, &[20, 17, 9, 0], top_k).unwrap();
    assert_eq!(
        got.to_vec2::<i32>().unwrap(),
        want.to_vec2::<i32>().unwrap()
    );
    assert_eq!(got.to_vec2::<i32>().unwrap()[3], vec![-1; top_k]);

    // The counts' dtype and length, and the bound against the cache's capacity (2 blocks of 4 per
    // sequence here is 4 * max_blocks), are checked.
    let err = dsa_indexer_paged_device_visible(
        &q,
        &w,
        &cache,
        &counts.to_dtype(DType::F32).unwrap(),
        20,
        top_k,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("visible"), "{err}");
    let short = Tensor::new(&[3i32, 3], &Device::Cpu).unwrap();
    let err = dsa_indexer_paged_device_visible(&q, &w, &cache, &short, 20, top_k)
        .unwrap_err()
        .to_string();
    assert!(err.contains("visible"), "{err}");
    let capacity = block_table.dim(1).unwrap() * block_size;
    let err = dsa_indexer_paged_device_visible(&q, &w, &cache, &counts, capacity + 1, top_k)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("exceeds the key count {capacity}")),
        "{err}"
    );
}
