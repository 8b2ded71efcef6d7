//! The GLM-5 graph on a CUDA GPU (attention through glm5's sparse_mla kernels): the HF fixtures in f32 and
//! bf16. Built with `--features cuda`, run by `scripts/gpu-run.sh` on the GPU machine.
#![cfg(feature = "cuda")]

use glm5::candle_core::{DType, Device};
use glm5::{AttentionMode, Glm5ForCausalLM};

#[path = "common/fixtures.rs"]
mod fixtures;
use fixtures::{
    decode_rows, fixture_dir, load_split, logit_rows, max_abs_diff, reference, relative_l2,
};

/// The fixture `name` on `device` in `dtype`: prefill of `decode_from` ids, then decode (every logit row).
fn logits(
    name: &str,
    dtype: DType,
    device: &Device,
    ids: &[u32],
    decode_from: usize,
) -> Vec<Vec<f32>> {
    let model =
        Glm5ForCausalLM::from_dir(fixture_dir(name), dtype, device, AttentionMode::Sparse).unwrap();
    decode_rows(&model, ids, decode_from)
}

const FIXTURES: [&str; 3] = ["sparse_long", "dense_equiv", "bf16_storage"];

#[test]
fn f32_on_gpu_matches_hf_within_1e_3() {
    let gpu = Device::new_cuda(0).unwrap();
    for name in FIXTURES {
        let (ids, expected) = reference(name);
        let expected: Vec<Vec<f32>> = expected.to_vec2().unwrap();
        for decode_from in [ids.len(), 6] {
            let got = logits(name, DType::F32, &gpu, &ids, decode_from);
            let err = max_abs_diff(&got, &expected);
            println!("{name} f32 (prefill {decode_from}): max |Δ| = {err:.2e}");
            assert!(err < 1e-3, "{name}: f32 GPU logits differ from HF by {err}");
        }
    }
}

/// bf16 against f32 on the GPU, per position ‖Δ‖/‖f32‖. These tiny random models use large weights (so that
/// sparsity matters): their attention is sharp, and where two keys score almost alike bf16 rounding can move one
/// position's softmax outright, on the CPU as on the GPU (dense_equiv's position 13 at 0.55 in bf16 on the CPU,
/// its position 23 at 0.94 on the GPU, with the rest at 1-5%). So over the positions before index_topk the
/// median stays within 3e-2 and at most one in eight positions beyond 6e-2; past index_topk flipped indexer
/// selections cascade through the layers (0.1-1.35 on sparse_long, on both devices alike) and are not bounded.
#[test]
fn bf16_on_gpu_stays_close_to_f32() {
    let gpu = Device::new_cuda(0).unwrap();
    for name in FIXTURES {
        let (ids, _) = reference(name);
        let topk = Glm5ForCausalLM::from_dir(
            fixture_dir(name),
            DType::F32,
            &Device::Cpu,
            AttentionMode::Sparse,
        )
        .unwrap()
        .config()
        .index_topk;
        let f32_rows = logits(name, DType::F32, &gpu, &ids, ids.len());
        let bf16_rows = logits(name, DType::BF16, &gpu, &ids, ids.len());
        let relative: Vec<f32> = bf16_rows
            .iter()
            .zip(&f32_rows)
            .map(|(a, b)| relative_l2(a, b))
            .collect();
        println!("{name} bf16 vs f32 per position: {relative:.3?}");
        let mut within: Vec<f32> = relative.iter().copied().take(topk).collect();
        within.sort_by(f32::total_cmp);
        let median = within[within.len() / 2];
        let beyond = within.iter().filter(|&&r| r > 6e-2).count();
        assert!(
            median < 3e-2 && beyond <= within.len().div_ceil(8),
            "{name} before index_topk: median bf16 relative error {median}, {beyond} positions beyond 6e-2"
        );
    }
}

