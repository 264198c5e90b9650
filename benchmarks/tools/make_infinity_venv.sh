#!/usr/bin/env bash
# The peer venv for benchmarks/bench_embeddings_server.py: Infinity (`infinity-emb`, its torch
# engine: sentence-transformers on torch's CPU wheel). Never a dependency of aioprefill.
# `pip install torch==2.13.0` first takes the CPU wheel that lies on this machine's disk, so
# Infinity's own requirement on torch is met without pulling a CUDA build.
#
#     bash benchmarks/tools/make_infinity_venv.sh [~/.cache/aioprefill/infinity-venv]
set -euo pipefail
VENV=${1:-$HOME/.cache/aioprefill/infinity-venv}
python3.11 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q "infinity-emb[server,torch]==0.0.78"
"$VENV/bin/python" -c "import infinity_emb, torch; print('infinity-emb', infinity_emb.__version__, 'torch', torch.__version__)"
