#!/usr/bin/env bash
# The te-rs GPU check, as built by `cargo xtask gpu-bundle` (bin/te,
# tests/*, hf_baseline.py, gemma-7b.config.json beside this script).
#
#   run.sh            on a GPU machine (no Rust, no network needed)
#   run.sh --dry-run  anywhere: the CPU half of every check, and the plan of
#                     the GPU steps
#
# Steps: 1 kernel parity, 2 tiny random models cuda vs cpu, 3 the Gemma-7B
# tutorial workload (random bf16 weights, batch 64, 20 + 492 tokens, with
# and without CUDA graphs), 4 the Hugging Face baseline of the same workload,
# 5 decode tokens/s at batch 1, 8, 64 (with and without CUDA graphs) and
# kernel bandwidth against a device-to-device copy (cuda_model's
# kernel_bandwidth), 6 one table. A GPU step whose te-rs side does not
# exist yet is reported as "not built yet", never faked. Logs go to $OUT (or
# ./out beside this script). Exit status: non-zero if any step that ran failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$here/out}"
mkdir -p "$out"
dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) echo "usage: run.sh [--dry-run]" >&2; exit 2 ;;
esac
te="$here/bin/te"
threads="$(nproc)"
status=0
rows=()
row() { rows+=("$1|$2|$3"); }
step() { echo; echo "== $*"; }
fail() { status=1; row "$1" "FAIL" "$2"; }
# `te generate --device` exists once the CUDA model path is built (issue 14).
has_cuda_model=0
# (Each `grep` reads the whole help: `grep -q` exiting early would break
# the pipe and, under pipefail, fail a test binary's listing.)
"$te" generate --help 2>/dev/null | grep -- '--device' >/dev/null && has_cuda_model=1
not_built="not built yet (te generate --device cuda)"
# Whether two `te generate --json` outputs hold the same tokens, prompt by
# prompt (each run draws its own sampling seed, which the JSON reports).
same_tokens() {
  python3 - "$1" "$2" <<'PY'
import json, sys
tokens = lambda path: [json.loads(line)["tokens"] for line in open(path)]
sys.exit(0 if tokens(sys.argv[1]) == tokens(sys.argv[2]) else 1)
PY
}

if [ "$dry" -eq 0 ]; then
  export TE_REQUIRE_GPU=1
  # The driver, NVRTC and cuBLAS: the driver mount, the toolkit, pip wheels.
  for d in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
  done
  if command -v python3 >/dev/null; then
    for d in $(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
for r in roots:
    for d in glob.glob(os.path.join(r, "nvidia", "*", "lib")):
        print(d)
PY
    ); do export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"; done
  fi
  # CUDA 13 wheels ship only lib*.so.13; cudarc asks for the unversioned or
  # CUDA 12 names: link the unversioned names into one directory.
  libs="$out/lib"
  mkdir -p "$libs"
  IFS=: read -ra ld_dirs <<<"$LD_LIBRARY_PATH"
  for name in nvrtc cublas cublasLt; do
    for d in "${ld_dirs[@]}"; do
      f="$(ls "$d"/lib$name.so.1[23]* 2>/dev/null | head -1)"
      if [ -n "$f" ] && [ ! -e "$d/lib$name.so" ]; then ln -sf "$f" "$libs/lib$name.so"; break; fi
    done
  done
  export LD_LIBRARY_PATH="$libs:$LD_LIBRARY_PATH"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
else
  echo "dry run: CPU halves only; GPU steps are listed as plans"
fi

