#!/usr/bin/env bash
# Runs on the GPU machine: `bash scripts/gpu-run.sh [tests|kernel-tests|model-tests|multi-gpu|sanitize|bench|e2e|serve|profile|profile-warm|step-profile|profile-detail|profile-source|variants|variant-tests|variant-bench|variant-sanitize|none]...`
# (default: tests sanitize bench), with .gpu/ (from scripts/gpu-build.sh; GPU_DIR=.gpu-NAME for another) next to it. Logs go to $OUT (or
# ./gpu-out). scripts/README.md says what each step does.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
GPU_DIR=${GPU_DIR:-.gpu}
rm -rf /tmp/glm5-bin  # a warm machine keeps the last call's binaries: only this $GPU_DIR counts
mkdir -p "$OUT" /tmp/glm5-bin
for f in "$GPU_DIR"/*.xz; do xz -dc "$f" > "/tmp/glm5-bin/$(basename "$f" .xz)"; chmod +x "/tmp/glm5-bin/$(basename "$f" .xz)"; done
export GLM5_REPO_ROOT=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
steps=${*:-tests sanitize bench}
# GLM-5 layers of the bf16 slices: 6 (3 dense + 3 MoE, 58 GB of experts) where the card holds them, else 5.
LAYERS=${LAYERS:-$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print ($1 > 100000) ? 6 : 5}')}
status=0
for step in $steps; do
  case $step in
    tests|kernel-tests|model-tests)
      case $step in
        kernel-tests) names="sparse_mla_cuda dsa_indexer_cuda moe_cuda rms_norm_cuda gguf_matmul_cuda" ;;
        model-tests) names="model_cuda fp8_nvfp4_cuda gguf_cuda" ;;
        *) names="sparse_mla_cuda dsa_indexer_cuda moe_cuda rms_norm_cuda gguf_matmul_cuda model_cuda fp8_nvfp4_cuda gguf_cuda" ;;
      esac
      for t in $names; do
        [ -x /tmp/glm5-bin/$t ] || { echo "test $t: not packed (scripts/gpu-build.sh NAME...)"; continue; }
        timeout 400 /tmp/glm5-bin/$t --test-threads=1 --nocapture > "$OUT/test-$t.log" 2>&1; rc=$?  # a hung kernel: rc 124
        echo "test $t: rc=$rc ($(grep -E 'test result' "$OUT/test-$t.log" | tail -1))"; [ $rc = 0 ] || status=1
      done ;;
    multi-gpu)  # on a machine with 2+ GPUs (nvidia-h200-x2)
      NCCL_NVLS_ENABLE=0 timeout 300 /tmp/glm5-bin/multi_gpu --test-threads=1 --nocapture > "$OUT/test-multi_gpu.log" 2>&1; rc=$?
      echo "test multi_gpu: rc=$rc ($(grep -E 'test result' "$OUT/test-multi_gpu.log" | tail -1))"; grep -E "GPUs vs 1" "$OUT/test-multi_gpu.log"
      [ $rc = 0 ] || status=1
      # GLM-5's first 4 layers (3 dense, 1 MoE) at real sizes, random weights: 1 GPU vs 2.
      timeout 400 /tmp/glm5-bin/glm5-bench slice 4 2>&1 | tail -4 | tee "$OUT/slice.txt"; [ ${PIPESTATUS[0]} = 0 ] || status=1 ;;
    sanitize|variant-sanitize)
      # variant-sanitize: the same over every variant's packed test binaries (scripts/gpu-variant.sh).
      names=main; [ $step = sanitize ] || names=$(ls /tmp/glm5-bin | sed -n 's/^glm5-bench-//p')
      for v in $names; do
        suffix=""; [ $v = main ] || suffix=-$v
        for tool in memcheck racecheck; do
          for t in "sparse_mla_cuda bf16_kernel prefill_tokens wgmma_kernel" "dsa_indexer_cuda selected_sets equal_scores f32_kernel fp8_quantisation crowded repeated" \
            "moe_cuda" "rms_norm_cuda" "fp8_nvfp4_cuda kernels_match fp8_w8a8_quantiser" "gguf_matmul_cuda every_format" \
            "model_cuda graphed_decode_on_gpu_equals_eager"; do
            set -- $t; bin=$1$suffix; shift
            [ -x /tmp/glm5-bin/$bin ] || continue  # a variant packed without it
            # cuBLAS's own Hopper GEMMs (nvjet_*) synchronise through mbarriers, which racecheck does not follow.
            GLM5_QUICK=1 timeout 300 compute-sanitizer --tool $tool --kernel-name-exclude kns=nvjet --error-exitcode 9 /tmp/glm5-bin/$bin \
              --test-threads=1 "$@" > "$OUT/sanitize-$tool-$bin.log" 2>&1; rc=$?
            echo "compute-sanitizer $tool $bin: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool-$bin.log" | tail -1)"; [ $rc = 0 ] || status=1
          done
        done
      done ;;
    profile)
      # Kernel-only durations (no launch overhead) of a few shapes, from the hardware's own timer.
      # The indexer: its four kernels (scores, candidates, threshold, emit) of two calls.
      for shape in "sparse-mla 32768 8 8" "sparse-mla 32768 128 64" "indexer 131072 1" "indexer 32768 8" "indexer 131072 8" "indexer 8192 1"; do
        echo "== $shape"
        case $shape in indexer*) kernels=8 ;; *) kernels=4 ;; esac
        timeout 120 ncu --clock-control none --launch-skip 12 --launch-count $kernels --metrics gpu__time_duration.sum -k regex:"sparse_mla|dsa_[st]" \
          /tmp/glm5-bin/glm5-bench $shape 2>&1 | grep -E "sparse_mla_|dsa_|gpu__time_duration" | tail -$((2 * kernels))
      done 2>&1 | tee "$OUT/profile.txt" ;;
    profile-warm)
      # The same kernels without the L2 flush between them (--cache-control none): what back-to-back calls
      # see. Compare with `profile` (flushed) for how much of a shape's data stays in L2.
      for shape in "sparse-mla 32768 8 8" "sparse-mla 32768 128 64" "indexer 131072 1" "indexer 32768 8" "indexer 32768 64" "indexer 131072 8"; do
        echo "== $shape"
        case $shape in indexer*) kernels=8 ;; *) kernels=4 ;; esac
        timeout 120 ncu --cache-control none --clock-control none --launch-skip 12 --launch-count $kernels --metrics gpu__time_duration.sum -k regex:"sparse_mla|dsa_[st]" \
          /tmp/glm5-bin/glm5-bench $shape 2>&1 | grep -E "sparse_mla_|dsa_|gpu__time_duration" | tail -$((2 * kernels))
      done 2>&1 | tee "$OUT/profile-warm.txt" ;;
    step-profile)
      # Every kernel of one batch-1 decode step of the slice (WEIGHTS, default q4k; kernel time alone, L2 kept
      # warm as in a step): listed in order and summed by kernel (scripts/step_kernels.py). A context of 8
      # tokens keeps the cache-filling prefills short (8 tokens, no dequantised experts; at 4096 Q4_K's take
      # tens of thousands of launches); SKIP and COUNT place ncu's window over the decode steps that follow
      # (3300 and 900 landed there for q4k), and the script takes the window's cheapest lm_head-to-lm_head
      # span, a decode step. The attention's kernels so run at a short context.
      timeout 400 ncu --csv --cache-control none --clock-control none --launch-skip ${SKIP:-3300} --launch-count ${COUNT:-900} \
        --metrics gpu__time_duration.sum /tmp/glm5-bin/glm5-bench e2e --weights ${WEIGHTS:-q4k} --contexts 8 --prefill 8 --batches 1 --steps 4 \
        > "$OUT/step-kernels.csv" 2> "$OUT/step-kernels.err"; echo "ncu step-profile: rc=$?"
      python3 scripts/step_kernels.py "$OUT/step-kernels.csv" > "$OUT/step-kernels.txt"; head -1 "$OUT/step-kernels.txt" ;;
    profile-detail)
      # Full ncu sections (occupancy, warp stalls, memory, source hot spots) of the kernels that limit the
      # open targets, one report each under $OUT/ncu-*.txt.
      for shape in "indexer 131072 1" "indexer 131072 8" "sparse-mla 32768 8 8" "sparse-mla 32768 128 64"; do
        case $shape in indexer*) filter='regex:dsa_[st]'; count=4 ;; *) filter=regex:sparse_mla; count=2 ;; esac
        timeout 300 ncu --set full --import-source no --clock-control none --launch-skip 12 --launch-count $count \
          -k "$filter" /tmp/glm5-bin/glm5-bench $shape > "$OUT/ncu-${shape// /-}.txt" 2>&1
        echo "ncu $shape: rc=$? $(grep -c 'Section:' "$OUT/ncu-${shape// /-}.txt") sections"
      done ;;
    profile-source)
      # Where one kernel's warps wait, instruction by instruction: ncu's full sections and its SASS source page
      # (stall samples per instruction, densest sampling) for each "NAME|KERNEL-REGEX|BENCH ARGS" of $PROFILES (";"-separated),
      # the 30th matching launch (warm L2), into $OUT/ncu-NAME.txt and $OUT/src-NAME.csv. BENCH is glm5-bench,
      # or glm5-bench-VARIANT when the args start with "@VARIANT ".
      IFS=';' read -ra profiles <<< "${PROFILES:?profile-source needs PROFILES}"
      for entry in "${profiles[@]}"; do
        IFS='|' read -r name regex args <<< "$entry"
        bin=/tmp/glm5-bin/glm5-bench
        case $args in @*) bin=$bin-${args%% *}; bin=${bin/@/}; args=${args#* } ;; esac
        for page in details source; do
          extra=""; file="$OUT/ncu-$name.txt"
          [ $page = source ] && { extra="--page source --print-source sass --csv"; file="$OUT/src-$name.csv"; }
          timeout 200 ncu --set full --import-source no --warp-sampling-interval 0 --cache-control none --clock-control none --launch-skip 30 \
            --launch-count 1 -k "regex:$regex" $extra $bin $args > "$file" 2>&1
          echo "ncu $name ($page): rc=$? $(wc -l < "$file") lines"
        done
      done ;;
    variants|variant-tests|variant-bench)
      # Variants packed by scripts/gpu-variant.sh. variant-tests: each one's kernel tests. variant-bench:
      # glm5-bench rows of $SHAPES (default "sparse-mla 32768 128 64"; separated by ";") for main's build and every
      # variant, alternating, $ROUNDS times (default 2). variants: both. A bench call takes ~10 s.
      names=$(ls /tmp/glm5-bin | sed -n 's/^glm5-bench-//p')
      if [ $step != variant-bench ]; then
        for v in $names; do
          for t in sparse_mla_cuda dsa_indexer_cuda; do
            [ -x /tmp/glm5-bin/$t-$v ] || continue  # packed without it
            timeout 200 /tmp/glm5-bin/$t-$v --test-threads=1 --nocapture > "$OUT/test-$t-$v.log" 2>&1; rc=$?
            echo "variant $v, test $t: rc=$rc ($(grep -E 'test result' "$OUT/test-$t-$v.log" | tail -1))"; [ $rc = 0 ] || status=1
          done
        done
      fi
      if [ $step != variant-tests ]; then
        IFS=';' read -ra shapes <<< "${SHAPES:-sparse-mla 32768 128 64}"
        for shape in "${shapes[@]}"; do
          for round in $(seq "${ROUNDS:-2}"); do
            for v in main $names; do
              bin=/tmp/glm5-bin/glm5-bench; [ $v = main ] || bin=$bin-$v
              timeout 120 $bin $shape 2>&1 | grep -E '^ +[0-9]+ |gather alone' | sed "s/^/$v: /"
            done
          done
        done 2>&1 | tee -a "$OUT/variants.txt"
      fi ;;
    e2e)
      # The whole model step (docs/performance.md): bf16 with HF transformers in the same call, then the
      # quantised formats.
      timeout 500 /tmp/glm5-bin/glm5-bench e2e --layers $LAYERS --hf bench/hf_e2e.py 2>&1 | tee "$OUT/e2e-bf16.txt"; [ ${PIPESTATUS[0]} = 0 ] || status=1
      # Speculative decoding's steps with the MTP layer (one more MoE layer of weights: one layer fewer).
      timeout 300 /tmp/glm5-bin/glm5-bench e2e --layers $((LAYERS - 1)) --mtp --contexts 4096 --batches 8 2>&1 | tee "$OUT/e2e-mtp.txt"; [ ${PIPESTATUS[0]} = 0 ] || status=1
      for w in fp8 nvfp4 q4k; do
        timeout 300 /tmp/glm5-bin/glm5-bench e2e --weights $w --contexts 4096 --batches 8,64 2>&1 | tee "$OUT/e2e-$w.txt"; [ ${PIPESTATUS[0]} = 0 ] || status=1
      done
      # The NVFP4 export's bf16 attention quantised to FP8 at load (glm5 --fp8-projections).
      timeout 300 /tmp/glm5-bin/glm5-bench e2e --weights nvfp4 --fp8-projections --contexts 4096 --batches 8 2>&1 | tee "$OUT/e2e-nvfp4-fp8-projections.txt"; [ ${PIPESTATUS[0]} = 0 ] || status=1
      # i-quant GGUF mixes (IQ4_XS and IQ2_S experts as published): decode at 1 and 8 sequences.
      for w in iq4_xs iq2_s; do
        timeout 300 /tmp/glm5-bin/glm5-bench e2e --weights $w --contexts 4096 --batches 8 2>&1 | tee "$OUT/e2e-$w.txt"; [ ${PIPESTATUS[0]} = 0 ] || status=1
      done ;;
    bench)
      timeout 400 /tmp/glm5-bin/glm5-bench 2>&1 | tee "$OUT/bench.txt"; [ ${PIPESTATUS[0]} = 0 ] || status=1
      # The weight formats' mat-vecs alone at batch 1, one MoE layer's experts by each implementation, and FP8
      # prefill of 4096 tokens through GLM-5's FP8 projections (W8A8 on cuBLASLt vs W8A16) against the FP8
      # GEMM peak measured in the same call.
      for sub in matvec moe fp8-prefill; do
        timeout 300 /tmp/glm5-bin/glm5-bench $sub 2>&1 | tee "$OUT/bench-$sub.txt"; [ ${PIPESTATUS[0]} = 0 ] || status=1
      done
      for arch in sm_90 sm_120; do
        echo "$arch: HMMA instructions in sparse_mla.fatbin: $(cuobjdump --dump-sass --gpu-architecture $arch "$GPU_DIR"/sparse_mla.fatbin 2>&1 | grep -c HMMA), in dsa_indexer.fatbin: $(cuobjdump --dump-sass --gpu-architecture $arch "$GPU_DIR"/dsa_indexer.fatbin 2>&1 | grep -c HMMA)"
      done | tee "$OUT/sass.txt"
      echo "sm_90a: HGMMA (wgmma) instructions in sparse_mla_sm90.fatbin: $(cuobjdump --dump-sass "$GPU_DIR"/sparse_mla_sm90.fatbin 2>&1 | grep -c HGMMA)" | tee -a "$OUT/sass.txt"
      echo "sm_120a: block-scaled FP4 MMA (OMMA.SF) instructions in nvfp4_mma_sm120a.fatbin: $(cuobjdump --dump-sass "$GPU_DIR"/nvfp4_mma_sm120a.fatbin 2>&1 | grep -c 'OMMA\.SF')" | tee -a "$OUT/sass.txt"
      cuobjdump --list-elf --list-ptx "$GPU_DIR"/sparse_mla.fatbin | tee -a "$OUT/sass.txt" ;;
    serve)
      # `glm5 serve` in-process on a GLM-5 slice under 1, 8, 32 and 64 streaming clients.
      timeout 500 /tmp/glm5-bin/glm5-bench serve --layers $LAYERS 2>&1 | tee "$OUT/serve.txt"; [ ${PIPESTATUS[0]} = 0 ] || status=1
      # The same with every op launched from the host (no decode graphs).
      timeout 300 /tmp/glm5-bin/glm5-bench serve --layers $LAYERS --enforce-eager --streams 1,8 2>&1 | tee "$OUT/serve-eager.txt"; [ ${PIPESTATUS[0]} = 0 ] || status=1
      # Sampled requests (temperature 1, top-p 0.95, GLM-5's defaults): the host's sampling in every step.
      timeout 300 /tmp/glm5-bin/glm5-bench serve --layers $LAYERS --sampled --streams 1,64 2>&1 | tee "$OUT/serve-sampled.txt"; [ ${PIPESTATUS[0]} = 0 ] || status=1 ;;
  esac
done
exit $status
