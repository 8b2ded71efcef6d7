//! The backend registry and the dispatch rule, from outside the crate: built-in choices per device family
//! with GLM-5's real shapes and tiny ones, every reason a backend gives, forced choices, no valid backend,
//! and a fake backend registered here and chosen.

use candle_core::DType;
use glm5_ops::device::{known_shared_memory, parse_bytes, STATIC_SHARED_RESERVE};
use glm5_ops::registry::{Arch, DeviceMatch, Kernel, Limit, Serves};
use glm5_ops::{
    CacheLayout, ComputeCapability, DeviceDesc, DeviceFamily, DeviceKind, DispatchError, Entry,
    KeyFormat, Op, OpSpec, Reason, Registry, Verdict,
};

const GIB: u64 = 1 << 30;

/// GLM-5's sparse_mla: 64 heads over 512 + 64 latent rows, value width 512, top-k 2048 (spec §1).
fn glm5_mla(dtype: DType) -> OpSpec {
    OpSpec {
        op: Op::SparseMla,
        dtype,
        heads: 64,
        head_dim: 512 + 64,
        value_dim: Some(512),
        top_k: 2048,
        layout: CacheLayout::Contiguous,
        key_format: KeyFormat::Float,
    }
}

fn gpu(arch: &str) -> DeviceDesc {
    DeviceDesc::assume(&format!("{arch}:96GB"), 0).unwrap()
}

fn reasons_of<'a>(choice: &'a glm5_ops::Choice, backend: &str) -> &'a Verdict {
    &choice
        .rejected
        .iter()
        .find(|r| r.backend == backend)
        .unwrap_or_else(|| panic!("{backend} is not among the rejected: {:?}", choice.rejected))
        .verdict
}

/// The bf16 kernel's shared memory for 16 heads per block, recomputed from the kernel's layout: two K tiles
/// of 32 rows (Q is staged in the second) and the P tile in bf16, rows padded to 16 + 8; the partial scores
/// of 4 warps x 16 rows x (32 + 8) f32 with their row maxima and sums; the 32 x 32 resolved rows.
fn bf16_smem_16_heads(row_dim: usize) -> usize {
    let ld = row_dim.div_ceil(16) * 16 + 8;
    let bf16_elems = 2 * 32 * ld + 16 * (32 + 8);
    bf16_elems * 2 + 4 * 16 * (32 + 8 + 2) * 4 + 32 * 32 * 4
}

#[test]
fn builtin_names_are_unique_per_op_and_every_op_has_a_backend_everywhere() {
    let registry = Registry::builtin();
    for op in Op::ALL {
        let names: Vec<&str> = registry.entries(op).map(|e| e.name).collect();
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(names.len(), unique.len(), "{op}: {names:?}");
        for family in DeviceFamily::ALL {
            assert!(!registry.order(op, family).is_empty(), "{op} on {family}");
        }
    }
    assert_eq!(
        registry
            .order(Op::SparseMla, DeviceFamily::Sm120)
            .iter()
            .map(|e| e.name)
            .collect::<Vec<_>>(),
        ["cuda-bf16-mma", "cuda-f32-fma", "reference"]
    );
}

#[test]
fn glm5_on_cpu_gets_the_reference_and_the_kernels_say_why_not() {
    let registry = Registry::builtin();
    let cpu = DeviceDesc::cpu(64 * GIB);
    for dtype in [DType::F32, DType::BF16] {
        let choice = registry.dispatch(&glm5_mla(dtype), &cpu, None).unwrap();
        assert_eq!(choice.entry.name, "reference");
        assert!(!choice.forced);
        let Verdict::Invalid(reasons) = reasons_of(&choice, "cuda-bf16-mma") else {
            panic!()
        };
        assert_eq!(reasons[0].what, "device");
        assert_eq!(reasons[0].got, "cpu");
        assert_eq!(reasons.len(), if dtype == DType::BF16 { 1 } else { 2 });
    }
}