/// Placement across `cuda:0` and the CPU: the first half of the layers (and the embeddings) on the GPU, the
/// rest and lm_head on the CPU, in f32, gives the all-CPU logits within 1e-3: hidden states cross the
/// boundary every forward, and each layer's KV cache lives on its device.
#[test]
fn layers_split_over_cuda_and_cpu_match_all_cpu() {
    let gpu = Device::new_cuda(0).unwrap();
    for name in FIXTURES {
        let (ids, _) = reference(name);
        let cpu_rows = logits(name, DType::F32, &Device::Cpu, &ids, 6);

        let model = load_split(name, &[gpu.clone(), Device::Cpu]);
        println!(
            "{name}: sparse_mla on cuda:0 = {}",
            model.plan().layers[0].ops[0].backend()
        );
        let split_rows = decode_rows(&model, &ids, 6);
        assert_eq!(model.transfers(), 1 + ids.len() - 6);
        let err = max_abs_diff(&split_rows, &cpu_rows);
        println!("{name}: cuda:0 + cpu vs all-CPU, max |Δ| = {err:.2e}");
        assert!(
            err < 1e-3,
            "{name}: split logits differ from all-CPU by {err}"
        );
    }
}

/// The FP8 indexer key cache on the GPU, in a bf16 model (keys quantised on insert by the CUDA quantiser and
/// scored by the FP8 mma kernel, in prefill and in decode). While a query sees no more positions than
/// index_topk every position is selected, so logits equal those with float keys; past it, every row of every
/// layer's selections holds index_topk distinct causal positions.
#[test]
fn fp8_index_keys_on_gpu() {
    use glm5::models::Checkpoint;
    use glm5::{Config, DeviceDesc, KeyFormat, Plan, PlanOptions, Registry};
    let gpu = Device::new_cuda(0).unwrap();
    let name = "sparse_long";
    let (ids, _) = reference(name);
    let dir = fixture_dir(name);
    let config = Config::from_file(dir.join("config.json")).unwrap();
    assert!(
        ids.len() > config.index_topk,
        "the fixture must outgrow index_topk"
    );
    let prefill = 6;
    let run = |keys: KeyFormat| {
        let mut options = PlanOptions::new(DType::BF16, AttentionMode::Sparse);
        options.index_keys = keys;
        let plan = Plan::build(
            &config,
            vec![DeviceDesc::of(&gpu).unwrap()],
            &options,
            &Registry::builtin(),
        )
        .unwrap();
        let indexer = plan.layers[0]
            .op(glm5::Op::DsaIndexer)
            .map(|op| op.backend());
        assert_eq!(indexer, Some("cuda-bf16-mma"), "{keys:?} keys");
        let model = Glm5ForCausalLM::load_planned(
            &config,
            &Checkpoint::open(&dir).unwrap(),
            plan,
            std::slice::from_ref(&gpu),
        )
        .unwrap();
        let mut cache = model.new_cache(ids.len()).unwrap();
        let (first, selections) = model
            .forward_with_selections(&ids[..prefill], 0, &mut cache)
            .unwrap();
        let mut rows = vec![first];
        let mut decode_selections = Vec::new();
        for (pos, &id) in ids.iter().enumerate().skip(prefill) {
            let (logits, sel) = model
                .forward_with_selections(&[id], pos, &mut cache)
                .unwrap();
            rows.push(logits);
            decode_selections.push((pos, sel));
        }
        let logits = logit_rows(&rows);
        let mut by_position: Vec<(usize, Vec<Vec<i32>>)> = (0..prefill)
            .map(|t| {
                (
                    t,
                    selections
                        .iter()
                        .map(|s| s.to_vec2::<i32>().unwrap()[t].clone())
                        .collect(),
                )
            })
            .collect();
        for (pos, sel) in decode_selections {
            by_position.push((
                pos,
                sel.iter()
                    .map(|s| s.to_vec2::<i32>().unwrap()[0].clone())
                    .collect(),
            ));
        }
        (logits, by_position)
    };
    let (float_logits, _) = run(KeyFormat::Float);
    let (fp8_logits, fp8_selections) = run(KeyFormat::Fp8E4m3);
    for t in 0..config.index_topk {
        let diff: f32 = fp8_logits[t]
            .iter()
            .zip(&float_logits[t])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(
            diff < 1e-5,
            "position {t}: FP8 keys changed the logits by {diff} before index_topk"
        );
    }
    for (pos, layers) in &fp8_selections {
        for (layer, row) in layers.iter().enumerate() {
            let mut chosen: Vec<i32> = row.iter().copied().filter(|&s| s >= 0).collect();
            let want = config.index_topk.min(pos + 1);
            assert_eq!(chosen.len(), want, "layer {layer} position {pos}: {row:?}");
            chosen.sort();
            chosen.dedup();
            assert_eq!(
                chosen.len(),
                want,
                "layer {layer} position {pos}: repeats in {row:?}"
            );
            assert!(
                chosen.iter().all(|&s| s as usize <= *pos),
                "layer {layer} position {pos}: not causal {row:?}"
            );
        }
    }
    println!("{name}: FP8 index keys on the GPU: logits equal before index_topk, {} selection rows valid", fp8_selections.len());
}

