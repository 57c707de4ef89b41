#!/usr/bin/env bash
# FedLAP-DP against DP-FedAvg by client size at matched epsilon: FashionMNIST non-IID
# (5 clients x 2 classes), the full split (12,000 records per client) and the cut to 1,600
# (--set client_records=1600), epsilon 3 and 10, after 1 and after 3 rounds (each count its
# own sigma), seeds 0-2, FedLAP-DP with the small schedule (--schedule small: B 64, T = 10,
# train's defaults for digits-sized clients). Two compare runs at a time, one thread each;
# about two and a half CPU hours on the 2-core machine. The 1,600-record cells at epsilon 3
# are also in benchmarks/fashion_small_clients.sh. Writes runs/by-size/<size>-<method>-eps<e>/.
# Then train's default for 12,000-record clients, the large schedule (B 256, T = 200 in a
# one-round run, 50 from three rounds on), at epsilon 3 after 1 and 3 rounds, one seed per
# compare run, against DP-FedAvg with its 1,600-record validation pick (B 256,
# benchmarks/experiments/fashion_large_schedule.sh), applied unchanged; and the same two at epsilon 10
# after one round on the 1,600-record clients (three FedLAP-DP runs at once, about 3.7 GB
# each): about four more CPU hours. Then epsilon 10 with the large schedule after 3 rounds
# at both sizes and after 1 round on the 12,000-record clients, FedLAP-DP against DP-FedAvg's
# B 256 pick, two queues side by side: about three and a half more CPU hours. Then epsilon 3
# after 10 rounds on the 12,000-record clients: FedLAP-DP against DP-FedAvg's B 256 pick and
# its defaults, two queues side by side: about four more CPU hours. Last, epsilon 10 after 10
# rounds on the 1,600-record clients and then on the 12,000-record ones, the same way: about
# three and a half and four and a half more CPU hours.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin/fedlap-privacy}
DATA=${DATA:-data/fashion-mnist}
OUT=${OUT:-runs/by-size}
SIZES=${SIZES:-12000 1600}
EPS=${EPS:-3 10}
jobs=()
for size in $SIZES; do
  for eps in $EPS; do
    for method in fedlap-dp dp-fedavg; do
      jobs+=("$size $method $eps")
    done
  done
done
printf '%s\n' "${jobs[@]}" | xargs -P 2 -L 1 sh -c '
  small=$([ "$2" = fedlap-dp ] && echo "--schedule small")
  "$0" compare --dataset fashion-mnist --data-dir "'"$DATA"'" --methods "$2" --eps "$3" \
    --rounds 1,3 --seeds 3 --set client_records="$1" --threads 1 $small \
    --out "'"$OUT"'/$1-$2-eps$3" > /dev/null' "$BIN"

large=("$BIN" compare --dataset fashion-mnist --data-dir "$DATA" --eps 3 --rounds 1,3 --threads 1)
for seed in 0 1 2; do
  "${large[@]}" --methods fedlap-dp --seeds 1 --seed $seed \
      --out "$OUT/12000-fedlap-large-eps3-s$seed" > /dev/null
done &
"${large[@]}" --methods dp-fedavg --seeds 3 --set batch_size=256 \
    --out "$OUT/12000-fedavg-B256-eps3" > /dev/null
wait

cut=("$BIN" compare --dataset fashion-mnist --data-dir "$DATA" --set client_records=1600
     --eps 10 --rounds 1 --threads 1)
for seed in 0 1 2; do
  "${cut[@]}" --methods fedlap-dp --seeds 1 --seed $seed \
      --out "$OUT/1600-fedlap-large-eps10-s$seed" > /dev/null &
done
wait
"${cut[@]}" --methods dp-fedavg --seeds 3 --set batch_size=256 \
    --out "$OUT/1600-fedavg-B256-eps10" > /dev/null

# the large schedule against DP-FedAvg (B 256 unless FEDAVG_B is set), one compare run per
# FedLAP-DP seed and one for DP-FedAvg's three seeds
run_large() {  # eps size rounds method seeds...
  local eps=$1 size=$2 rounds=$3 method=$4 seed b=${FEDAVG_B:-256}
  shift 4
  local args=("$BIN" compare --dataset fashion-mnist --data-dir "$DATA" --eps "$eps"
              --rounds "$rounds" --threads 1 --methods "$method")
  [ "$size" = 1600 ] && args+=(--set client_records=1600)
  if [ "$method" = dp-fedavg ]; then
    "${args[@]}" --seeds 3 --set batch_size="$b" \
        --out "$OUT/$size-fedavg-B$b-eps$eps-r$rounds" > /dev/null
    return
  fi
  for seed in "$@"; do
    "${args[@]}" --seeds 1 --seed "$seed" \
        --out "$OUT/$size-fedlap-large-eps$eps-r$rounds-s$seed" > /dev/null
  done
}
# epsilon 10: 3 rounds at both sizes, 1 round at 12,000 records; two queues at a time
{ run_large 10 1600 3 fedlap-dp 0 1 2; run_large 10 1600 3 dp-fedavg
  run_large 10 12000 1 fedlap-dp 0 1; } &
{ run_large 10 12000 3 fedlap-dp 0 1 2; run_large 10 12000 3 dp-fedavg
  run_large 10 12000 1 fedlap-dp 2; run_large 10 12000 1 dp-fedavg; } &
wait

# 10 rounds: FedLAP-DP's seeds 0-2 in two queues, DP-FedAvg's B 256 pick and its defaults
# after seed 1 (a third run on two cores made each FedLAP-DP round 768 s instead of 390-490 s)
run_ten() {  # eps size
  { run_large "$1" "$2" 10 fedlap-dp 0 2; } &
  { run_large "$1" "$2" 10 fedlap-dp 1; run_large "$1" "$2" 10 dp-fedavg
    FEDAVG_B=64 run_large "$1" "$2" 10 dp-fedavg; } &
  wait
}
run_ten 3 12000
run_ten 10 1600
run_ten 10 12000
