#!/usr/bin/env bash
# kvd's cpu backend vs llama.cpp's CPU build on the same random GGUF (issue
# 4; 134M params, 85M outside embedding/output): batch-1 decode tokens/s for
# both and kvd's 16-stream aggregate, at each thread count, runs interleaved
# REPS times; prints medians of wall-clock and CPU-time figures in one table,
# then every run's values. A benchmark, not a test.
# usage: tests/bench/vs_llamacpp.sh [BUILD_DIR] (env: REPS=3 GEN=64
#        THREADS="1 2" TYPES="f16 q8_0" LLCPP_DIR=/tmp/llcpp)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "${1:-$here/../../build-perf}" && pwd)
reps=${REPS:-3} gen=${GEN:-64} threads_list=${THREADS:-"1 2"} types=${TYPES:-"f16 q8_0"}
llcpp=${LLCPP_DIR:-/tmp/llcpp}
for bin in kvd-gguf-gen bench_forward; do
    [[ -x $build/bin/$bin ]] || { echo "missing $build/bin/$bin (build it first)" >&2; exit 1; }
done
if [[ ! -d $llcpp/node_modules/node-llama-cpp ]]; then
    llcpp=/tmp/kvd-llcpp-cache
    if [[ ! -d $llcpp/node_modules/node-llama-cpp ]]; then
        echo "installing node-llama-cpp@3.21.1 into $llcpp" >&2
        mkdir -p "$llcpp"
        npm install --prefix "$llcpp" --no-audit --no-fund node-llama-cpp@3.21.1 >&2
    fi
fi

tmp=$(mktemp -d /tmp/kvd-vs-llcpp.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
shape="--layers 12 --embd 768 --heads 12 --kv-heads 12 --ff 2048 --vocab 32000 --ctx 4096 --seed 42"
for t in $types; do
    # shellcheck disable=SC2086
    "$build/bin/kvd-gguf-gen" -o "$tmp/m_$t.gguf" $shape --type "$t"
done

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
echo "# $(date -u '+%F %H:%M UTC'), $(nproc) cpus, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)," \
     "load average before: $load_before; $reps interleaved runs each, gen $gen after a 16-token prompt"
res=$tmp/results # lines: TYPE THREADS METRIC VALUE
for ((i = 1; i <= reps; i++)); do
    for t in $types; do
        for th in $threads_list; do
            line=$("$build/bin/bench_forward" --model "$tmp/m_$t.gguf" --threads "$th" --gen "$gen" \
                   --prefill 0 | grep '^RESULT')
            for kv in ${line#RESULT }; do
                echo "$t $th kvd_${kv%%=*} ${kv#*=}" >>"$res"
            done
            js=$(node "$here/llamacpp_decode.mjs" "$llcpp" "$tmp/m_$t.gguf" "$th" 16 "$gen" | tail -1)
            node -e 'const r = JSON.parse(process.argv[1]);
                     console.log(`${process.argv[2]} ${process.argv[3]} ll_b1_tok_s ${r.decode_tok_s}`);
                     console.log(`${process.argv[2]} ${process.argv[3]} ll_b1_cpu_ms ${r.decode_cpu_ms_per_tok}`);' \
                "$js" "$t" "$th" >>"$res"
            echo "  run $i $t threads $th done (load $(cut -d' ' -f1 /proc/loadavg))" >&2
        done
    done
done

med() { # TYPE THREADS METRIC -> median
    awk -v t="$1" -v th="$2" -v m="$3" '$1 == t && $2 == th && $3 == m { print $4 }' "$res" | sort -g |
        awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2];
              else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# tok/s = wall clock (median); cpu ms = process CPU time (all threads) per token, or per 16-token step"
printf '| %-5s | %3s | %12s | %14s | %9s | %11s | %12s | %9s | %13s | %15s | %11s | %9s |\n' \
    type thr "kvd b1 tok/s" "llama b1 tok/s" "wall ratio" "kvd cpu ms" "llama cpu ms" "cpu ratio" \
    "kvd 16x tok/s" "16x cpu ms/step" "16x/b1 wall" "16x/b1 cpu"
printf '|%s|\n' "-------|-----|--------------|----------------|-----------|-------------|--------------|-----------|---------------|-----------------|-------------|------------"
for t in $types; do
    for th in $threads_list; do
        kb=$(med "$t" "$th" kvd_b1_tok_s) kc=$(med "$t" "$th" kvd_b1_cpu_ms)
        lb=$(med "$t" "$th" ll_b1_tok_s) lc=$(med "$t" "$th" ll_b1_cpu_ms)
        sb=$(med "$t" "$th" kvd_b16_tok_s) sc=$(med "$t" "$th" kvd_b16_cpu_ms_step)
        awk -v t="$t" -v th="$th" -v kb="$kb" -v kc="$kc" -v lb="$lb" -v lc="$lc" -v sb="$sb" -v sc="$sc" \
            'BEGIN { printf "| %-5s | %3s | %12.1f | %14.1f | %8.2fx | %11.2f | %12.2f | %8.2fx | %13.1f | %15.1f | %10.2fx | %9.2fx |\n",
                     t, th, kb, lb, kb / lb, kc, lc, lc / kc, sb, sc, sb / kb, kc / (sc / 16) }'
    done
done
echo "# every run (in run order):"
awk '{ k = $1 " thr " $2 " " $3; if (!(k in v)) o[n++] = k; v[k] = v[k] " " $4 }
     END { for (i = 0; i < n; i++) print "#   " o[i] ":" v[o[i]] }' "$res"
