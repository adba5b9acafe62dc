#!/usr/bin/env bash
# The cuda backend's device check, for a bare CUDA machine (nvcc, cuBLAS,
# CMake; no libevent/msgpack-c/CMocka/inih/libsystemd/pkg-config,
# no network): unpacks the .debs that fetch_debs.sh put in .carry/debs into
# a private prefix (never into /), points CMake and pkg-config at it, builds
# only the gpu targets with CUDA for sm_90, runs the gpu tests, bench_gpu and
# one ncu pass, and prints their short tables, bench_gpu's last. Logs go to
# $OUT (or /tmp/kvd-device-out). Under 10 minutes on an H200.
#
#   tests/gpu/device_check.sh               everything (on the GPU machine)
#   KVD_DC_STAGE=configure tests/gpu/device_check.sh   unpack + configure only
#   KVD_DC_STAGE=build     ...                          + build, no tests/bench
# KVD_PREFIX: the private prefix (default: a fresh temp directory).
# KVD_DC_SANITIZER=1: also run test_gpu_ops under compute-sanitizer memcheck.
# KVD_DC_NCU=0: skip the ncu pass.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
stage=${KVD_DC_STAGE:-all}
out=${OUT:-/tmp/kvd-device-out}
mkdir -p "$out"
P=${KVD_PREFIX:-$(mktemp -d /tmp/kvd-prefix.XXXXXX)}
B=${KVD_DC_BUILD:-$root/build-device}
jobs=${KVD_DC_JOBS:-16}
arch=x86_64-linux-gnu
t0=$(date +%s)
say() { echo "== [$(( $(date +%s) - t0 ))s] $*"; }