/// A GGUF model kept quantised (Q8_0, Q4_K_M: llama.cpp's converter and quantiser) runs on the GPU through
/// candle's CUDA `QMatMul` kernels and gives the CPU's logits: per position ‖Δ‖/‖CPU‖ over the first positions
/// (before index_topk, where a flipped selection would cascade). Both sides quantise the activations, the GPU
/// as Q8_1 and the CPU as Q8_0/Q8_K, so the rows differ by rounding, not by a wrong weight layout.
#[test]
fn gguf_quantised_on_gpu_matches_cpu() {
    use glm5::Checkpoint;
    let gpu = Device::new_cuda(0).unwrap();
    for file in ["wide-Q8_0.gguf", "wide-Q4_K_M.gguf"] {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/gguf")
            .join(file);
        let (config, checkpoint) = Checkpoint::open_gguf(&path).unwrap();
        let ids: Vec<u32> = (0..24u32)
            .map(|i| (i * 37 + 5) % config.vocab_size as u32)
            .collect();
        let run = |device: &Device| {
            let model = Glm5ForCausalLM::load(
                &config,
                &checkpoint,
                DType::F32,
                device,
                AttentionMode::Sparse,
            )
            .unwrap();
            decode_rows(&model, &ids, 8)
        };
        let (cpu, on_gpu) = (run(&Device::Cpu), run(&gpu));
        let first = ids.len().min(config.index_topk);
        let worst = (0..first)
            .map(|p| relative_l2(&on_gpu[p], &cpu[p]))
            .fold(0f32, f32::max);
        println!("{file}: GPU vs CPU, positions < {first}: max ‖Δ‖/‖CPU‖ = {worst:.2e}");
        assert!(
            worst < 5e-2,
            "{file}: GPU logits differ from the CPU's by {worst}"
        );
    }
}

