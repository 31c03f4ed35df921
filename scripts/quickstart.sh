#!/usr/bin/env bash
# Set up the environment and train a small PyTorch model on a local byteps_like cluster
# (scheduler, 1 server, 2 workers on this machine). Extra arguments go to the training script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/bpslaunch --local --workers 2 --servers 1 -- \
  .venv/bin/python examples/pytorch/train_digits.py "$@"
