#!/usr/bin/env bash
# The sparse step of this tree against an older one, alternated on one GPU machine (issue 39:
# the tables' pulls answered on the plane's I/O threads). Source .devbundle/setup.sh first (it
# installs this tree under /tmp/bpl); the older tree comes as .devbundle/old.tar (`git archive
# REV -o .devbundle/old.tar`; any NAME.tar there is another tree) and is installed under
# /tmp/bpl-old (/tmp/bpl-NAME). Each pass runs
#   python3 -m byteps_like.bench sparse --rows 1000000 --workers 4 --servers 4 --rate 10gbit
#     --modes MODES --steps 40 --warmup 5
# with this tree (new) and the older ones (old, NAME), in the order the arguments give:
#   bash scripts/device/sparse_ab.sh new old new old
# Records: $OUT/sparse-<i>-<which>.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
MODES=${MODES:-sparse}
# each NAME other than "new" is the tree .devbundle/NAME.tar, installed under /tmp/bpl-NAME
for which in "$@"; do
  [ "$which" = new ] || [ -d "/tmp/bpl-$which" ] || {
    [ -f ".devbundle/$which.tar" ] || { echo "no .devbundle/$which.tar"; exit 1; }
    rm -rf "/tmp/src-$which" && mkdir -p "/tmp/src-$which" &&
      tar -xf ".devbundle/$which.tar" -C "/tmp/src-$which"
    (cd "/tmp/src-$which" && python3 -m pip install -q --no-deps --no-build-isolation \
      --no-cache-dir --target "/tmp/bpl-$which" . > "/tmp/bpl-$which.log" 2>&1) ||
      { tail -20 "/tmp/bpl-$which.log"; exit 1; }
  }
done
i=0
for which in "$@"; do
  i=$((i + 1))
  lib=/tmp/bpl
  [ "$which" = new ] || lib=/tmp/bpl-$which
  echo "=== pass $i: $which ($lib)"
  PYTHONPATH=$lib:/tmp/site timeout 200 python3 -m byteps_like.bench sparse --rows 1000000 \
    --workers 4 --servers 4 --rate 10gbit --modes "$MODES" --steps 40 --warmup 5 \
    --json "$OUT/sparse-$i-$which.json" 2>&1 | grep -E "^\| (sparse|local) +\||step:|wait for|: send|CPU" | head -24
done
