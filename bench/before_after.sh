#!/bin/bash
# Before/after runs of the benches on one device machine, one after the other (bench/before_after.py
# compares them). The "before" code is a copy of an earlier commit in _before/ (ignored by git, so
# name it in the device's carry list):
#   rm -rf _before && mkdir _before && git archive <before> tiermem bench | tar -x -C _before
#   bash bench/before_after.sh <before> <after> bw infer train_before train_after suite1 suite2
# $OUT gets each run's log, the GPU suite's logs and a tarball of the result files written.
set -u
B=$1; A=$2; shift 2
R=$OUT; mkdir -p _before/bench/results bench/results; STAMP=$R/.stamp; touch $STAMP
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv > $R/gpu.txt
run() {  # dir commit name limit cmd...
  d=$1; c=$2; n=$3; lim=$4; shift 4
  (cd $d && env -u OUT TIERMEM_COMMIT=$c PYTHONPATH=. timeout $lim python3 "$@" > $R/$n.log 2>&1; echo "rc=$?" >> $R/$n.log)
}
P1="tests/test_gpu_core.py tests/test_gpu_cupy.py tests/test_gpu_faults.py tests/test_gpu_load.py tests/test_gpu_module.py tests/test_gpu_recompute.py tests/test_gpu_staging.py tests/test_gpu_torch_alloc.py"
P2="tests $(for f in $P1; do printf -- '--ignore=%s ' $f; done)"   # every other gpu test
for step in "$@"; do
  case $step in
    bw) run _before $B bw_before 120 bench/bandwidth.py; run . $A bw_after 120 bench/bandwidth.py;;
    infer) run _before $B infer_before 280 bench/offload_infer.py; run . $A infer_after 280 bench/offload_infer.py;;
    train_before) run _before $B train_before 330 bench/train_budget.py;;
    train_after) run . $A train_after 330 bench/train_budget.py;;
    p4_after) run . $A p4_after 290 bench/train_budget.py --only 4;;
    p4_before) run _before $B p4_before 290 bench/train_budget.py --only 4;;
    suite1) TIERMEM_GPU_MEMLOG=$R/memlog1.txt run . $A suite1 300 -m pytest -m gpu -p no:cacheprovider -q $P1;;
    suite2) TIERMEM_GPU_MEMLOG=$R/memlog2.txt run . $A suite2 300 -m pytest -m gpu -p no:cacheprovider -q $P2;;
  esac
done
tar czf $R/results.tgz $(find bench/results _before/bench/results -newer $STAMP -type f) 2>/dev/null
ls -la $R; for f in $R/*.log; do echo "== $f"; tail -4 $f; done
