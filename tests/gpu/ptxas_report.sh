#!/usr/bin/env bash
# Registers, spills and stack of every kernel as ptxas compiles it, one table
# row per kernel instantiation (for docs/performance.md: watched without a
# device). Needs nvcc; no GPU.
#   tests/gpu/ptxas_report.sh [ARCH...]     default: 90 80
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
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
