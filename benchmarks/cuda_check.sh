#!/usr/bin/env bash
# The CUDA paths of this toolkit, run for real on a GPU machine in one command (about 8 minutes at most):
#
#     bash benchmarks/cuda_check.sh            # from the repository root; nothing is installed
#
# Runs with PYTHONPATH=<repo root> and $PYTHON (default: python, else python3), so it needs no `pip install -e .`.
# 1. environment: python, torch, onnxruntime, onnx versions, the providers, which imports fail;
#    stops here when a core import fails or CUDAExecutionProvider is missing or cannot start
#    (a missing pytest, tokenizers or click skips only the steps that need it);
# 2. the CUDA tests (pytest, junit XML);
# 3. exports of a tiny preset (float32, float16, and int4 with float16 activations), `export-onnx verify` on
#    cpu+cuda with the float16 companion (the attribution), the float16 one and the int4 one (its quality
#    profile) on cuda, and the pytest plugin on cuda;
# 4. the benchmark on cuda, one round.
# Each step has its own time limit (all within CUDA_CHECK_BUDGET seconds, default 450) and a failed step does
# not stop the next; a summary ends the run.
# Logs and reports go to $OUT when it is set (the device machine's returned folder), else to a temp folder.
# Set CUDA_CHECK_ARTIFACTS=DIR to use DIR/fp32, DIR/fp16 and DIR/int4-float16 (exported elsewhere) instead of
# exporting here.
#
# Exit codes: 0 every step passed; 1 some step failed or was skipped; 3 CUDAExecutionProvider is not
# available or cannot start (nothing else ran); 4 a core import fails (nothing else ran).

set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1
PY="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/cuda_check.XXXXXX")"
REPORTS="${OUT:-$WORK}"
[ -n "${OUT:-}" ] && trap 'rm -rf "$WORK"' EXIT  # the artifacts; the reports are in $OUT
mkdir -p "$REPORTS"
PRESET=minimind-3-tiny
BUDGET="${CUDA_CHECK_BUDGET:-450}"  # seconds for the whole run: the summary comes before an 8-minute limit
SUMMARY=()
FAILED=0

# step NAME SECONDS COMMAND...: run it under `timeout` (SECONDS, or what is left of $BUDGET), its output on
# screen and in $REPORTS/NAME.log
step() {
    local name="$1" limit="$2"; shift 2
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 15 ]; then skip "$name" "the ${BUDGET}s budget is spent"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo; echo "=== $name (limit ${limit}s): $*"
    local begin=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$REPORTS/$name.log"
    local rc=${PIPESTATUS[0]} verdict=PASS
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && verdict="TIMEOUT"
    [ "$rc" -ne 0 ] && [ "$verdict" = PASS ] && verdict=FAIL
    [ "$verdict" = PASS ] || FAILED=1
    SUMMARY+=("$(printf '%-22s %-7s rc=%-3s %4ss' "$name" "$verdict" "$rc" "$((SECONDS - begin))")")
}

skip() {  # skip NAME REASON
    echo; echo "=== $1: SKIPPED ($2)"
    SUMMARY+=("$(printf '%-22s SKIPPED (%s)' "$1" "$2")"); FAILED=1
}

summary() {
    echo; echo "=== summary (reports in $REPORTS)"
    printf '%s\n' "${SUMMARY[@]}" | tee "$REPORTS/summary.txt"
}

# ---------------------------------------------------------------------------------------------- 1. environment
echo "=== environment"
if command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>&1 | head -4; else echo "nvidia-smi: not found"; fi
"$PY" - <<'EOF' 2>&1 | tee "$REPORTS/environment.log"
import importlib, sys, warnings
warnings.simplefilter("ignore")  # e.g. click's deprecated __version__
print("python", sys.version.split()[0])
CORE = ["numpy", "torch", "onnx", "onnxruntime", "onnxscript", "exporter.runtime.runner", "exporter.export.pipeline",
        "exporter.verify.engine", "reference"]