step "1. kernel parity: every CUDA op against its CPU op on random inputs, poisoned outputs"
for t in "$here"/tests/*; do
  name="$(basename "$t")"
  planned="$("$t" --list --ignored 2>/dev/null | grep -c ': test$')"
  if [ "$dry" -eq 1 ]; then
    # The host-side tests (NVRTC compile check, argument checks) run; the
    # device tests are listed.
    if "$t" --test-threads=1 >"$out/$name.cpu.log" 2>&1; then
      row "parity $name" "cpu ok" "$(grep -o '[0-9]* passed' "$out/$name.cpu.log" | tail -1); plan: $planned device tests"
    else
      fail "parity $name" "see $out/$name.cpu.log"
    fi
    "$t" --list --ignored 2>/dev/null | sed -n 's/: test$//p' | sed 's/^/   plan: /'
  else
    # kernel_bandwidth is a report, run in step 5.
    if "$t" --include-ignored --test-threads=1 --skip kernel_bandwidth 2>&1 | tee "$out/$name.log"; then
      row "parity $name" "ok" "$(grep -o '[0-9]* passed' "$out/$name.log" | tail -1)"
    else
      fail "parity $name" "see $out/$name.log"
    fi
  fi
done

step "2. tiny random models of every architecture: cuda against cpu (logits at bf16 tolerance, greedy tokens)"
for m in tiny-llama tiny-llama3 tiny-mistral tiny-qwen2 tiny-qwen3 tiny-gemma tiny-gemma2 tiny-gemma3; do
  cpu="$out/$m.cpu.jsonl"
  if "$te" generate --model "random:$m" --prompt "The GPU check" --prompt "ab" \
      --max-new-tokens 16 --ignore-eos --json -t "$threads" >"$cpu" 2>"$out/$m.cpu.err"; then
    row "$m cpu" "ok" "$(wc -l <"$cpu") prompts x 16 tokens"
  else
    fail "$m cpu" "see $out/$m.cpu.err"
    continue
  fi
  if [ "$dry" -eq 1 ]; then
    echo "   plan: te generate --device cuda --model random:$m (same prompts), tokens equal to $cpu; then with --cuda-graphs, equal to plain cuda"
  elif [ "$has_cuda_model" -eq 1 ]; then
    gpu="$out/$m.cuda.jsonl"
    if ! "$te" generate --device cuda --model "random:$m" --prompt "The GPU check" --prompt "ab" \
        --max-new-tokens 16 --ignore-eos --json >"$gpu" 2>"$out/$m.cuda.err"; then
      fail "$m cuda" "see $out/$m.cuda.err"
    elif same_tokens "$cpu" "$gpu"; then
      row "$m cuda vs cpu" "ok" "greedy tokens equal"
    else
      # The CPU runs the f32 weights, the GPU their bf16 rounding: a near
      # tie may differ. The bf16-matched comparison is cuda_model's
      # tiny_models_cuda_match_cpu (step 1).
      row "$m cuda vs cpu" "differ" "f32 cpu weights vs bf16 gpu; see $gpu and step 1"
    fi
    # Decode steps from CUDA graphs. With cuBLAS a padded batch may pick
    # another algorithm, so a near tie may differ; the exact check (GEMM
    # kernel) is cuda_model's graph_decode_matches_plain_decode (step 1).
    graphs="$out/$m.cuda-graphs.jsonl"
    if ! "$te" generate --device cuda --cuda-graphs --model "random:$m" --prompt "The GPU check" --prompt "ab" \
        --max-new-tokens 16 --ignore-eos --json >"$graphs" 2>"$out/$m.cuda-graphs.err"; then
      fail "$m cuda --cuda-graphs" "see $out/$m.cuda-graphs.err"
    elif same_tokens "$gpu" "$graphs"; then
      row "$m graphs vs plain" "ok" "greedy tokens equal"
    else
      row "$m graphs vs plain" "differ" "see $graphs and step 1"
    fi
  else
    row "$m cuda vs cpu" "-" "$not_built"
  fi
done

step "3. tutorial workload: random Gemma-7B, bf16, batch 64, 20 prompt + 492 generated tokens"
if "$te" inspect --model random:gemma-7b >"$out/gemma-7b.inspect.txt" 2>&1; then
  row "gemma-7b config" "ok" "$(sed -n 's/^parameters: *//p' "$out/gemma-7b.inspect.txt") parameters, bf16"
