#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one call from a source checkout: the GPU tests, then the
# benchmarks (python -m benchmarks.NAME). Logs go to $OUT (or ./gpu-out); a short table is printed last.
#   [MOEFERRY_COMMIT=<commit>] bash scripts/gpu_check.sh [STAGES] [pytest -k expression]
# STAGES: comma-separated of tests, kernels (copy, admission, fused MoE, attention, linear benches),
# decode (full decode benchmark), decode-quick, sampling, ttft, uva, serve, routing (cache policies on
# the built-in model's routing, the simulator against the engine), deepseek (DeepSeek-V3-shaped decode
# and the MLA kernel; 3 layers, 2 of them MoE layers of 22.5 GB each, pinned: ~45 GB of host memory), gpt-oss (gpt-oss-20b-shaped
# decode, 4 layers of 32 bf16 experts), quant (decode and accuracy
# per expert format: bf16, fp8, int4, mxfp4), hybrid (the host channel: kernel GB/s, decode at 0-100%, the channels contending, the kernel beside busy processes, a layer timeline on the
# GPU), structured (decode with a JSON-schema grammar against without; needs xgrammar), prefill (prefill tok/s
# by share of the experts resident, multi-turn TTFT with and without prefix caching), lookahead (the
# lookahead prefetch: copies beside compute, the decode profile, prefetch rows per oracle recall and
# cap on the misses copied ahead, the host kernel per format), step (the resident step: the decode
# profile with async scheduling on and off, int4's int8 route GEMV against its fp32 one), goals (the
# decode tables the offloading goals are stated on, one call: every share at 1 and 4 requests under
# qwen3 and uniform routing, bf16 and int4, the perfect-oracle lookahead), miss-copy (this host's copy
# bandwidths, and offload and hybrid with their misses copied by the gather kernel and by the copy
# engine, side by side: a host's SM gather may trail its DMA), gpt-oss-mxfp4 (the gpt-oss-20b shape, 24 layers of MXFP4
# experts, at 0-100% resident under gpu, offload and hybrid), profile-75 (where the decode step's time
# goes under gpu, offload and hybrid with 75% of the experts resident, qwen3 routing: the offloaded rows'
# cost beyond the resident step, their copies and the latency around them; RESULTS decode-profile/at-75;
# then hybrid's row with its host kernel on 12 and 8 threads and with OMP_WAIT_POLICY=passive, logs only),
# gpt-oss-tune (where its resident step's time goes at 1 and 4 requests, MXFP4, and the route GEMV's
# tiles at its shape), gpt-oss-peer (llama.cpp built from
# .peer/llamacpp-src.tgz into /tmp/lcbuild, about 4.5 minutes, then llama-bench on the same shape at
# --n-cpu-moe 24 18 12 6 0; the tarball from the llama-cpp-python 0.3.36 sdist, carried in .peer/, which
# git ignores; the two stages together may pass one call's 10 minutes: run them in two calls while the
# machine is warm); default tests,kernels,decode-quick.
# Results: $OUT/results.md holds this call's benchmark sections alone; $OUT/RESULTS.md is
# benchmarks/RESULTS.md with those sections regenerated (every stage but decode-quick, a smoke
# run), to copy over benchmarks/RESULTS.md. MOEFERRY_COMMIT names the commit in the tables
# (for a copy of the tree without git history).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
STAGES=${1:-tests,kernels,decode-quick}; KEXPR=${2:-}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
RESULTS=$OUT/results.md; : > "$RESULTS"
CURRENT=$OUT/RESULTS.md; cp benchmarks/RESULTS.md "$CURRENT"
# On a machine without network access: the wheels of scripts/offline_wheels.txt, when .whl/ holds
# them (the server, structured output's xgrammar, the test-only jsonschema).
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
summary=()
run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-90)")")
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' >> "$OUT/gpu.txt" 2>&1
# GPU_TESTS narrows the test stage to some files (the whole GPU suite takes 7-8 minutes in one
# process, mostly Triton compiling on one core); GPU_TEST_JOBS=N (default 4) runs N pytest
# processes side by side over the files, dealt round-robin, logs pytest-gpu-J.log.
if has tests; then
  read -r -a test_files <<< "${GPU_TESTS:-$(ls tests/kernels/test_*.py tests/moe/test_*.py tests/engine/test_*.py tests/models/test_*.py tests/routing/test_*.py tests/structured/test_*.py | tr '\n' ' ')}"
  jobs=${GPU_TEST_JOBS:-4}
  for ((j = 0; j < jobs; j++)); do
    share=(); for ((i = j; i < ${#test_files[@]}; i += jobs)); do share+=("${test_files[i]}"); done
    (( ${#share[@]} )) || continue
    (python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 "${share[@]}" ${KEXPR:+-k "$KEXPR"} \
      > "$OUT/pytest-gpu-$j.log" 2>&1; echo $? > "$OUT/pytest-gpu-$j.rc") &
  done
  t0=$(date +%s); wait
  for log in "$OUT"/pytest-gpu-*.log; do
    summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$(basename "$log" .log)" "$(cat "${log%.log}.rc")" \
      "$(( $(date +%s) - t0 ))" "$(tail -n 1 "$log" | cut -c1-90)")")
  done
fi
if has kernels; then
  run bench-copy python3 -m benchmarks.bench_copy --results "$RESULTS" "$CURRENT"
  run bench-admission python3 -m benchmarks.bench_admission --results "$RESULTS" "$CURRENT"
  run bench-fused-moe python3 -m benchmarks.bench_fused_moe --results "$RESULTS" "$CURRENT"
  run bench-attention python3 -m benchmarks.bench_attention --results "$RESULTS" "$CURRENT"
  run bench-linear python3 -m benchmarks.bench_linear --results "$RESULTS" "$CURRENT"
fi
has decode-quick && run bench-decode python3 -m benchmarks.bench_decode --layers 4 --batch 1 4 --steps 8 --results "$RESULTS"
has decode && run bench-decode python3 -m benchmarks.bench_decode --results "$RESULTS" "$CURRENT"
has sampling && run bench-sampling python3 -m benchmarks.bench_sampling --results "$RESULTS" "$CURRENT"
has ttft && run bench-ttft python3 -m benchmarks.bench_ttft --results "$RESULTS" "$CURRENT"
has prefill && run bench-prefill python3 -m benchmarks.bench_prefill --results "$RESULTS" "$CURRENT"
has routing && run bench-routing python3 -m benchmarks.bench_routing --results "$RESULTS" "$CURRENT"
has uva && run bench-uva python3 -m benchmarks.bench_uva --results "$RESULTS" "$CURRENT"
has deepseek && run bench-deepseek python3 -m benchmarks.bench_deepseek --layers 3 --results "$RESULTS" "$CURRENT"
if has miss-copy; then
  run bench-copy python3 -m benchmarks.bench_copy --results "$RESULTS" "$CURRENT"
  run bench-miss-copy python3 -m benchmarks.bench_hybrid --parts decode --shares 0.25 0.5 0.75 --batch 1 4 \
    --routing qwen3 --miss-copy gather dma --repeats 1 --results "$RESULTS" "$CURRENT"
fi
has gpt-oss && run bench-gpt-oss python3 -m benchmarks.bench_gpt_oss --results "$RESULTS" "$CURRENT"
if has gpt-oss-tune; then
  for b in 1 4; do  # RESULTS decode-profile/gpt-oss is the 1-request profile; 4 requests, the log only
    written=(); ((b == 1)) && written=(--results "$RESULTS" "$CURRENT")
    run profile-gpt-oss-b$b python3 -m benchmarks.bench_profile --shape gpt-oss --routing model --quantization mxfp4 \
      --layers 24 --strategies gpu --batch $b --top 24 "${written[@]}"
  done
  run sweep-gemv-gpt-oss python3 -m benchmarks.sweep_route_gemv --shape gpt-oss --formats bf16 mxfp4 --tokens 1 4 \
    --block-n 8 16 32 --step 32 64 128 --warps 4 8
fi
has gpt-oss-mxfp4 && run bench-gpt-oss-mxfp4 python3 -m benchmarks.bench_gpt_oss --layers 24 --quantization mxfp4 \
  --strategies gpu offload hybrid --cache-fracs 0 0.25 0.5 0.75 --batch 1 4 --repeats 1 --results "$RESULTS" "$CURRENT"
if has gpt-oss-peer; then
  build_llamacpp() {  # CUDA for sm_90, llama-bench alone
    local src=/tmp/lcbuild/src
    [ -f $src/CMakeLists.txt ] || { mkdir -p $src && tar xzf .peer/llamacpp-src.tgz -C $src; } || return 1
    [ -f $src/build/CMakeCache.txt ] || cmake -S $src -B $src/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release
    cmake --build $src/build --target llama-bench -j"$(nproc)"
  }
  run build-llamacpp build_llamacpp
  run llamacpp-gpt-oss python3 -m benchmarks.llamacpp_gpt_oss --llama-cpp /tmp/lcbuild/src
fi
has quant && run bench-quant python3 -m benchmarks.bench_quant --results "$RESULTS" "$CURRENT" \
  && run bench-quant-accuracy python3 -m benchmarks.bench_quant_accuracy --device cuda --results "$RESULTS"
has structured && run bench-structured python3 -m benchmarks.bench_structured --results "$RESULTS" "$CURRENT"
has hybrid && run bench-hybrid python3 -m benchmarks.bench_hybrid --parts decode kernel contention timeline preemption --results "$RESULTS" "$CURRENT"
if has lookahead; then
  run bench-overlap python3 -m benchmarks.bench_overlap --results "$RESULTS" "$CURRENT"
  run bench-profile python3 -m benchmarks.bench_profile --strategies gpu offload --prefetch off oracle --results "$RESULTS" "$CURRENT"
  run bench-prefetch python3 -m benchmarks.bench_hybrid --parts decode --shares 0.25 0.5 --batch 1 --routing qwen3 \
    --prefetch off oracle --oracle-recall 1.0 0.8 --prefetch-experts 0 1 --results "$RESULTS" "$CURRENT"
  run bench-host-kernel python3 -m benchmarks.bench_host_kernel --threads 15 --batch 1 4 --results "$RESULTS" "$CURRENT"
fi
if has step; then
  run bench-profile-async python3 -m benchmarks.bench_profile --strategies gpu offload --async-scheduling on off \
    --results "$RESULTS" "$CURRENT"
  run sweep-route-gemv python3 -m benchmarks.sweep_route_gemv --formats int4 --tokens 1 --int8 --block-n 16 32 64 \
    --step 32 128 --warps 4
fi
if has profile-75; then
  run bench-profile-75 python3 -m benchmarks.bench_profile --strategies gpu offload hybrid --share 0.75 --top 40 \
    --results "$RESULTS" "$CURRENT"
  # hybrid's wait before its copies (57 us a step against offload's 20), with fewer host kernel threads
  # beside the copy engine's and the mailbox's spinning workers, and with OpenMP's idle team asleep (logs only)
  for threads in 12 8; do
    run bench-profile-75-ht$threads python3 -m benchmarks.bench_profile --strategies hybrid --share 0.75 \
      --host-threads $threads
  done
  OMP_WAIT_POLICY=passive run bench-profile-75-passive python3 -m benchmarks.bench_profile --strategies hybrid \
    --share 0.75
fi
if has goals; then
  shares=(--shares 0 0.1 0.25 0.5 0.75 1.0 --batch 1 4 --repeats 1)
  run bench-goals-qwen3 python3 -m benchmarks.bench_hybrid --parts decode "${shares[@]}" --routing qwen3 \
    --results "$RESULTS" "$CURRENT"
  run bench-goals-qwen3-int4 python3 -m benchmarks.bench_hybrid --parts decode "${shares[@]}" --routing qwen3 \
    --quantization int4 --results "$RESULTS" "$CURRENT"
  run bench-goals-uniform python3 -m benchmarks.bench_hybrid --parts decode "${shares[@]}" --results "$RESULTS" "$CURRENT"
  run bench-goals-prefetch python3 -m benchmarks.bench_hybrid --parts decode --shares 0.1 0.25 0.5 0.75 --batch 1 \
    --routing qwen3 --prefetch off oracle --oracle-recall 1.0 --results "$RESULTS" "$CURRENT"
fi
has serve && run bench-serve python3 -m benchmarks.bench_serve --results "$RESULTS" "$CURRENT"  # needs the serve extras
echo; cat "$OUT/gpu.txt"; echo
printf '%s\n' "${summary[@]}"
