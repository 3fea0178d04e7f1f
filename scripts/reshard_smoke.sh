#!/usr/bin/env bash
# The standard reshard validation set: save at N ranks, resume at M, for
# 2->4, 4->2 and 2->1, with the debug recipe (NCCL when 4 GPUs are visible,
# gloo on CPU otherwise). Exits non-zero if any pair breaks its tolerance:
# with agreed blocking (the default) the state after every load must be
# bit-exact.
#
#   scripts/reshard_smoke.sh                      # S=4, K=3, global batch 16
#   scripts/reshard_smoke.sh --out /tmp/reshard   # any validate_reshard.py option
#   scripts/reshard_smoke.sh --blocking per_rank  # format v1: exact splits, bounded merges
#   RECIPE=recipes/llama_gefen_mixed.toml scripts/reshard_smoke.sh
#   RECIPE=recipes/llama_gefen_global_order.toml scripts/reshard_smoke.sh --pairs 2:2@tp2,4@tp2:2
#                                                 # other layouts (a later --pairs replaces the set)
#
# Python: $PYTHON, else the active virtualenv's, else ./.venv's, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -n "${VIRTUAL_ENV:-}" ]]; then
  py=python
elif [[ -x .venv/bin/python ]]; then
  py=.venv/bin/python
else
  py=python3
fi
exec "$py" scripts/validate_reshard.py --recipe "${RECIPE:-recipes/llama_gefen.toml}" --pairs 2:4,4:2,2:1 "$@"