#[test]
fn glm5_on_sm90_and_sm120_gets_the_kernel_of_its_dtype() {
    let registry = Registry::builtin();
    for arch in ["sm_90", "sm_120", "sm_121"] {
        let device = gpu(arch);
        let bf16 = registry
            .dispatch(&glm5_mla(DType::BF16), &device, None)
            .unwrap();
        // Hopper runs GLM-5's 64 heads through wgmma; the workstation parts have no wgmma.
        let (chosen, wgmma) = if arch == "sm_90" {
            ("cuda-bf16-wgmma", None)
        } else {
            ("cuda-bf16-mma", Some(arch))
        };
        assert_eq!(bf16.entry.name, chosen, "{arch}");
        assert_eq!(
            reasons_of(&bf16, "reference"),
            &Verdict::Outranked { by: chosen }
        );
        if let Some(arch) = wgmma {
            let Verdict::Invalid(reasons) = reasons_of(&bf16, "cuda-bf16-wgmma") else {
                panic!("{arch}")
            };
            assert_eq!(reasons[0].what, "compute capability", "{arch}");
        } else {
            assert_eq!(
                reasons_of(&bf16, "cuda-bf16-mma"),
                &Verdict::Outranked {
                    by: "cuda-bf16-wgmma"
                }
            );
        }
        let Verdict::Invalid(reasons) = reasons_of(&bf16, "cuda-f32-fma") else {
            panic!()
        };
        assert_eq!(reasons, &[Reason::new("dtype", "∈ {f32}", "bf16")]);
        let f32 = registry
            .dispatch(&glm5_mla(DType::F32), &device, None)
            .unwrap();
        assert_eq!(f32.entry.name, "cuda-f32-fma", "{arch}");
    }
    // GLM-5's rows fit sm_120's 99 KiB opt-in shared memory with 16 heads per block (90880 B).
    assert_eq!(bf16_smem_16_heads(576), 90_880);
    assert!(bf16_smem_16_heads(576) <= 99 * 1024 - STATIC_SHARED_RESERVE);
}

#[test]
fn old_and_other_archs_have_no_valid_kernel_and_fall_to_the_listed_reference() {
    let registry = Registry::builtin();
    for (arch, cc) in [
        ("sm_75", "7.5"),
        ("sm_80", "8.0"),
        ("sm_89", "8.9"),
        ("sm_100", "10.0"),
    ] {
        let device = gpu(arch);
        assert_eq!(device.family(), DeviceFamily::OtherCuda);
        let choice = registry
            .dispatch(&glm5_mla(DType::BF16), &device, None)
            .unwrap();
        assert_eq!(choice.entry.name, "reference", "{arch}");
        for kernel in ["cuda-bf16-mma", "cuda-f32-fma"] {
            let Verdict::Invalid(reasons) = reasons_of(&choice, kernel) else {
                panic!()
            };
            assert!(
                reasons.contains(&Reason::new("compute capability", "∈ {9.0,12.x}", cc)),
                "{arch} {kernel}: {reasons:?}"
            );
        }
    }
}

#[test]
fn tiny_shapes_give_every_reason_at_once() {
    let registry = Registry::builtin();
    // A value width the bf16 kernel is not instantiated for, a row width not a multiple of 8, and a top-k
    // beyond its slots: three reasons from one backend.
    let spec = OpSpec {
        op: Op::SparseMla,
        dtype: DType::BF16,
        heads: 4,
        head_dim: 60,
        value_dim: Some(48),
        top_k: 200_000,
        layout: CacheLayout::Paged { block_size: 16 },
        key_format: KeyFormat::Float,
    };
    let choice = registry.dispatch(&spec, &gpu("sm_120"), None).unwrap();
    assert_eq!(choice.entry.name, "reference");
    let Verdict::Invalid(reasons) = reasons_of(&choice, "cuda-bf16-mma") else {
        panic!()
    };
    let text: Vec<String> = reasons.iter().map(ToString::to_string).collect();
    assert_eq!(
        text,
        [
            "needs head dim a multiple of 8, got 60",
            "needs value dim ∈ {16,32,64,128,256,512}, got 48",
            "needs top-k in 1..=131072, got 200000",
        ]
    );
    // The tiny embedded model's shapes (4 heads, rows 16 + 8, values 16, top-k 32) suit the kernel.
    let tiny = OpSpec {
        heads: 4,
        head_dim: 24,
        value_dim: Some(16),
        top_k: 32,
        layout: CacheLayout::Contiguous,
        ..spec
    };
    assert_eq!(
        registry
            .dispatch(&tiny, &gpu("sm_90"), None)
            .unwrap()
            .entry
            .name,
        "cuda-bf16-mma"
    );
}

