#!/usr/bin/env bash
# Protocol round trip, kvd vs Redis, in one run on this machine: starts kvd
# (store mode, cpu backend) and redis-server on Unix sockets in a temp dir,
# runs bench_rtt and `redis-benchmark -t ping -P 16` with 1, 16 and 64
# clients, and prints the numbers side by side. A benchmark, never a CI step.
#   usage: tests/bench/rtt_vs_redis.sh [BUILD_DIR] (default: build)
#   env:   OPS (requests per throughput run, default 320000), DEPTH (16),
#          BENCH_OP (hello or seq_info, default hello), REPEAT (runs per
#          setting, alternating kvd and redis; the best is kept, default 3)
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$here/build}
ops=${OPS:-320000}
depth=${DEPTH:-16}
op=${BENCH_OP:-hello}
repeat=${REPEAT:-3}
kvd=$build/bin/kvd
bench=$build/bin/bench_rtt
for b in "$kvd" "$bench"; do
    [[ -x $b ]] || { echo "rtt_vs_redis: $b not built (cmake --build $build)" >&2; exit 2; }
done
if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
    echo "rtt_vs_redis: redis-server/redis-benchmark missing (apt-get install redis-server)" >&2
    exit 2
fi

tmp=$(mktemp -d /tmp/kvd-rtt.XXXXXX)
kvd_pid= redis_pid=
cleanup() {
    [[ -n $kvd_pid ]] && kill "$kvd_pid" 2>/dev/null && wait "$kvd_pid" 2>/dev/null
    [[ -n $redis_pid ]] && kill "$redis_pid" 2>/dev/null && wait "$redis_pid" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT

"$kvd" --socket "$tmp/kvd.sock" --backend cpu >"$tmp/kvd.log" 2>&1 &
kvd_pid=$!
redis-server --port 0 --unixsocket "$tmp/redis.sock" --save '' --appendonly no \
    --daemonize no >"$tmp/redis.log" 2>&1 &
redis_pid=$!
for _ in $(seq 100); do
    [[ -S $tmp/kvd.sock && -S $tmp/redis.sock ]] && break
    sleep 0.1
done
[[ -S $tmp/kvd.sock ]] || { echo "rtt_vs_redis: kvd did not start:" >&2; cat "$tmp/kvd.log" >&2; exit 1; }
[[ -S $tmp/redis.sock ]] || { echo "rtt_vs_redis: redis did not start:" >&2; cat "$tmp/redis.log" >&2; exit 1; }

echo "== $(nproc) cpus, $(date -u +%Y-%m-%d), op=$op, pipeline=$depth, $ops requests per run," \
    "best of $repeat alternating kvd/redis runs (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
# redis-benchmark --csv: "test","rps","avg_latency_ms","min","p50","p95","p99","max"
redis_csv() { redis-benchmark -s "$tmp/redis.sock" -t ping -n "$1" -c "$2" -P "$3" --csv 2>/dev/null |
    tr -d '"' | awk -F, '$1 == "PING_MBULK"'; }
kvd_tput() { "$bench" --socket "$tmp/kvd.sock" --op "$op" --depth "$depth" --ops "$ops" \
    --latency-ops 0 --clients "$1" | sed -n 's/.*pipeline [0-9]*: *\([0-9]*\) ops\/s.*/\1/p'; }
max() { awk -v a="$1" -v b="$2" 'BEGIN { print (a + 0 > b + 0) ? a : b }'; }

"$bench" --socket "$tmp/kvd.sock" --op "$op" --latency-ops 20000 --clients ''
IFS=, read -r _ _ avg _ p50 _ p99 _ <<<"$(redis_csv 20000 1 1)"
awk -v a="$avg" -v p="$p50" -v q="$p99" 'BEGIN { printf "redis PING     latency, 1 client, no pipeline: p50 %.1f us  p99 %.1f us  mean %.1f us  (20000 round trips)\n", p * 1000, q * 1000, a * 1000 }'

declare -A kt rt
for c in 1 16 64; do
    kt[$c]=0 rt[$c]=0
    for _ in $(seq "$repeat"); do
        kt[$c]=$(max "${kt[$c]}" "$(kvd_tput "$c")")
        IFS=, read -r _ rps _ <<<"$(redis_csv "$ops" "$c" "$depth")"
        rt[$c]=$(max "${rt[$c]}" "$rps")
    done
done

echo
printf '| clients | pipeline | kvd %s ops/s | redis PING ops/s | kvd/redis |\n' "$op"
printf '|---:|---:|---:|---:|---:|\n'
for c in 1 16 64; do
    printf '| %s | %s | %.0f | %.0f | %.2f |\n' "$c" "$depth" "${kt[$c]}" "${rt[$c]}" \
        "$(awk -v k="${kt[$c]}" -v r="${rt[$c]}" 'BEGIN{print (r > 0) ? k / r : 0}')"
done