/// The batched forward over the paged pool on the GPU (paged CUDA kernels, rows scattered into blocks of 64):
/// three sequences of different lengths, prompt chunks and decode tokens sharing steps, each equal to the same
/// sequence run alone through `forward` on the GPU: f32 within 1e-4, bf16 finite and close.
#[test]
fn batched_forward_on_gpu_equals_each_sequence_alone() {
    use glm5::models::{PagedCacheOptions, SeqChunk};
    let gpu = Device::new_cuda(0).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let model = Glm5ForCausalLM::from_dir(
            fixture_dir("sparse_long"),
            dtype,
            &gpu,
            AttentionMode::Sparse,
        )
        .unwrap();
        let vocab = model.config().vocab_size as u32;
        let seqs: Vec<Vec<u32>> = [(3u32, 70usize), (5, 41), (11, 9)]
            .iter()
            .map(|&(seed, len)| {
                (0..len as u32)
                    .map(|i| (i * 37 + seed * 101) % vocab)
                    .collect()
            })
            .collect();
        let alone: Vec<Vec<f32>> = seqs
            .iter()
            .map(|ids| {
                let mut cache = model.new_cache(ids.len()).unwrap();
                let logits = model.forward(ids, 0, &mut cache).unwrap();
                logits
                    .get(ids.len() - 1)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            })
            .collect();
        let mut pool = model
            .new_paged_cache(PagedCacheOptions {
                num_blocks: 16,
                block_size: 64,
            })
            .unwrap();
        let ids: Vec<_> = seqs.iter().map(|_| pool.add_sequence()).collect();
        // Step 1: prompt chunks of every sequence except its last token; then one step of last tokens.
        let chunks: Vec<SeqChunk> = seqs
            .iter()
            .zip(&ids)
            .map(|(s, &seq)| SeqChunk {
                seq,
                tokens: &s[..s.len() - 1],
                start_pos: 0,
            })
            .collect();
        model.forward_batch(&chunks, &mut pool).unwrap();
        let last: Vec<SeqChunk> = seqs
            .iter()
            .zip(&ids)
            .map(|(s, &seq)| SeqChunk {
                seq,
                tokens: &s[s.len() - 1..],
                start_pos: s.len() - 1,
            })
            .collect();
        let batched: Vec<Vec<f32>> = model
            .forward_batch(&last, &mut pool)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec2()
            .unwrap();
        for (i, (b, a)) in batched.iter().zip(&alone).enumerate() {
            // bf16: the batch's GEMM shapes round differently from the lone run's, and past index_topk a
            // rounding can change a selected key, so only gross errors are caught (garbage is ~1.4).
            let bound = if dtype == DType::F32 { 1e-4 } else { 0.25 };
            let err = if dtype == DType::F32 {
                max_abs_diff(std::slice::from_ref(b), std::slice::from_ref(a))
            } else {
                relative_l2(b, a)
            };
            println!("{dtype:?} sequence {i}: batched vs alone {err:.2e}");
            assert!(
                b.iter().all(|v| v.is_finite()),
                "{dtype:?} sequence {i}: non-finite logits"
            );
            assert!(err < bound, "{dtype:?} sequence {i}: {err}");
        }
    }
}

/// The attention's fused row kernels (the default) against the candle-op chains they replace
/// (`RowOps::CandleOps`), on the same model on the GPU: f32 logits within 1e-3 of each other over prefill and
/// decode (the HF bound of the f32 test), bf16 within 5e-2 over the first positions (roundings may land the
/// other side of a tie, as the bf16 test above allows).
#[test]
fn fused_row_ops_on_gpu_equal_the_candle_ops() {
    use glm5::models::RowOps;
    let gpu = Device::new_cuda(0).unwrap();
    let (ids, _) = reference("sparse_long");
    for dtype in [DType::F32, DType::BF16] {
        let model = Glm5ForCausalLM::from_dir(
            fixture_dir("sparse_long"),
            dtype,
            &gpu,
            AttentionMode::Sparse,
        )
        .unwrap();
        let fused = decode_rows(&model, &ids, 6);
        model.set_row_ops(RowOps::CandleOps);
        let candle = decode_rows(&model, &ids, 6);
        if dtype == DType::F32 {
            let err = max_abs_diff(&fused, &candle);
            println!("f32: fused vs candle ops, max |Δ| = {err:.2e}");
            assert!(err < 1e-3, "f32: fused row ops differ by {err}");
        } else {
            for (pos, (f, c)) in fused.iter().zip(&candle).enumerate().take(8) {
                let err = relative_l2(f, c);
                println!("bf16 position {pos}: fused vs candle ops ‖Δ‖/‖·‖ = {err:.2e}");
                assert!(err < 5e-2, "bf16 position {pos}: {err}");
            }
        }
    }
}

#[path = "common/decode_steps.rs"]
mod decode_steps;