#[test]
fn shared_memory_limits_are_checked_against_the_device() {
    let registry = Registry::builtin();
    // Rows of 1024 (value width 512): 16 heads need more than sm_120's 99 KiB but fit sm_90's 227 KiB; the
    // row is also wider than the kernel holds, on every device.
    let spec = OpSpec {
        head_dim: 1024,
        ..glm5_mla(DType::BF16)
    };
    let needed = bf16_smem_16_heads(1024);
    let sm120_limit = 99 * 1024 - STATIC_SHARED_RESERVE;
    assert!(needed > sm120_limit);
    let choice = registry.dispatch(&spec, &gpu("sm_120"), None).unwrap();
    assert_eq!(choice.entry.name, "reference");
    let Verdict::Invalid(reasons) = reasons_of(&choice, "cuda-bf16-mma") else {
        panic!()
    };
    let too_wide = Reason::new("row width", "≤ value width + 64", "1024 (value width 512)");
    assert_eq!(
        reasons,
        &[
            too_wide.clone(),
            Reason::new(
                "shared memory per block",
                format!("{needed} B for rows of 1024"),
                format!("{sm120_limit} B")
            )
        ]
    );
    let choice = registry.dispatch(&spec, &gpu("sm_90"), None).unwrap();
    assert_eq!(choice.entry.name, "reference");
    assert_eq!(
        reasons_of(&choice, "cuda-bf16-mma"),
        &Verdict::Invalid(vec![too_wide])
    );
}

#[test]
fn glm5_indexer_gets_the_mma_kernel_on_sm90_and_sm120_within_its_limits() {
    let registry = Registry::builtin();
    // GLM-5's indexer: 32 heads of 128, top-k 2048 (spec §1).
    let spec = OpSpec {
        op: Op::DsaIndexer,
        dtype: DType::BF16,
        heads: 32,
        head_dim: 128,
        value_dim: None,
        top_k: 2048,
        layout: CacheLayout::Contiguous,
        key_format: KeyFormat::Float,
    };
    // FP8 keys: the mma kernel scores them; the f32 kernel does not read them, so an f32 model with an FP8
    // key cache gets the reference, told why.
    let fp8 = OpSpec {
        key_format: KeyFormat::Fp8E4m3,
        ..spec.clone()
    };
    assert_eq!(
        registry
            .dispatch(&fp8, &gpu("sm_120"), None)
            .unwrap()
            .entry
            .name,
        "cuda-bf16-mma"
    );
    let fp8_f32 = OpSpec {
        dtype: DType::F32,
        ..fp8.clone()
    };
    let choice = registry.dispatch(&fp8_f32, &gpu("sm_90"), None).unwrap();
    assert_eq!(choice.entry.name, "reference");
    assert_eq!(
        reasons_of(&choice, "cuda-f32-fma"),
        &Verdict::Invalid(vec![Reason::new("key cache format", "∈ {float}", "fp8")])
    );
    for arch in ["sm_90", "sm_120"] {
        let choice = registry.dispatch(&spec, &gpu(arch), None).unwrap();
        assert_eq!(choice.entry.name, "cuda-bf16-mma", "{arch}");
        let f32 = OpSpec {
            dtype: DType::F32,
            ..spec.clone()
        };
        assert_eq!(
            registry
                .dispatch(&f32, &gpu(arch), None)
                .unwrap()
                .entry
                .name,
            "cuda-f32-fma"
        );
    }
    // 64 heads (DeepSeek-V3.2's indexer) exceed the mma kernel's two head tiles.
    let wide = OpSpec {
        heads: 64,
        ..spec.clone()
    };
    let choice = registry.dispatch(&wide, &gpu("sm_90"), None).unwrap();
    assert_eq!(choice.entry.name, "reference");
    assert_eq!(
        reasons_of(&choice, "cuda-bf16-mma"),
        &Verdict::Invalid(vec![Reason::new("heads", "in 1..=32", 64)])
    );
    let choice = registry.dispatch(&spec, &gpu("sm_75"), None).unwrap();
    assert_eq!(choice.entry.name, "reference");
}