debs=(.carry/debs/*.deb)
if [ ! -e "${debs[0]}" ]; then
    echo "device_check: no .debs in .carry/debs: run tests/gpu/fetch_debs.sh on the dev machine" >&2
    exit 2
fi

# ---- 1. private prefix ------------------------------------------------------
unpack() { # deb dir
    if command -v dpkg >/dev/null 2>&1; then
        dpkg -x "$1" "$2"
    else # no dpkg: read the ar archive and its data.tar.* with python3
        python3 - "$1" "$2" <<'PY'
import io, sys, tarfile
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"!<arch>\n", "not a .deb"
off = 8
while off < len(data):
    name = data[off:off + 16].decode().strip().rstrip("/")
    size = int(data[off + 48:off + 58])
    off += 60
    if name.startswith("data.tar"):
        with tarfile.open(fileobj=io.BytesIO(data[off:off + size])) as t:
            t.extractall(sys.argv[2])
    off += size + (size & 1)
PY
    fi
}
# Libraries a CUDA image normally has: unpacked only when missing, so an
# older copy never shadows the machine's own.
declare -A soname=(
    [libcap2]=libcap.so.2
    [libgcrypt20]=libgcrypt.so.20 [libgpg-error0]=libgpg-error.so.0 [liblz4-1]=liblz4.so.1
    [libzstd1]=libzstd.so.1 [liblzma5]=liblzma.so.5 [libssl3]=libssl.so.3
)
has_lib() {
    ldconfig -p 2>/dev/null | grep -q "$1" && return 0
    for d in /lib/$arch /usr/lib/$arch /lib64 /usr/lib64; do [ -e "$d/$1" ] && return 0; done
    return 1
}
say "unpacking ${#debs[@]} .debs into $P"
for deb in "${debs[@]}"; do
    name=$(basename "$deb" | cut -d_ -f1)
    if [ -n "${soname[$name]:-}" ] && has_lib "${soname[$name]}"; then
        continue
    fi
    unpack "$deb" "$P"
done
# Absolute symlinks (into /usr, /lib) are re-pointed inside the prefix.
while IFS= read -r l; do
    tgt=$(readlink "$l")
    [ -e "$P$tgt" ] && ln -sfn "$P$tgt" "$l"
done < <(find "$P" -type l -lname '/*')
pcdir=$P/usr/lib/$arch/pkgconfig
mkdir -p "$pcdir"
# .pc files say prefix=/usr, some libdir=/usr/..., cmocka.pc even -L/usr/...
# and -I/usr/...: rewrite every one of those to the prefix.
for f in "$pcdir"/*.pc "$P"/usr/share/pkgconfig/*.pc; do
    [ -e "$f" ] && sed -i -E -e "s#^([A-Za-z_]+)=/usr#\\1=$P/usr#" \
        -e "s#(-[LI])/usr/#\\1$P/usr/#g" "$f"
done
export PKG_CONFIG_LIBDIR=$pcdir:$P/usr/share/pkgconfig # only the prefix's .pc files
unset PKG_CONFIG_PATH
export LD_LIBRARY_PATH=$P/usr/lib/$arch:$P/lib/$arch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
pkgconfig_bin=$(command -v pkg-config || true)
[ -n "$pkgconfig_bin" ] || pkgconfig_bin=$P/usr/bin/pkgconf
"$pkgconfig_bin" --modversion libevent_core inih libsystemd cmocka msgpack >/dev/null

# ---- 2. configure -----------------------------------------------------------
nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
say "configure ($B, nvcc $nvcc)"
# Only the lent device's architecture (sm_90 on an H200; KVD_DC_ARCH to
# change): the default list of four takes four times as long to build.
cmake -S "$root" -B "$B" -DKVD_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CUDA_ARCHITECTURES="${KVD_DC_ARCH:-90}" \
    -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_PREFIX_PATH="$P/usr" \
    -DPKG_CONFIG_EXECUTABLE="$pkgconfig_bin" >"$out/configure.log" 2>&1 ||
    { tail -40 "$out/configure.log"; exit 1; }
# Prove the prefix was used, not some system copy.
grep -q "^msgpack_DIR:PATH=$P/" "$B/CMakeCache.txt" ||
    { echo "device_check: msgpack not taken from $P" >&2; grep msgpack_DIR "$B/CMakeCache.txt"; exit 1; }
for mod in LIBEVENT INIH SYSTEMD CMOCKA; do
    grep -q "^${mod}_LIBRARY_DIRS:INTERNAL=$P/" "$B/CMakeCache.txt" ||
        { echo "device_check: $mod not taken from $P" >&2; grep "^${mod}_LIBRARY_DIRS" "$B/CMakeCache.txt"; exit 1; }
done
say "configured against $P"
[ "$stage" = configure ] && exit 0

# ---- 3. build only what the check runs -------------------------------------
# The gpu label's tests: the same cases CI runs on the emulator (test_emu and
# the sm_86 rerun exist only in emulation builds).
targets=(test_gpu_backend test_gpu_ops test_gpu_fused test_gpu_layer test_gpu_qmma test_gpu_attn test_gpu_model test_gpu_graph test_gpu_serve
         test_gpu_spec test_gpu_pages test_gpu_export kvd kvctl bench_gpu kvd-gguf-gen)
say "build ${targets[*]} (-j$jobs)"
cmake --build "$B" -j"$jobs" --target "${targets[@]}" >"$out/build.log" 2>&1 ||
    { grep -E "error|Error" "$out/build.log" | head -40; exit 1; }
say "built"
[ "$stage" = build ] && exit 0

# ---- 4. tests, the benchmark, one ncu pass; the tables last ----------------
# Budget (< 10 min on an H200 in all): build ~3-5 min (sm_90 only, -j16),
# tests <= 4 min, bench_gpu <= 5 min, ncu <= 3 min; each stage has its own
# timeout, so a hang costs that stage, not the run.
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
    --format=csv >"$out/nvidia-smi.txt" 2>&1 || true
say "gpu tests"
test_rc=0
ctest --test-dir "$B" -L gpu --output-on-failure --timeout 240 >"$out/ctest.log" 2>&1 || test_rc=$?
[ $test_rc -eq 0 ] || grep -B2 -A30 -E "FAILED|Failed|failure" "$out/ctest.log" | head -80
if [ "${KVD_DC_SANITIZER:-0}" = 1 ]; then # opt-in: out-of-bounds/race check of every op
    cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    say "compute-sanitizer memcheck test_gpu_ops"
    (cd "$B/tests/gpu" && KVD_TOOLS_DIR="$B/bin" timeout 200 "$cs" --tool memcheck \
        --error-exitcode 9 "$B/bin/test_gpu_ops") >"$out/memcheck.log" 2>&1 || test_rc=$?
    tail -5 "$out/memcheck.log"
fi
say "bench_gpu"
bench_rc=0
timeout 300 "$B/bin/bench_gpu" >"$out/bench.txt" 2>&1 || bench_rc=$?
# One ncu pass over one launch of each projection type (1 and 8 tokens; the
# K-quants' int8 GEMM at 512),
# decode attention and a prefill chunk (bench_gpu --only ncu): time, DRAM
# bytes and throughput, occupancy, registers, load sectors per request. The
# clocks are left as they are (--clock-control none).
ncu_rc=0
if [ "${KVD_DC_NCU:-1}" = 1 ]; then
    ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
    if [ -n "$ncu_bin" ]; then
        say "ncu ($ncu_bin)"
        metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,smsp__inst_executed.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active
        timeout 180 "$ncu_bin" --clock-control none --csv --page raw --metrics "$metrics" \
            -k 'regex:^(gemv|quant|qmma|attn|deq|to_bf16)' "$B/bin/bench_gpu" --only ncu \
            >"$out/ncu.csv" 2>"$out/ncu.log" || ncu_rc=$?
        python3 - "$out/ncu.csv" >"$out/ncu-summary.txt" 2>>"$out/ncu.log" <<'PY' || true
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if len(rows) < 3:
    sys.exit("no ncu rows")
head, data = rows[0], rows[2:]  # row 1 holds the units
col = {h: i for i, h in enumerate(head)}
def g(r, k, f=float):
    try:
        return f(r[col[k]].replace(",", ""))
    except (KeyError, ValueError):
        return 0
print("%-44s %9s %8s %6s %6s %5s %7s %6s" % ("kernel", "us", "DRAM MB", "DRAM%", "occ%", "regs", "sect/rq", "tc%"))
for r in data:
    name = r[col.get("Kernel Name", 4)][:44]
    req = g(r, "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum")
    sect = g(r, "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum")
    print("%-44s %9.1f %8.1f %6.1f %6.1f %5d %7.1f %6.1f" % (
        name, g(r, "gpu__time_duration.sum") / 1e3, g(r, "dram__bytes_read.sum") / 1e6,
        g(r, "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
        g(r, "sm__warps_active.avg.pct_of_peak_sustained_active"),
        int(g(r, "launch__registers_per_thread")), sect / req if req else 0,
        g(r, "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active")))
PY
    else
        echo "device_check: no ncu on this machine" | tee "$out/ncu.log"
    fi
fi
say "done: tests rc $test_rc, bench rc $bench_rc, ncu rc $ncu_rc"
echo
echo "== gpu tests"
grep -E "tests passed|tests failed|\*\*\*Failed|Skipped|SKIP" "$out/ctest.log" || true
if [ -s "$out/ncu-summary.txt" ]; then
    echo "== ncu (one launch each; full CSV in ncu.csv)"
    cat "$out/ncu-summary.txt"
fi
[ $bench_rc -eq 0 ] || tail -20 "$out/bench.txt"
sed -n '/== bench_gpu summary/,$p' "$out/bench.txt"
exit $(( test_rc != 0 || bench_rc != 0 ))
