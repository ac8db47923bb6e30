#!/usr/bin/env bash
# The GPU checks on a one-GPU machine, by parts (GPU_PARTS, comma-separated; default "tests,bench"):
#   bash benchmarks/gpu/check.sh [OUT_DIR]; GPU_PARTS=rank|bf16|decode32|compile32|overlap bash ...
# What each part measures, the wheels it expects in .whl/ and its time limits: docs/gpu.md, "Running the GPU checks".
set -u
OUT_DIR="${1:-${OUT:-/tmp/gpu_check}}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
T0=$SECONDS
say() { echo "=== [gpu] $* (at $((SECONDS - T0)) s)"; }

SITE=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH="$SITE:$PWD"
if [[ -f .whl/nvfuser_abi_shim.so ]]; then
    # nvFuser's libraries find CUDA's (nvrtc, cupti, cudart) in the nvidia wheels beside torch, zstd's in .whl/lib
    cuda_libs="$(python3 -c "import glob, os, sysconfig; p = sysconfig.get_paths()['purelib']
print(':'.join(sorted({os.path.dirname(f) for f in glob.glob(p + '/nvidia/**/lib*.so.13', recursive=True)})))")"
    export LD_LIBRARY_PATH="$cuda_libs:$PWD/.whl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LD_PRELOAD="$PWD/.whl/nvfuser_abi_shim.so"
fi
say "installed"
python3 - <<'EOF' 2>&1 | tee "$OUT_DIR/env.txt"
import torch, thunder
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("thunder", thunder.__version__ if hasattr(thunder, "__version__") else "?")
try:
    import nvfuser_direct, nvfuser
    print("nvfuser_direct", nvfuser_direct.version(), nvfuser.compute_tensor_descriptor([2, 3], [3, 1]))
except Exception as e:  # the checks go on without it
    print("nvfuser_direct did not load:", repr(e)[:400])
from thunder.executors import nvfuserex
print("thunder's nvFuser executor:", nvfuserex.nvfuserex)
EOF

PARTS=",${GPU_PARTS:-tests,bench},"

if [[ $PARTS == *,tests,* ]]; then
say "tests"
timeout "${GPU_TESTS_S:-240}" python3 -m pytest -q -rA -p no:cacheprovider tests/test_cuda.py tests/test_executor.py -k "${GPU_TESTS:-cuda or nvfuser}" \
    2>&1 | tee "$OUT_DIR/tests.log" | grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|Error|error:" | head -60
say "tests done"
fi

left=$((${GPU_CHECK_S:-480} - (SECONDS - T0)))
if [[ $PARTS == *,bench,* ]] && ((left > 90)); then
    say "benchmark (${left} s left)"
    timeout "$left" python3 -m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 --master-port 29533 -m benchmarks.benchmark_litgpt \
        --compare "${GPU_MODES:-eager,thunder,thunder_inductor,thunder_defaults}" \
        --llama_config '{"dim": 2048, "n_heads": 16, "n_kv_heads": 8, "ffn_hidden": 5632, "vocab": 32000}' \
        --n_layers 4 --micro_batch_size 8 --block_size 256 --max_iters 12 --warmup_iters 2 --rounds 2 \
        --learning_rate 0.01 --json_path "$OUT_DIR/compare_gpu.json" \
        --dump_thunder_traces true --trace_dir /tmp/gpu_check_traces > "$OUT_DIR/compare_gpu.log" 2>&1
    tar czf "$OUT_DIR/traces.tar.gz" -C /tmp gpu_check_traces  # each thunder mode's final traces, in one file
    grep -E "^\[compare\].*median|^\|" "$OUT_DIR/compare_gpu.log" | tail -12
