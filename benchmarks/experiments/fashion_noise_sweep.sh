#!/usr/bin/env bash
# Why FedLAP-DP trails DP-FedAvg on small clients: accuracy against the noise multiplier at a
# fixed schedule. FashionMNIST non-IID, 1,600 records per client, one round, FedLAP-DP's
# small schedule (--schedule small: B 64, T = 10 accesses per client), seeds 0-2, for sigma
# in SIGMAS (0.001 is clipping and Poisson sampling without noise to speak of); sigma 0.82
# is epsilon 3 and is
# the small-client table of docs/results.md; "none" runs the non-private methods (FedLAP, FedAvg: no
# clipping, no noise, no Poisson batches). Two runs at a time, one thread each; about 50 CPU
# minutes. Writes runs/noise-sweep/<method>-sigma<s>-seed<k>/, prints one JSON line per run.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin/fedlap-privacy}
DATA=${DATA:-data/fashion-mnist}
OUT=${OUT:-runs/noise-sweep}
SIGMAS=${SIGMAS:-0.001 0.1 0.3 none}
jobs=()
for sigma in $SIGMAS; do
  for seed in 0 1 2; do
    if [ "$sigma" = none ]; then
      jobs+=("fedlap $sigma $seed" "fedavg $sigma $seed")
    else
      jobs+=("fedlap-dp $sigma $seed" "dp-fedavg $sigma $seed")
    fi
  done
done
printf '%s\n' "${jobs[@]}" | xargs -P 2 -L 1 sh -c '
  noise=$([ "$2" = none ] || echo "--sigma $2")
  small=$([ "$1" = fedlap-dp ] && echo "--schedule small")
  "$0" train --method "$1" --dataset fashion-mnist --data-dir "'"$DATA"'" --rounds 1 \
    $noise --seed "$3" --set client_records=1600 --threads 1 $small \
    --out "'"$OUT"'/$1-sigma$2-seed$3" > /dev/null' "$BIN"
for run in "$OUT"/*/; do
  python3 -c 'import json, sys; r = json.loads(open(sys.argv[1] + "metrics.jsonl").readlines()[-1]); print(json.dumps({"run": sys.argv[1].rstrip("/").split("/")[-1], "test_accuracy": r["test_accuracy"], "epsilon": r["epsilon"]}))' "$run"
done