/// Decode steps replayed from CUDA graphs equal `forward_batch` on the same inputs (and so does their layout
/// run eagerly): one graph captured per
/// (batch, block-table columns) shape the steps meet, replayed for every other step of that shape; only the
/// prompt step runs eagerly. The same kernels read the same values, but the graphs' indexer scores up to the
/// table's capacity rather than the step's longest sequence: f32 within 1e-5 of the largest logit, bf16
/// within 1e-2 (under two bf16 roundings of it).
#[test]
fn graphed_decode_on_gpu_equals_eager() {
    use decode_steps::{decode_both_ways, decode_shapes, DecodePath};
    use glm5::DecodeGraphs;
    const BLOCK: usize = 4;
    let gpu = Device::new_cuda(0).unwrap();
    let Device::Cuda(dev) = &gpu else {
        unreachable!("new_cuda made a CUDA device")
    };
    // SAFETY: this device is new, and this test's one thread issues all its work on its one stream.
    unsafe { dev.disable_event_tracking() };
    let shapes = decode_shapes(BLOCK);
    let mut distinct = shapes.clone();
    distinct.sort();
    distinct.dedup();
    for (dtype, bound) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
        let model = Glm5ForCausalLM::from_dir(
            fixture_dir("sparse_long"),
            dtype,
            &gpu,
            AttentionMode::Sparse,
        )
        .unwrap();
        assert_eq!(model.decode_graph_blocker(3), None);
        // The graphs' layout run eagerly first (padded block tables, the indexer bounded by their capacity),
        // at the graphs' width and a wider one, which separates a layout error from a capture error.
        for (columns, rows) in [(1, 1), (16, 8)] {
            let err = decode_both_ways(&model, BLOCK, DecodePath::Layout { columns, rows });
            println!(
                "{dtype:?}: graph layout ({columns}+ columns, {rows}+ rows) vs eager {err:.2e}"
            );
            assert!(
                err <= bound,
                "{dtype:?}: the graphs' layout differs from eager by {err}"
            );
        }
        let mut graphs = DecodeGraphs::new(distinct.len());
        let err = decode_both_ways(&model, BLOCK, DecodePath::Graphed(&mut graphs));
        let stats = graphs.stats().clone();
        println!("{dtype:?}: graphed vs eager {err:.2e} over {} decode steps of shapes {distinct:?}; {stats:?}", shapes.len());
        assert_eq!(stats.captured, distinct.len(), "{stats:?}");
        assert_eq!(stats.replayed, shapes.len() - distinct.len(), "{stats:?}");
        assert_eq!(stats.eager, 1, "only the prompt step: {stats:?}");
        assert!(
            err <= bound,
            "{dtype:?}: graphed decode differs from eager by {err}"
        );
    }
}

/// Layers over two CUDA devices that share one GPU but not a stream (each with its own), event tracking off
/// as glm5's CLI runs them: nothing but the model's own stream waits orders the hidden state's copy between
/// them (what several GPUs need, checked on one). Prefill and decode logits equal one device's (f32, 1e-5),
/// and so do decode steps replayed from one graph per device's segment.
#[test]
fn layers_over_two_streams_without_event_tracking_match_one_device() {
    let devices = [
        Device::new_cuda_with_stream(0).unwrap(),
        Device::new_cuda_with_stream(0).unwrap(),
    ];
    glm5::plan_cli::without_event_tracking(&devices);
    let one = Device::new_cuda_with_stream(0).unwrap();
    glm5::plan_cli::without_event_tracking(std::slice::from_ref(&one));
    for name in FIXTURES {
        let (ids, _) = reference(name);
        let alone = logits(name, DType::F32, &one, &ids, 6);
        let model = load_split(name, &devices);
        let split = decode_rows(&model, &ids, 6);
        assert_eq!(model.transfers(), 1 + ids.len() - 6);
        let err = max_abs_diff(&split, &alone);
        println!("{name}: two streams vs one device, max |Δ| = {err:.2e}");
        assert!(err < 1e-5, "{name}: split logits differ by {err}");
        if name == "sparse_long" {
            // Decode graphs, one per device's segment, the hidden state handed between them.
            use decode_steps::{decode_both_ways, decode_shapes, DecodePath};
            assert_eq!(model.decode_graph_blocker(3), None);
            let mut graphs = glm5::DecodeGraphs::new(8);
            let err = decode_both_ways(&model, 4, DecodePath::Graphed(&mut graphs));
            let mut shapes = decode_shapes(4);
            shapes.sort();
            shapes.dedup();
            let stats = graphs.stats().clone();
            println!("{name}: two streams, graphed vs eager {err:.2e}; {stats:?}");
            assert_eq!(stats.captured, shapes.len(), "{stats:?}");
            assert_eq!(stats.eager, 1, "only the prompt step: {stats:?}");
            assert!(
                err <= 1e-5,
                "{name}: graphed over two streams differs by {err}"
            );
        }
    }
}