STEPS = ["pytest", "tokenizers", "click", "exporter.cli", "onnxruntime_genai"]  # some steps, or optional
failed = {}
for name in CORE + STEPS:
    try:
        module = importlib.import_module(name)
        print(f"import {name}: ok {getattr(module, '__version__', '')}")
    # a broken install (OSError) counts as much as a missing one; exporter.cli exits (2) when a dependency fails
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"import {name}: FAILED ({failed[name]})")
if "torch" not in failed:
    import torch
    print("torch.cuda.is_available():", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
cuda = None  # why CUDA cannot run here
if "onnxruntime" not in failed:
    import onnxruntime as ort
    print("onnxruntime", ort.__version__, ort.get_device(), "providers:", ort.get_available_providers())
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        cuda = "CUDAExecutionProvider not available in this onnxruntime build"
    elif "exporter.runtime.runner" not in failed:
        from exporter.runtime.providers import cuda_unusable
        if (why := cuda_unusable()) is not None:
            cuda = f"CUDAExecutionProvider cannot start: {why}"
code = 0
if core := [name for name in CORE if name in failed]:
    print(f"CUDA_CHECK: core imports failed: {', '.join(core)}; nothing else runs")
    code = 4
if cuda:
    print(f"CUDA_CHECK: {cuda}; nothing else runs")
    code = code or 3
print("CUDA_CHECK_STEP_IMPORTS_FAILED=" + ",".join(name for name in STEPS if name in failed))
sys.exit(code)
EOF
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
    echo "CUDA_CHECK: stopped early, exit $rc (3: no usable CUDAExecutionProvider, 4: a core import fails)"
    exit "$rc"
fi
MISSING="$(sed -n 's/^CUDA_CHECK_STEP_IMPORTS_FAILED=//p' "$REPORTS/environment.log")"
missing() { [[ ",$MISSING," == *",$1,"* ]]; }
JUNIT() { echo "--junitxml=$REPORTS/$1.xml"; }

# ---------------------------------------------------------------------------------------------- 2. the CUDA tests
if missing pytest || missing tokenizers; then
    skip pytest-cuda "pytest or tokenizers does not import"
else
    # test_parity: both artifacts against the reference on CUDA, default providers (cpu + cuda);
    # test_runtime: an absent CUDA (simulated) and one that cannot start (skips where it starts)
    step pytest-cuda 180 "$PY" -m pytest -q -rs -p no:cacheprovider "$(JUNIT pytest-cuda)" \
        tests/verify/test_parity.py tests/runtime/test_runtime.py -k "cuda or default_providers"
fi

# ---------------------------------------------------------------------------------------------- 3. export, verify, plugin
if [ -n "${CUDA_CHECK_ARTIFACTS:-}" ]; then
    FP32="$CUDA_CHECK_ARTIFACTS/fp32"; FP16="$CUDA_CHECK_ARTIFACTS/fp16"; INT4="$CUDA_CHECK_ARTIFACTS/int4-float16"
elif missing click; then
    FP32=""; skip export "click does not import"
else
    FP32="$WORK/fp32"; FP16="$WORK/fp16"
    step export-fp32 60 "$PY" -m exporter.cli export --preset "$PRESET" -o "$FP32" -q
    step export-fp16 60 "$PY" -m exporter.cli export --preset "$PRESET" --dtype float16 -o "$FP16" -q
    INT4="$WORK/int4-float16"
    step export-int4-fp16 60 "$PY" -m exporter.cli export --preset "$PRESET" --dtype int4 --activations float16 \
        -o "$INT4" -q
fi
if [ -z "$FP32" ] || missing click; then
    skip verify "no artifact or click does not import"
else
    step verify-fp32-cpu-cuda 90 "$PY" -m exporter.cli verify "$FP32" --provider cpu --provider cuda \
        --fp16-companion "$FP16" --no-genai --report-json "$REPORTS/verify-fp32.json" --junit "$REPORTS/verify-fp32.xml"
    step verify-fp16-cuda 60 "$PY" -m exporter.cli verify "$FP16" --provider cuda --no-genai --no-sweep \
        --report-json "$REPORTS/verify-fp16.json"
    if [ -d "$INT4" ]; then
        step verify-int4-fp16-cuda 60 "$PY" -m exporter.cli verify "$INT4" --provider cuda --no-sweep \
            --report-json "$REPORTS/verify-int4-float16.json"
    else
        skip verify-int4-fp16-cuda "no folder $INT4"
    fi
    step generate-cuda 30 "$PY" -m exporter.cli generate "$FP32" --provider cuda --prompt-ids 1,5,9 --prompt-ids 4,7 --max-new-tokens 8
fi
if [ -n "$FP32" ] && ! missing pytest; then
    # the plugin is registered by the package's entry point only when installed; else load it by name
    PLUGIN=(-p exporter.cli.pytest_plugin)
    "$PY" -c 'import importlib.metadata as m, sys; sys.exit(not any(e.name == "export-onnx" for e in
              m.entry_points(group="pytest11")))' 2>/dev/null && PLUGIN=()
    step plugin-cuda 60 "$PY" -m pytest -q -p no:cacheprovider "${PLUGIN[@]}" "$(JUNIT plugin-cuda)" \
        "--artifacts=$FP32" --artifact-provider cuda
fi

# ---------------------------------------------------------------------------------------------- 4. the benchmark
if [ -n "$FP32" ]; then
    step benchmark-cuda 90 "$PY" benchmarks/runtime.py --artifact "$FP32" --provider cuda --rounds 1 --json
fi

summary
exit "$FAILED"
