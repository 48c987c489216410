#!/usr/bin/env bash
# Everything that needs a GPU, in one go (within 8 minutes: 200 + 80 + 140 s at most):
#   bash tests/gpu/run.sh
# 1. tests/gpu/gpu_world.py: every verb with CUDA tensors (the checks tests/gpu/test_gpu.py
#    reads); 2. examples/gpu_learner.py; 3. benchmarks/gpu.py. Needs only torch with CUDA
# and this checkout (installed with `pip install --no-deps -e .`; no pytest needed).
# Results go under $OUT when it is set (else a temporary folder); the last line is a summary.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
started=$SECONDS
python -m pip install --quiet --no-deps --no-build-isolation -e . >"$out/install.txt" 2>&1 \
    || python -m pip install --quiet --no-deps -e . >>"$out/install.txt" 2>&1 \
    || echo "pip could not install this checkout (see $out/install.txt): using PYTHONPATH"
# Without network a build may fail (no setuptools to fetch): the checkout runs as it is.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import asyncrpc" || { echo "gpu run: asyncrpc does not import; stopped"; exit 1; }
python - <<'PY' | tee "$out/machine.txt"
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, "
      f"cuda {torch.cuda.is_available()}, "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}")
PY

timeout 200 python tests/gpu/gpu_world.py "$out/gpu_checks.json" >"$out/gpu_world.txt" 2>&1
world=$?
checks=$(python - "$out/gpu_checks.json" <<'PY'
import json, sys
try:
    found = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    print(f"no checks ({exc})"); raise SystemExit
rows = {k: v for k, v in found.items() if isinstance(v, dict)}
for name, row in rows.items():
    print(f"  {'ok  ' if row.get('ok') else 'FAIL'} {name}: "
          f"{ {k: v for k, v in row.items() if k not in ('ok', 'traceback')} }", file=sys.stderr)
print(f"{sum(bool(r.get('ok')) for r in rows.values())}/{len(rows)} checks ok")
PY
)

timeout 80 python examples/gpu_learner.py --rounds 20 >"$out/gpu_learner.txt" 2>&1
example=$?
tail -1 "$out/gpu_learner.txt"

timeout 140 python benchmarks/gpu.py --json "$out/gpu_benchmark.json" 2>&1 | tee "$out/gpu_benchmark.txt"
bench=${PIPESTATUS[0]}

echo "gpu run: $checks (gpu_world exit $world); example exit $example; benchmark exit $bench;" \
     "$((SECONDS - started)) s; results in $out"
