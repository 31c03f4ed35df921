#!/usr/bin/env bash
# The device measurements of issues 38 and 39, in parts of under ten minutes each, for the GPU
# machine (16 cores, one GPU). Measured on 2026-12-05 (docs/img/h100-2026-12-05/): every part
# once; on 2026-12-06 (docs/img/h100-2026-12-06/, h200-2026-12-06/): `links` with one thread's
# codec speeds, `cpu`'s emulated cluster with failover on and off, `sparse` with 4 threads;
# docs/img/h100-2026-12-06b/: `links` with the codec pool's speeds, and `sparse` for 40 steps
# under scripts/device/netns_losses.sh (the emulated NICs' drops and TCP timeouts).
#
#   . .devbundle/setup.sh && bash scripts/device/pending.sh routes   # GPU paths of the route plan
#   . .devbundle/setup.sh && bash scripts/device/pending.sh cpu      # server CPU, shapes, optimum
#   . .devbundle/setup.sh && bash scripts/device/pending.sh links    # auto, schedules, stragglers
#   . .devbundle/setup.sh && bash scripts/device/pending.sh sparse   # the sparse step, 4 threads
#
# Each command runs under a watchdog (timeout) and writes its JSON under $OUT (a temporary
# folder when OUT is not set); a failed command is reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
part=${1:?usage: pending.sh routes|cpu|links|sparse|stragglers}
failed=0

run() {  # run SECONDS COMMAND...: one measurement, its output's tail, its exit status
  local limit=$1
  shift
  echo "=== $*"
  timeout "$limit" "$@" 2>&1 | tail -25
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "=== exit status $rc: $*"; failed=$((failed + 1)); }
}

case "$part" in
  routes)  # issue 39 item 1: the route plan's GPU branches (NCCL, device chunks, device cast)
    python3 -c "from byteps_like import _core; print('crypto', _core.crypto_available())"
    run 120 env BYTEPS_FORCE_DISTRIBUTED=1 bpslaunch --local --workers 2 --servers 2 -- \
      python3 tests/integration/workers/cuda_push_pull_check.py --bench
    run 120 env API_DEVICE=cuda bpslaunch --local --workers 2 --servers 1 -- \
      python3 tests/frameworks/workers/conformance.py torch dtypes average compression async_forms
    run 120 env EQUIV_DEVICE=cuda bpslaunch --local --workers 2 --servers 1 -- \
      python3 tests/frameworks/workers/torch_equivalence.py sgd,adam,ddp,fp16 4
    run 120 env EQUIV_DEVICE=cuda BYTEPS_FUSION_BYTES=0 bpslaunch --local --workers 2 \
      --servers 1 -- python3 tests/frameworks/workers/torch_equivalence.py sgd,adam,ddp,fp16 4
    run 200 python3 -m byteps_like.bench train --models resnet50 --modes local,byteps_like \
      --workers 2 --servers 2 --device cuda --steps 20 --warmup 5 --json "$OUT/train.json"
    ;;
  cpu)  # issue 38 item 5: server core-s/GB, ResNet-50's shapes vs one flat tensor, optimum
    run 150 python3 -m byteps_like.bench pushpull --workers 2 --servers 1 --sizes 256M \
      --repeats 5 --skip-gloo --skip-raw --json "$OUT/pushpull.json"
    run 120 python3 scripts/device/zerocopy_loopback.py --gb 8 --runs 3
    run 150 python3 -m byteps_like.bench pushpull --shapes resnet50 --workers 2 --servers 2 \
      --repeats 10 --json "$OUT/shapes.json"
    run 150 env OMP_NUM_THREADS=8 python3 -m byteps_like.bench pushpull --shapes resnet50 \
      --workers 2 --servers 2 --repeats 10 --json "$OUT/shapes-8threads.json"
    run 200 python3 -m byteps_like.bench cluster --rate 25gbit,50gbit --workers 4 --servers 4 \
      --sizes 256 --repeats 3 --skip-gloo --skip-horovod --skip-priority --json "$OUT/cluster.json"
    run 200 env BYTEPS_SERVER_FAILOVER=0 python3 -m byteps_like.bench cluster --rate 25gbit,50gbit \
      --workers 4 --servers 4 --sizes 256 --repeats 3 --skip-gloo --skip-horovod --skip-priority \
      --json "$OUT/cluster-nofailover.json"
    ;;
  links)  # issue 38 items 2, 4, 6: auto against the fixed choices, a rate schedule, stragglers
    for r in 1gbit 10gbit 25gbit; do
      run 150 python3 -m byteps_like.bench cluster --compressors none,fp16,onebit,auto \
        --workers 2 --servers 2 --sizes 256 --rate "$r" --repeats 5 --warmup 5 --skip-horovod \
        --json "$OUT/auto-$r.json"
    done
    run 150 python3 -m byteps_like.bench cluster --compressors none,auto --workers 2 --servers 2 \
      --sizes 256 --rate 25gbit:20s,1gbit:20s,25gbit:20s --skip-horovod --json "$OUT/schedule.json"
    ;;
  sparse)  # issue 39's sparse step: each worker 16 / 4 = 4 torch threads (the bench's default
    # since 2026-12-05) against the one thread of the 30.5 ms figure
    for t in 0 1; do
      run 280 python3 -m byteps_like.bench sparse --rows 1000000 --workers 4 --servers 4 \
        --rate 10gbit --modes sparse --steps 20 --warmup 5 --threads "$t" \
        --json "$OUT/sparse-threads$t.json"
    done
    ;;
  stragglers)  # issue 38 item 2 on the device: 4 workers sharing the GPU + 2 servers
    for b in 0 1; do
      run 280 python3 -m byteps_like.bench train --models resnet50 --modes byteps_like \
        --workers 4 --servers 2 --device cuda --straggler 3:2 --steps 20 --warmup 5 \
        --env BYTEPS_BACKUP_WORKERS=$b --env BYTEPS_SERVER_FAILOVER=0 \
        --env BYTEPS_BACKUP_MAX_LAG=100 --json "$OUT/straggler-b$b.json"
    done
    ;;
  *) echo "pending.sh: unknown part $part (routes, cpu, links, sparse, stragglers)" >&2; exit 2 ;;
esac
echo "pending.sh $part: $failed command(s) failed; JSON in $OUT"
[ "$failed" -eq 0 ]
