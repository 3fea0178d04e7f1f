#!/usr/bin/env bash
# One-GPU check (under 8 minutes on one CUDA GPU before the converters stage,
# which is not yet timed on one): the reshard kernels' tests
# on CUDA, their bandwidth against the device's, one-GPU training of the debug
# recipe with fused Gefen and NCCL, a checkpoint saved at 2 CPU ranks
# loaded onto the GPU with its state compared bit for bit, and GefenMuon
# (fused momentum on row shards = whole matrix; one-GPU training of its
# recipe), Gefen's factored second moment (its exact row/column sums over
# uneven cuts = whole on the GPU, its step against the CPU's, factored
# training), and the float8 and mxfp8 model converters (a few steps of the debug
# model under each with Gefen; mxfp8 needs compute capability 10.0, so it is
# reported skipped on Hopper); one JSON report.
#
#   scripts/gpu_check.sh                                  # report: outputs/gpu_check/report.json
#   scripts/gpu_check.sh --stages kernels,bandwidth --out /tmp/r.json
#
# Without CUDA it runs the CPU halves of the checkpoint and muon checks, skips the rest and
# exits 3. A stage that would start after --budget-s is reported "not run" and
# the run is no pass (status "incomplete", exit 4). Exit 0: every stage ran and
# passed; 1: a check failed; 2: bad arguments; 3: no CUDA; 4: a stage not run.
# The stages are benchmarks.gpu_check (its docstring says what
# each one checks). PYTHON picks the interpreter (default: python3, i.e. the
# active virtual environment's).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m benchmarks.gpu_check "$@"