#[test]
fn a_forced_backend_is_used_if_valid_and_otherwise_fails_with_its_reasons() {
    let registry = Registry::builtin();
    let device = gpu("sm_120");
    let forced = registry
        .dispatch(&glm5_mla(DType::BF16), &device, Some("reference"))
        .unwrap();
    assert!(forced.forced);
    assert_eq!(forced.entry.name, "reference");
    assert_eq!(
        reasons_of(&forced, "cuda-bf16-mma"),
        &Verdict::NotForced {
            forced: "reference"
        }
    );

    let err = registry
        .dispatch(
            &glm5_mla(DType::BF16),
            &DeviceDesc::cpu(GIB),
            Some("cuda-bf16-mma"),
        )
        .unwrap_err();
    let DispatchError::ForcedInvalid { name, reasons, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(*name, "cuda-bf16-mma");
    assert_eq!(reasons.len(), 1);
    assert!(err.to_string().contains("got cpu"), "{err}");

    let err = registry
        .dispatch(&glm5_mla(DType::BF16), &device, Some("flashmla"))
        .unwrap_err();
    assert_eq!(
        err,
        DispatchError::UnknownBackend {
            op: Op::SparseMla,
            name: "flashmla".into(),
            known: vec![
                "cuda-bf16-mma",
                "cuda-bf16-wgmma",
                "cuda-f32-fma",
                "reference"
            ],
        }
    );
}

#[test]
fn no_valid_backend_fails_with_every_candidates_reasons() {
    // Only the kernels (no reference), on a Turing GPU.
    let mut registry = Registry::empty();
    for entry in Registry::builtin()
        .entries(Op::SparseMla)
        .filter(|e| e.name != "reference")
    {
        registry.register(entry.clone()).unwrap();
    }
    let err = registry
        .dispatch(&glm5_mla(DType::BF16), &gpu("sm_75"), None)
        .unwrap_err();
    let DispatchError::NoValidBackend { rejections, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(rejections.len(), 3);
    let text = err.to_string();
    assert!(
        text.starts_with("no valid sparse_mla backend on cuda:0 (sm_75)"),
        "{text}"
    );
    assert!(text.contains("cuda-bf16-mma: needs compute capability ∈ {9.0,12.x}, got 7.5"));
    assert!(text.contains("cuda-bf16-wgmma: needs compute capability ∈ {9.0}, got 7.5"));
    assert!(text.contains("cuda-f32-fma: needs compute capability ∈ {9.0,12.x}, got 7.5; needs dtype ∈ {f32}, got bf16"));
}

static FAKE_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn fake_sparse_mla(
    q: &candle_core::Tensor,
    cache: &candle_core::Tensor,
    indices: &candle_core::Tensor,
    value_dim: usize,
    scale: f64,
) -> glm5_ops::Result<(candle_core::Tensor, candle_core::Tensor)> {
    FAKE_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    glm5_ops::sparse_mla_reference(q, cache, indices, value_dim, scale)
}

/// A FlashMLA-like backend: Hopper and Blackwell, bf16, 64 or 128 heads, paged blocks of 64.
fn flashmla_like() -> Entry {
    Entry {
        name: "flashmla-style",
        description: "test: a backend registered from outside the crate",
        kernel: Kernel::SparseMla(fake_sparse_mla),
        serves: Serves {
            devices: DeviceMatch::Cuda(vec![
                Arch {
                    major: 9,
                    minor: Some(0),
                },
                Arch {
                    major: 12,
                    minor: None,
                },
            ]),
            dtypes: vec![DType::BF16],
            heads: Limit::OneOf(vec![64, 128]),
            head_dims: Limit::OneOf(vec![576]),
            value_dims: Limit::OneOf(vec![512]),
            top_k: Limit::MultipleOf(64),
            contiguous_cache: true,
            paged_block_sizes: Some(Limit::OneOf(vec![64])),
            key_formats: vec![KeyFormat::Float],
        },
        extra_check: None,
        priority: vec![(DeviceFamily::Sm120, 1), (DeviceFamily::Sm90, 1)],
    }
}

#[test]
fn a_backend_registered_outside_the_crate_is_chosen_by_priority() {
    let mut registry = Registry::builtin();
    registry.register(flashmla_like()).unwrap();
    assert!(matches!(
        registry.register(flashmla_like()),
        Err(DispatchError::Duplicate {
            name: "flashmla-style",
            ..
        })
    ));
    let choice = registry
        .dispatch(&glm5_mla(DType::BF16), &gpu("sm_120"), None)
        .unwrap();
    assert_eq!(choice.entry.name, "flashmla-style");
    assert_eq!(
        reasons_of(&choice, "cuda-bf16-mma"),
        &Verdict::Outranked {
            by: "flashmla-style"
        }
    );
    // Its bound function is the one that runs.
    let Kernel::SparseMla(run) = choice.entry.kernel else {
        panic!()
    };
    let q = candle_core::Tensor::zeros((1, 2, 8), DType::F32, &candle_core::Device::Cpu).unwrap();
    let rows = candle_core::Tensor::zeros((3, 8), DType::F32, &candle_core::Device::Cpu).unwrap();
    let idx = candle_core::Tensor::new(&[[0i32, 2]], &candle_core::Device::Cpu).unwrap();
    let before = FAKE_CALLS.load(std::sync::atomic::Ordering::Relaxed);
    run(&q, &rows, &idx, 8, 1.0).unwrap();
    assert_eq!(
        FAKE_CALLS.load(std::sync::atomic::Ordering::Relaxed),
        before + 1
    );

    // 8 heads (a tiny model): it says so, and the built-in kernel serves.
    let small = OpSpec {
        heads: 8,
        ..glm5_mla(DType::BF16)
    };
    let choice = registry.dispatch(&small, &gpu("sm_90"), None).unwrap();
    assert_eq!(choice.entry.name, "cuda-bf16-mma");
    let rejection = choice
        .rejected
        .iter()
        .find(|r| r.backend == "flashmla-style")
        .unwrap();
    assert_eq!(
        rejection.to_string(),
        "flashmla-style: needs heads ∈ {64,128}, got 8"
    );
    // On the CPU it is not listed and cannot run.
    let cpu = registry
        .dispatch(&glm5_mla(DType::BF16), &DeviceDesc::cpu(GIB), None)
        .unwrap();
    assert_eq!(cpu.entry.name, "reference");
}

#[test]
fn assumed_devices_parse_with_binary_sizes_and_known_shared_memory() {
    let d = DeviceDesc::assume("sm_120:96GB", 3).unwrap();
    assert_eq!(d.name, "cuda:3");
    assert_eq!(d.memory_bytes, 96 * GIB);
    assert!(d.assumed);
    let cc = ComputeCapability {
        major: 12,
        minor: 0,
    };
    assert_eq!(
        d.kind,
        DeviceKind::Cuda {
            ordinal: 3,
            capability: cc,
            shared_memory_per_block: 99 * 1024 - STATIC_SHARED_RESERVE,
        }
    );
    assert_eq!(known_shared_memory(cc), 101_376);
    assert_eq!(
        DeviceDesc::assume("sm_90:141GB", 0).unwrap().family(),
        DeviceFamily::Sm90
    );
    assert_eq!(
        DeviceDesc::assume("cpu:512GB", 0).unwrap().family(),
        DeviceFamily::Cpu
    );
    assert_eq!(parse_bytes("1.5TB"), Some(3 * (1u64 << 39)));
    assert_eq!(parse_bytes("80GiB"), Some(80 * GIB));
    assert_eq!(parse_bytes("1024"), None);
    for bad in [
        "sm_120",
        "gpu:96GB",
        "sm_120:lots",
        "sm_1:1GB",
        "sm_abc:1GB",
    ] {
        assert!(DeviceDesc::assume(bad, 0).is_err(), "{bad}");
    }
}

#[test]
fn forced_backend_text_parses_or_names_the_problem() {
    use glm5_ops::registry::parse_forced;
    assert_eq!(
        parse_forced("sparse_mla=reference").unwrap(),
        (Op::SparseMla, "reference".to_string())
    );
    assert_eq!(
        parse_forced("dsa_indexer = reference").unwrap(),
        (Op::DsaIndexer, "reference".to_string())
    );
    assert!(matches!(
        parse_forced("attention=x"),
        Err(DispatchError::UnknownOp { .. })
    ));
    assert!(matches!(
        parse_forced("sparse_mla"),
        Err(DispatchError::BadForce { .. })
    ));
}
