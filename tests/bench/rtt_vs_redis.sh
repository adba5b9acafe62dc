#!/usr/bin/env bash
# Protocol round trip, kvd vs Redis, in one run on this machine: starts kvd
# (store mode, cpu backend) and redis-server on Unix sockets in a temp dir,
# runs bench_rtt for each kvd op and `redis-benchmark -t ping -P 16` with
# 1, 16 and 64 clients, interleaved, and prints the medians side by side.
# The small op is seq_info of an empty sequence the client opened (a ~70-byte
# reply of 7 pairs; PING's is 7 bytes); hello is the big one (20 pairs,
# ~300 bytes). A benchmark, never a CI step.
#   usage: tests/bench/rtt_vs_redis.sh [BUILD_DIR] (default: build)
#   env:   OPS (requests per throughput run, default 320000), DEPTH (16),
#          BENCH_OPS (kvd ops, default "seq_info hello"), REPEAT (runs per
#          setting, each a kvd run per op then a redis run; the median is
#          kept, default 5)
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$here/build}
ops=${OPS:-320000}
depth=${DEPTH:-16}
read -r -a kops <<<"${BENCH_OPS:-seq_info hello}"
repeat=${REPEAT:-5}
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

echo "== $(nproc) cpus, $(date -u +%Y-%m-%d), kvd ops: ${kops[*]}, pipeline=$depth," \
    "$ops requests per run, median of $repeat interleaved kvd/redis runs" \
    "(load average: $(cut -d' ' -f1-3 /proc/loadavg))"
# redis-benchmark --csv: "test","rps","avg_latency_ms","min","p50","p95","p99","max"
redis_csv() { redis-benchmark -s "$tmp/redis.sock" -t ping -n "$1" -c "$2" -P "$3" --csv 2>/dev/null |
    tr -d '"' | awk -F, '$1 == "PING_MBULK"'; }
kvd_tput() { "$bench" --socket "$tmp/kvd.sock" --op "$1" --depth "$depth" --ops "$ops" \
    --latency-ops 0 --clients "$2" | sed -n 's/.*pipeline [0-9]*: *\([0-9]*\) ops\/s.*/\1/p'; }
median() { tr ' ' '\n' | sed '/^$/d' | sort -g | awk '{ v[NR] = $1 } END {
    if (NR == 0) print 0; else if (NR % 2) print v[(NR + 1) / 2];
    else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

for op in "${kops[@]}"; do
    "$bench" --socket "$tmp/kvd.sock" --op "$op" --latency-ops 20000 --clients ''
done
IFS=, read -r _ _ avg _ p50 _ p99 _ <<<"$(redis_csv 20000 1 1)"
awk -v a="$avg" -v p="$p50" -v q="$p99" 'BEGIN { printf "redis PING     latency, 1 client, no pipeline: p50 %.1f us  p99 %.1f us  mean %.1f us  (20000 round trips)\n", p * 1000, q * 1000, a * 1000 }'

declare -A runs
for c in 1 16 64; do
    for _ in $(seq "$repeat"); do
        for op in "${kops[@]}"; do
            runs[$op,$c]+=" $(kvd_tput "$op" "$c")"
        done
        IFS=, read -r _ rps _ <<<"$(redis_csv "$ops" "$c" "$depth")"
        runs[redis,$c]+=" $rps"
    done
done

echo
hdr='| clients | pipeline |' sep='|---:|---:|'
for op in "${kops[@]}"; do hdr+=" kvd $op ops/s |"; sep+='---:|'; done
hdr+=' redis PING ops/s |'; sep+='---:|'
for op in "${kops[@]}"; do hdr+=" $op/redis |"; sep+='---:|'; done
echo "$hdr"
echo "$sep"
for c in 1 16 64; do
    r=$(median <<<"${runs[redis,$c]}")
    line="| $c | $depth |"
    for op in "${kops[@]}"; do line+=" $(printf '%.0f' "$(median <<<"${runs[$op,$c]}")") |"; done
    line+=" $(printf '%.0f' "$r") |"
    for op in "${kops[@]}"; do
        line+=" $(awk -v k="$(median <<<"${runs[$op,$c]}")" -v r="$r" 'BEGIN { printf "%.2f", (r > 0) ? k / r : 0 }') |"
    done
    echo "$line"
done
