#!/usr/bin/env bash
# The GPU benchmark in one command, for one H200 (or any CUDA GPU) with no network, in at most 10 minutes:
#   1. installs TRL, datasets (+ the dependencies the image lacks) and this package from the wheels in .whl/
#      (made beforehand, where PyPI is reachable, by bench/make_wheels.sh) into /tmp/site, without any index;
#   2. runs bench/gpu_bench.py (random-weight Qwen3-0.6B shape, bf16, 64 prompts x 8 completions x 512 tokens),
#      which writes gpu_bench.json and gpu_bench.md to $OUT (or bench/results/gpu) after every trainer.
# Expects python3 with torch (CUDA), transformers, accelerate and peft. Extra arguments go to gpu_bench.py
# (e.g. `bench/gpu.sh --tiny` for a CPU smoke test of the whole path).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEEL_DIR:-.whl}
SITE=${SITE:-/tmp/site}
LIMIT_S=${LIMIT_S:-590}          # the whole script, installation included
OUT_DIR=${OUT:-bench/results/gpu}

ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no wheels in $WHEELS: run bench/make_wheels.sh first" >&2; exit 2; }
wheels=("$WHEELS"/*.whl)
# pyarrow ships as an optional wheel: the image's own is used when it is recent enough for datasets (>= 24)
if ! "$PY" -c 'import sys, pyarrow; sys.exit(int(pyarrow.__version__.split(".")[0]) < 24)' 2>/dev/null; then
    if ls "$WHEELS"/optional/pyarrow-*.whl >/dev/null 2>&1; then
        wheels+=("$WHEELS"/optional/pyarrow-*.whl)
        echo "installing the shipped pyarrow (the image has none, or one older than 24)"
    else
        echo "warning: pyarrow >= 24 missing and none shipped (bench/make_wheels.sh without --no-pyarrow)" >&2
    fi
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_DISABLED=true PYTHONUNBUFFERED=1
"$PY" - <<'PYEOF'
import torch, transformers, accelerate, datasets, trl, trl_ppo_variants
print(f"python ok: torch {torch.__version__} (cuda {torch.cuda.is_available()}), transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}, datasets {datasets.__version__}, trl {trl.__version__}, "
      f"trl_ppo_variants {trl_ppo_variants.__version__} from {trl_ppo_variants.__file__}")
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
PYEOF
left=$((LIMIT_S - SECONDS))
mkdir -p "$OUT_DIR"
# gpu_bench starts no trainer it cannot finish within its budget; `timeout` is the backstop (results are written
# after every trainer, so what was measured survives)
timeout --signal=INT --kill-after=15 "$left" "$PY" bench/gpu_bench.py --out "$OUT_DIR" --budget-s $((left - 20)) "$@" \
    2>&1 | tee "$OUT_DIR/gpu_bench.log"
