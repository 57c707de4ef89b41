#!/usr/bin/env bash
# The digits comparison tables of docs/results.md: every method at epsilon 3 and 10 (3
# seeds), then the same methods with 20 IID clients, then FedLAP-DP, DP-FedAvg and DP-FedProx
# after 1, 3 and 10 rounds at matched epsilon. Prints each table and its wall time; results land
# in runs/compare-digits*/comparison.json (the copies docs/results.md cites are in docs/results/).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin/fedlap-privacy}
time "$BIN" compare --dataset digits --eps 3,10 --seeds 3 --out runs/compare-digits
time "$BIN" compare --dataset digits --eps 3,10 \
    --methods fedavg,dp-fedavg,ali-dpfl,dp-normfedavg,ldp-fl \
    --set clients=20 --set split=iid --set batch_size=32 --out runs/compare-digits-20iid
# accuracy against rounds at matched epsilon: each round count gets its own planned sigma
time "$BIN" compare --dataset digits --eps 3,10 --rounds 1,3,10 --seeds 3 \
    --methods fedlap-dp,dp-fedavg,dp-fedprox --out runs/compare-digits-rounds