fi
rank_phase() {  # name, then bench_rank.py's arguments (--layers 0,1 unless they name the depths)
    local name=$1 left=$((${GPU_RANK_S:-540} - (SECONDS - T0)))
    shift
    if ((left < 60)); then say "rank $name skipped: ${left} s left"; return; fi
    say "rank $name (${left} s left)"
    mkdir -p /tmp/gpu_check_rank
    timeout "$left" python3 -m benchmarks.bench_rank --layers 0,1 "$@" --project \
        --json_path "/tmp/gpu_check_rank/rank_$name.json" > "$OUT_DIR/rank_$name.log" 2>&1
    echo "exit code $?"
    grep -E "^\||^- |^mode|^ERROR|shapes" "$OUT_DIR/rank_$name.log" | head -60
}
if [[ $PARTS == *,rank,* ]]; then
    rank_phase decode8b --model Llama-3-8B --tp 8 --train_modes "" --decode_modes d,e,f --decode_batches 1 --steps 20
    rank_phase train8b --model Llama-3-8B --tp 8 --train_modes a,b,c --decode_modes "" --steps 5
    rank_phase batch8 --model Llama-3-8B --tp 8 --train_modes "" --decode_modes d,e,f --decode_batches 8 --steps 20
    rank_phase full8b --model Llama-3-8B --tp 8 --train_modes a,b,c --decode_modes "" --layers 32 --steps 3 --warmup 1
    rank_phase sweep8b --model Llama-3-8B --tp 1,2,4 --train_modes a --decode_modes d,e --decode_batches 1 --steps 5
    rank_phase slice70b --model Llama-3-70B --tp 8 --train_modes a,c --decode_modes e,f --decode_batches 1 --steps 5
    tar czf "$OUT_DIR/rank_json.tar.gz" -C /tmp gpu_check_rank
fi
if [[ $PARTS == *,bf16,* ]]; then
    say "bf16: steps at Llama-3-8B shapes under 4 plans, and the CUDA tests, concurrently (${GPU_BF16_S:-420} s)"
    work=/tmp/gpu_check_bf16
    rm -rf "$work" && mkdir -p "$work"
    jobs_run=()
    for plan in tp_sp_lp tp_lp tp_sp tp; do
        TORCHINDUCTOR_COMPILE_THREADS=3 timeout "${GPU_BF16_S:-420}" python3 -m benchmarks.bench_rank \
            --model Llama-3-8B --tp 8,2 --plan "$plan" --train_modes a,b --decode_modes "" --layers 1 --steps 1 \
            --warmup 1 --json_path "$work/bf16_$plan.json" > "$work/steps_$plan.log" 2>&1 &
        jobs_run+=("$!:steps $plan")
    done
    for tests in "litgpt and nvfuser" "litgpt and inductor" "generation"; do
        timeout "${GPU_BF16_S:-420}" python3 -m pytest -q -rA -p no:cacheprovider tests/test_cuda.py \
            -k "bf16 and $tests" > "$work/tests_${tests// /_}.log" 2>&1 &
        jobs_run+=("$!:tests $tests")
    done
    for job in "${jobs_run[@]}"; do
        wait "${job%%:*}"
        echo "${job#*:}: exit code $? (124: out of time)"
    done
    grep -E "^\| [0-9]|^- |^FALLBACK|^ERROR|shapes" "$work"/steps_*.log
    cat "$work"/steps_*.log > "$OUT_DIR/bf16_steps.log"
    if compgen -G "$work/bf16_*.json" > /dev/null; then
        tar czf "$OUT_DIR/bf16_steps.tar.gz" -C "$work" $(cd "$work" && ls bf16_*.json)
    fi
    cat "$work"/tests_*.log > "$OUT_DIR/bf16_tests.log"
    grep -hE "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed" "$work"/tests_*.log | head -40
fi
if [[ $PARTS == *,decode32,* ]]; then
    for batch in 1 8; do
        rank_phase "decode32_b$batch" --model Llama-3-8B --tp 8 --train_modes "" --decode_modes e,f \
            --decode_batches "$batch" --layers "${GPU_DECODE_LAYERS:-32}" --steps 10 --warmup 2
    done
    tar czf "$OUT_DIR/decode32_json.tar.gz" -C /tmp gpu_check_rank
fi
if [[ $PARTS == *,compile32,* ]]; then
    rank_phase compile32_train --model Llama-3-8B --tp 8 --train_modes a --decode_modes "" --layers 32 --steps 1 \
        --warmup 1
    rank_phase compile32_decode --model Llama-3-8B --tp 8 --train_modes "" --decode_modes e --decode_batches 1 \
        --layers 32 --steps 3 --warmup 1
    grep -h -o '"first_step_s": [0-9.]*' /tmp/gpu_check_rank/rank_compile32_*.json
    tar czf "$OUT_DIR/compile32_json.tar.gz" -C /tmp gpu_check_rank
fi
if [[ $PARTS == *,overlap,* ]]; then
    for overlap in never always; do
        rank_phase "overlap_$overlap" --model Llama-3-8B --tp 8 --train_modes b --decode_modes "" --steps 5 \
            --overlap "$overlap"
    done
fi
say "end"
