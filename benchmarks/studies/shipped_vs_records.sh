#!/usr/bin/env bash
# The decoder with the shipped records and no FLASHGEN_DB (this tree) against the tree before them with
# its record files imported into FLASHGEN_DB, alternated in one run on a GPU machine. Prepare here:
#   mkdir -p .devrun/old .devrun/records
#   git archive a80a8b1 flashgen schedules targets runtime pyproject.toml benchmarks/model.py benchmarks/common.py benchmarks/peers.py | tar -x -C .devrun/old
#   cp benchmarks/results/h200_{gemm,fused,attention,tuning}_records.jsonl .devrun/records/
# then run `bash benchmarks/studies/shipped_vs_records.sh` there (results under $OUT).
set -uo pipefail
export PYTHONUNBUFFERED=1
R=.devrun/records
pip_site() { python3 -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --target "$2" "$1" >/dev/null 2>&1 || { echo "install $1 failed"; exit 1; }; }
pip_site . /tmp/new_site
pip_site .devrun/old /tmp/old_site
mkdir -p /tmp/home
run_after() {  # shipped records only: no FLASHGEN_DB, an empty home
  env -u FLASHGEN_DB HOME=/tmp/home FLASHGEN_CACHE_DIR=/tmp/cache_new PYTHONPATH=/tmp/new_site \
    python3 benchmarks/model.py "$@"
}
run_before() {
  FLASHGEN_DB=/tmp/before.db HOME=/tmp/home FLASHGEN_CACHE_DIR=/tmp/cache_old PYTHONPATH=/tmp/old_site \
    python3 .devrun/old/benchmarks/model.py "$@"
}
R=$PWD/$R
# from /tmp: the checkout's own flashgen/ folder must not shadow the installed trees
(cd /tmp && for f in $R/*.jsonl; do FLASHGEN_DB=/tmp/before.db PYTHONPATH=/tmp/old_site python3 -m flashgen.cli db import "$f"; done)
(cd /tmp && env -u FLASHGEN_DB HOME=/tmp/home PYTHONPATH=/tmp/new_site python3 -c "import flashgen, flashgen.db.shipped as s; print(flashgen.__file__, s.shipped_database().count(), 'shipped records')")
(cd /tmp && PYTHONPATH=/tmp/old_site python3 -c "import flashgen; print(flashgen.__file__)")
for round in 1 2; do
  run_after --batch 1 --quant bf16,w4a16 --peer-batch none --name model_b1_shipped_$round --out-dir $OUT
  run_before --batch 1 --quant bf16,w4a16 --peer-batch none --name model_b1_before_$round --out-dir $OUT
  [ $round = 2 ] && break
  run_after --batch 64 --quant bf16 --peer-batch none --name model_b64_shipped --out-dir $OUT
  run_before --batch 64 --quant bf16 --peer-batch none --name model_b64_before --out-dir $OUT
done
