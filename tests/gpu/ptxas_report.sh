#!/usr/bin/env bash
# Registers, spills and stack of every kernel as ptxas compiles it, one table
# row per kernel instantiation (for docs/performance.md: watched without a
# device). Needs nvcc; no GPU.
#   tests/gpu/ptxas_report.sh [ARCH...]     default: 90 80
#   tests/gpu/ptxas_report.sh --table > kernels/emu/ptxas_sm90.inc
# The second form writes the emulator's occupancy table (registers and static
# shared memory per instance on sm_90, kernels/emu/occupancy.cc) for the
# kernels whose launches ask for their occupancy.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
if [ "${1:-}" = --table ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    for f in "$root"/kernels/attn_decode.cu; do
        "$nvcc" -std=c++17 -O3 -arch=sm_90 -Xptxas -v -c -I"$root/kernels" -o "$tmp/k.o" "$f" \
            2>>"$tmp/ptxas.txt"
    done
    python3 - "$tmp/ptxas.txt" "$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')" <<'PY'
import re, subprocess, sys
rows, cur = {}, None
for line in open(sys.argv[1]):
    m = re.search(r"Compiling entry function '([^']+)'", line)
    if m:
        cur = m.group(1)
        continue
    m = re.search(r"Used (\d+) registers", line)
    if m and cur:
        s = re.search(r"(\d+) bytes smem", line)
        rows[cur] = (int(m.group(1)), int(s.group(1)) if s else 0)
        cur = None
names = subprocess.run(["c++filt"], input="\n".join(rows), capture_output=True,
                       text=True).stdout.splitlines()
print("// Registers and static shared memory of kernel instances on sm_90 as ptxas")
print(f"// {sys.argv[2]} -O3 compiles them, for the emulator's occupancy (occupancy.cc).")
print("// Generated: tests/gpu/ptxas_report.sh --table > kernels/emu/ptxas_sm90.inc")
print("// clang-format off")
for name, (regs, smem) in sorted((re.sub(r"\(.*\)$", "", n).replace("void ", ""), v)
                                 for n, v in zip(names, rows.values())):
    print(f'KVD_PTXAS("{name}", {regs}, {smem})')
print("// clang-format on")
PY
    exit 0
fi
archs=("$@")
[ ${#archs[@]} -gt 0 ] || archs=(90 80)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for arch in "${archs[@]}"; do
    for f in "$root"/kernels/*.cu; do
        "$nvcc" -std=c++17 -O3 -arch=sm_"$arch" -Xptxas -v -c -I"$root/kernels" \
            -o "$tmp/k.o" "$f" 2>>"$tmp/ptxas-$arch.txt"
    done
    python3 - "$tmp/ptxas-$arch.txt" "$arch" <<'PY'
import re, subprocess, sys
text = open(sys.argv[1]).read().splitlines()
rows, cur, props = [], None, {}
for line in text:
    m = re.search(r"Compiling entry function '([^']+)'", line)
    if m:
        cur = m.group(1)
        continue
    m = re.search(r"Function properties for (\S+)\s*$", line)
    if m:
        cur = m.group(1)
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and cur:
        props[cur] = m.groups()
        continue
    m = re.search(r"Used (\d+) registers", line)
    if m and cur:
        st = props.get(cur, ("?", "?", "?"))
        rows.append((cur, int(m.group(1))) + tuple(st))
names = subprocess.run(["c++filt"], input="\n".join(r[0] for r in rows), capture_output=True,
                       text=True).stdout.splitlines() if rows else []
print(f"| kernel (sm_{sys.argv[2]}) | registers | stack | spill st | spill ld |")
print("|---|---|---|---|---|")
for (mangled, regs, stack, ss, sl), name in sorted(zip(rows, names), key=lambda x: x[1]):
    name = re.sub(r"\(.*\)$", "", name).replace("void ", "")
    print(f"| `{name}` | {regs} | {stack} | {ss} | {sl} |")
PY
done
