#!/bin/bash
# benchmarks/dtype/bf16_smollm2.json: the main table's recipes on SmolLM2-135M in bfloat16 and
# float32, 4 windows x 1,024 tokens of the built-in Python docs (evaluation split), decode mode,
# residual 128 for every recipe, the committed profile benchmarks/long_context/smollm2-135m/profile.
# Peers run on the original weights; kvcalib-N through a folder converted with that profile,
# scored against the source model at the same dtype (--reference source), so the fused
# rotations' rounding at that dtype is inside its KL. Usage: benchmarks/dtype/run.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
work=${1:-/tmp/kvcalib-dtype}
profile=benchmarks/long_context/smollm2-135m/profile
mkdir -p "$work"
for bits in 2 3 4; do
  kvcalib convert --recipe "kvcalib-$bits" --profile "$profile" -o "$work/kvcalib-$bits" --force
done
for dtype in bfloat16 float32; do
  common=(--dtype "$dtype" --residual 128 --windows 4 --seq-len 1024 --mode decode)
  kvcalib eval smollm2-135m --recipe fp16 --recipe kivi-2 --recipe kvquant-2 \
    --recipe turboquant-2.5 --profile "$profile" "${common[@]}" --json "$work/${dtype}_peers.json"
  for bits in 2 3 4; do
    kvcalib eval "$work/kvcalib-$bits" --reference source "${common[@]}" \
      --json "$work/${dtype}_kvcalib-$bits.json"
  done
done
python - "$work" <<'PY'
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
record = {
    "setup": "SmolLM2-135M-Instruct on CPU, 4 windows x 1,024 tokens of the built-in Python docs "
    "(evaluation split), decode mode, residual 128 for every recipe, profile "
    "benchmarks/long_context/smollm2-135m/profile; peers on the original weights, kvcalib-N "
    "converted with that profile and scored against the source model at the same dtype "
    "(kvcalib eval --reference source); benchmarks/dtype/run.sh",
}
for dtype in ("bfloat16", "float32"):
    rows = []
    for path in sorted(work.glob(f"{dtype}_*.json")):
        rows += json.loads(path.read_text())
    record[dtype] = rows
Path("benchmarks/dtype/bf16_smollm2.json").write_text(json.dumps(record, indent=1) + "\n")
PY