else
  fail "gemma-7b config" "see $out/gemma-7b.inspect.txt"
fi
workload=(--batched --npp 20 --ntg 492 --npl 64 -o jsonl)
if [ "$dry" -eq 1 ]; then
  # The same shapes through the same engine, on a tiny model, on the CPU.
  if "$te" bench --model random:tiny-gemma "${workload[@]}" -t "$threads" >"$out/workload.tiny-gemma.cpu.jsonl" 2>"$out/workload.cpu.err"; then
    row "workload shape, tiny-gemma cpu" "ok" "$(python3 -c 'import json,sys; r=json.loads(open(sys.argv[1]).readline()); print("%.2f s, %.0f tok/s" % (r["t"], r["speed"]))' "$out/workload.tiny-gemma.cpu.jsonl" 2>/dev/null)"
  else
    fail "workload shape, tiny-gemma cpu" "see $out/workload.cpu.err"
  fi
  echo "   plan: te bench --device cuda --model random:gemma-7b ${workload[*]}, then the same with --cuda-graphs"
elif [ "$has_cuda_model" -eq 1 ]; then
  graph_modes=("")
  if "$te" bench --help 2>/dev/null | grep -- '--cuda-graphs' >/dev/null; then
    graph_modes+=(--cuda-graphs)
  else
    row "te gemma-7b --cuda-graphs" "-" "not built yet (te bench --cuda-graphs)"
  fi
  for graphs in "${graph_modes[@]}"; do
    label="te gemma-7b${graphs:+ $graphs}"
    if "$te" bench --device cuda $graphs --model random:gemma-7b "${workload[@]}" >"$out/workload$graphs.jsonl" 2>"$out/workload$graphs.err"; then
      row "$label" "ok" "$(python3 -c 'import json,sys; print("%.2f s" % json.loads(open(sys.argv[1]).readline())["t"])' "$out/workload$graphs.jsonl")"
    else
      fail "$label" "see $out/workload$graphs.err"
    fi
  done
else
  row "te gemma-7b" "-" "$not_built"
  row "te gemma-7b --cuda-graphs" "-" "$not_built"
fi

step "4. Hugging Face baseline: GemmaForCausalLM, random init from the same config, bf16, static KV cache"
baseline=(python3 "$here/hf_baseline.py" --config "$here/gemma-7b.config.json" --batch 64 --prompt-len 20 --new-tokens 492 --decode-batches 1,8,64)
if [ "$dry" -eq 1 ]; then
  if python3 -m py_compile "$here/hf_baseline.py" && "${baseline[@]}" --dry-run; then
    row "hf_baseline.py" "parses" "plan printed"
  else
    fail "hf_baseline.py" "does not parse or plan"
  fi
elif "${baseline[@]}" --out "$out/hf_baseline.json" 2>&1 | tee "$out/hf_baseline.log"; then
  row "hf gemma-7b" "ok" "$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("%.2f s; decode tok/s %s" % (r["workload_s"], r["decode_tokens_per_s"]))' "$out/hf_baseline.json")"
else
  fail "hf gemma-7b" "see $out/hf_baseline.log"
fi

