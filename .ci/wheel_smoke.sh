#!/usr/bin/env bash
# The package as users get it: a wheel built from the committed tree,
# installed (not editable) into a fresh environment, run from outside the
# source tree. An editable install (what the test suite uses) would still
# find a module or asset that the wheel leaves out; this does not.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

mkdir "$WORK/src"
git -C "$ROOT" archive HEAD | tar -x -C "$WORK/src"
python3 -m venv "$WORK/venv"
. "$WORK/venv/bin/activate"
pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
# torch pinned first: never let pip resolve another (CUDA) build.
pip install -q torch==2.13.0 "$WORK"/dist/gefen_titan-*.whl

cd "$WORK"
python - <<'PY'
import os
import gefen_titan
from gefen_titan.data import corpus as data
import gefen_titan.ft.heal, gefen_titan.ft.optimizer  # the FT package ships (torchft itself is the [ft] extra)
assert "site-packages" in gefen_titan.__file__, gefen_titan.__file__
for path in (data.DEFAULT_DATASET_PATH, data.DEFAULT_TOKENIZER_PATH):
    assert os.path.exists(path) and "site-packages" in path, path
print("wheel smoke: import ok from", os.path.dirname(gefen_titan.__file__))
PY
# One rank, two steps of the debug recipe: the builtin tokenizer and corpus
# must come from the installed package.
gefen-titan-train --job.config "$ROOT/recipes/llama_gefen_dp1.toml" --training.steps 2 \
    --checkpoint.interval 2 --job.dump_folder "$WORK/run" > "$WORK/train.log" 2>&1 \
    || { tail -40 "$WORK/train.log"; exit 1; }
grep -q "step:  2" <(sed 's/\x1b\[[0-9;]*m//g' "$WORK/train.log") || { tail -40 "$WORK/train.log"; exit 1; }
echo "wheel smoke: gefen-titan-train ran 2 steps from the installed wheel"
# The wheel ships the CPU step's C++ source (package data) and the step ran on it.
grep -q "Gefen (cpu parameters): the exact CPU kernel" "$WORK/train.log" \
    || { echo "wheel smoke: Gefen did not run the CPU kernel:"; grep -i "cpu step\|cpu parameters" "$WORK/train.log"; exit 1; }
echo "wheel smoke: Gefen's step ran on the CPU kernel (log: $(grep -o 'the exact CPU kernel[^(]*' "$WORK/train.log" | head -1))"
# The checkpoint tools of the installed console script on what it saved.
gefen-titan ckpt verify "$WORK/run/checkpoint/step-2"
gefen-titan ckpt inspect --json "$WORK/run/checkpoint/step-2" > "$WORK/inspect.json"
python -c "import json, sys; json.load(open(sys.argv[1]))" "$WORK/inspect.json"
echo "wheel smoke: gefen-titan ckpt verify / inspect ran on the saved checkpoint"
# The reshard validation as a user runs it on their own cluster: the installed
# console script, a recipe from the current directory (no checkout around it),
# the runs launched as `-m gefen_titan.train` from the wheel. One rank saved,
# one resumed (1:1, the state must be bit-exact and the loss equal), small
# settings: about a minute of CPU.
gefen-titan validate --help > "$WORK/validate_help.txt"
grep -q -- "--pairs" "$WORK/validate_help.txt" && grep -q -- "--reference-cache" "$WORK/validate_help.txt"
mkdir "$WORK/recipes"
cp "$ROOT/recipes/llama_gefen.toml" "$ROOT/recipes/llama_gefen_dp1.toml" "$WORK/recipes/"
gefen-titan validate --recipe recipes/llama_gefen_dp1.toml --pairs 1:1 --backend gloo \
    --steps-before 2 --steps-after 1 --global-batch 4 --local-batch 2 --out "$WORK/validate" \
    > "$WORK/validate.log" 2>&1 || { tail -40 "$WORK/validate.log"; exit 1; }
grep -q "all pairs within tolerance" "$WORK/validate.log" || { tail -40 "$WORK/validate.log"; exit 1; }
python - "$WORK/validate/report.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
(pair,) = report["pairs"]
assert pair["pair"] == "1->1" and pair["state"]["exact"] and pair["failures"] == [], pair
assert pair["loss_deviation"] == 0.0, pair["loss_deviation"]
PY
echo "wheel smoke: gefen-titan validate (1->1) passed from the installed wheel"
