#!/usr/bin/env bash
# One GPU session's checks, as one script that writes its results as it goes (a run cut off keeps what it wrote):
# the environment, `make test-gpu`'s tests on CUDA (pytest-xdist workers), then benchmarks/gpu.py at BERT-base and
# GPT-2-small sizes. For an offline CUDA machine that has torch, Lightning, transformers and peft but not opacus,
# dp-accounting or jsonargparse: wheels of those in .whl/ are installed into /tmp/site first (docs/performance.md,
# "On a GPU").
#
#     bash benchmarks/gpu_session.sh OUTDIR     # TEST_S, BENCH_S: each part's time limit in seconds (200, 240)
#
# OUTDIR gets env.txt, tests.txt, tests.xml (JUnit), gpu.txt and gpu.json.
set -u
out=${1:?usage: gpu_session.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import sys, torch, lightning, transformers, peft, opacus, dp_accounting
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__,
      'transformers', transformers.__version__, 'peft', peft.__version__, 'opacus', opacus.__version__)
import pl_dp.methods, pl_dp.callbacks, pl_dp.cli
print('pl_dp imports', torch.cuda.get_device_name(0))"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

# the tests of `make test-gpu` (the W&B test needs wandb, which such a machine lacks)
PL_DP_TEST_DEVICE=cuda timeout "${TEST_S:-200}" python3 -m pytest -q -m "not slow" -p no:cacheprovider \
    -n "${TEST_WORKERS:-8}" --dist loadfile --junitxml="$out/tests.xml" \
    tests/methods tests/per_sample tests/zo tests/privacy tests/step tests/callbacks tests/nets tests/data \
    --ignore=tests/callbacks/test_wandb.py >"$out/tests.txt" 2>&1
echo "tests: exit $?" >>"$out/tests.txt"
tail -n 40 "$out/tests.txt"

timeout "${BENCH_S:-240}" python3 benchmarks/gpu.py --json "$out/gpu.json" ${GPU_CASES:+--cases $GPU_CASES} \
    >"$out/gpu.txt" 2>&1
echo "gpu.py: exit $?" >>"$out/gpu.txt"
tail -n 60 "$out/gpu.txt"