step "5. decode tokens/s at batch 1, 8, 64 (with and without CUDA graphs); kernel bandwidth against a device-to-device copy"
decode=(--batched --npp 20 --ntg 128 --npl 1,8,64 -o jsonl)
decode_dry=(--batched --npp 20 --ntg 32 --npl 1,8,64 -o jsonl)
tok_s='import json,sys; print(", ".join("b%d %.0f tok/s" % (r["pl"], r["speed_tg"]) for r in map(json.loads, open(sys.argv[1]))))'
bandwidth_test="$here/tests/cuda_model"
if [ "$dry" -eq 1 ]; then
  if "$te" bench --model random:tiny-gemma "${decode_dry[@]}" -t "$threads" >"$out/decode.tiny-gemma.cpu.jsonl" 2>"$out/decode.cpu.err"; then
    row "decode tiny-gemma cpu" "ok" "$(python3 -c "$tok_s" "$out/decode.tiny-gemma.cpu.jsonl" 2>/dev/null)"
  else
    fail "decode tiny-gemma cpu" "see $out/decode.cpu.err"
  fi
  if "$te" bench --model random:tiny-gemma "${decode_dry[@]}" --cuda-graphs >/dev/null 2>"$out/decode.graphs-cpu.err"; then
    fail "--cuda-graphs on cpu" "accepted; expected an error"
  elif grep -q -- "--cuda-graphs needs a GPU" "$out/decode.graphs-cpu.err"; then
    row "--cuda-graphs on cpu" "ok" "a clear error"
  else
    fail "--cuda-graphs on cpu" "see $out/decode.graphs-cpu.err"
  fi
  echo "   plan: te bench --device cuda --model random:gemma-7b ${decode[*]}, then the same with --cuda-graphs"
  echo "   plan: te bench --device cuda --model random:qwen2.5-7b and random:qwen3-8b ${decode[*]}"
  if "$bandwidth_test" --list --ignored 2>/dev/null | grep '^kernel_bandwidth: test$' >/dev/null; then
    row "kernel bandwidth test" "listed" "cuda_model kernel_bandwidth"
  else
    fail "kernel bandwidth test" "kernel_bandwidth missing from $bandwidth_test"
  fi
  echo "   plan: $bandwidth_test --ignored --exact kernel_bandwidth --nocapture: d2d copy of 1 GiB, then the"
  echo "         gate/up, down and lm_head products (t = 1, 64; cuBLAS and gemm.cu), RMSNorm and decode"
  echo "         attention on Gemma-7B shapes, each in GB/s and % of the copy"
elif [ "$has_cuda_model" -eq 1 ]; then
  for graphs in "" --cuda-graphs; do
    label="te decode gemma-7b${graphs:+ $graphs}"
    log="$out/decode$graphs.jsonl"
    if "$te" bench --device cuda $graphs --model random:gemma-7b "${decode[@]}" >"$log" 2>"$log.err"; then
      row "$label" "ok" "$(python3 -c "$tok_s" "$log")"
    else
      fail "$label" "see $log.err"
    fi
  done
  # The full-size Qwen presets (q/k/v biases; q/k norms, head_dim 128).
  for m in qwen2.5-7b qwen3-8b; do
    log="$out/decode.$m.jsonl"
    if "$te" bench --device cuda --model "random:$m" "${decode[@]}" >"$log" 2>"$log.err"; then
      row "te decode $m" "ok" "$(python3 -c "$tok_s" "$log")"
    else
      fail "te decode $m" "see $log.err"
    fi
  done
  if "$bandwidth_test" --ignored --exact kernel_bandwidth --nocapture --test-threads=1 >"$out/bandwidth.txt" 2>&1; then
    cat "$out/bandwidth.txt"
    row "kernel bandwidth vs d2d copy" "ok" "$(grep -m1 'd2d copy' "$out/bandwidth.txt" | awk '{print $(NF-2), $(NF-1)}') copy; table in $out/bandwidth.txt"
  else
    fail "kernel bandwidth vs d2d copy" "see $out/bandwidth.txt"
  fi
else
  row "te decode b1/b8/b64" "-" "$not_built"
  row "kernel bandwidth vs d2d copy" "-" "$not_built"
fi

step "6. summary"
printf '%-34s %-8s %s\n' "check" "status" "result"
for r in "${rows[@]}"; do
  IFS='|' read -r what st res <<<"$r"
  printf '%-34s %-8s %s\n' "$what" "$st" "$res"
done | tee "$out/summary.txt"
exit $status
