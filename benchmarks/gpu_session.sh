#!/usr/bin/env bash
# Every GPU check, in one run: for a GPU machine lent for a few minutes, with Python, PyTorch,
# numpy and a C compiler but no package registry (so no Cython: the core is compiled from
# the C that Cython wrote here, carried along as build/cython).
#
# Here, first:   python setup.py build_ext --inplace      (writes build/cython/gpudash/_core.c)
# Then on the GPU machine, from the repository root (the device tool: carry ["build/cython"]):
#                bash benchmarks/gpu_session.sh            (at most 535 s of steps; $OUT gets the logs)
#
# Steps, each with its own time limit, each logged to $OUT/NN-name.log, each one line in
# $OUT/summary.txt (its exit status and seconds); a step that fails does not stop the next:
#   1. the compiled core, from build/cython/gpudash/_core.c (Cython when it is installed);
#   2. install mode: the same model trains to the same loss on gpudash's allocator as on
#      PyTorch's, and the per-step time ratio (gpu_check_install.py; bar: <= 1.1x);
#   3. shadow mode: the what-if's predicted failing call and step at a lower fraction against
#      where PyTorch itself fails, and _snapshot()'s cost per ring entry
#      (gpu_check_shadow.py; its vectors go to $OUT/torch_vectors);
#   4. PyTorch's allocator recorded call by call, as vectors for tests/test_torch_vectors.py
#      (gpu_record_torch_vectors.py, into $OUT/torch_vectors);
#   5. the tests marked gpu that need no notebook packages (pytest -m gpu).
# Afterwards, here: copy $OUT/torch_vectors into tests/data/torch_vectors and the figures into
# docs/performance.md, with the date, the commit and the card.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)/gpu-session}"
mkdir -p "$OUT"
export OUT PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary="$OUT/summary.txt"
: > "$summary"

step() {   # step NAME SECONDS COMMAND...
    local name="$1" limit="$2"
    shift 2
    local log="$OUT/$name.log" t0 rc
    t0=$(date +%s)
    echo "== $name (at most ${limit}s): $*" | tee -a "$summary"
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    echo "   exit $rc after $(( $(date +%s) - t0 ))s; last lines:" | tee -a "$summary"
    tail -n 15 "$log" | sed 's/^/   | /' | tee -a "$summary"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" || true
  git rev-parse --short HEAD 2>/dev/null || true; } | tee -a "$summary"

compile_core() {
    if python -c "import Cython" 2>/dev/null; then
        python setup.py build_ext --inplace -q
        return
    fi
    python - <<'EOF'
import pathlib, runpy, subprocess, sysconfig
src = pathlib.Path("build/cython/gpudash/_core.c")
if not src.exists():
    raise SystemExit(f"{src} is missing: run `python setup.py build_ext --inplace` where "
                     "Cython is, and carry build/cython")
digest = runpy.run_path("gpudash/_sourcehash.py")["source_hash"](pathlib.Path("gpudash"))
out = pathlib.Path("gpudash") / ("_core" + sysconfig.get_config_var("EXT_SUFFIX"))
cmd = ["cc", "-O3", "-shared", "-fPIC", "-I" + sysconfig.get_paths()["include"],
       f'-DGPUDASH_SOURCE_HASH="{digest}"', str(src), "-o", str(out), "-lpthread", "-ldl"]
print(" ".join(cmd))
subprocess.check_call(cmd)
EOF
}
export -f compile_core
step 01-core 90 bash -c compile_core
step 02-core-check 15 python -c "import gpudash._accel as a; print(a.describe())"
step 03-install 140 python benchmarks/gpu_check_install.py --steps 300
step 04-shadow 140 python benchmarks/gpu_check_shadow.py --steps 40 --time-limit 130
step 05-vectors 60 python benchmarks/gpu_record_torch_vectors.py
step 06-gpu-tests 90 python -m pytest -q -m gpu -p no:cacheprovider tests/test_torch_install.py tests/test_torch_shadow.py tests/test_torch_vectors.py
echo "done; logs in $OUT" | tee -a "$summary"
