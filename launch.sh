#!/usr/bin/env bash
# graphtrain launcher: a thin torchrun wrapper that sets up its own environment first.
#
#   ./launch.sh [--section.key=value ...]     train (CONFIG=file.toml, PRESET=name optional)
#   ./launch.sh test [pytest args]            run the test suite (TEST_WORKERS files at a time, 2)
#   ./launch.sh inspect|export|generate|eval|plan ARGS   the other graphtrain commands, in its venv
#
# Environment: NGPU (processes per node; default: the GPUs nvidia-smi lists, else 1), NNODES (1),
# NODE_RANK (0), MASTER_ADDR (localhost), MASTER_PORT (29500), CONFIG, PRESET, DRY_RUN=1 (print
# the command instead of running it), TORCH_SPEC (the torch requirement to install when torch is
# missing), SHUTDOWN_TIMEOUT (seconds the ranks get to save after a signal; default: estimated
# from the checkpoint size). Outside a virtual environment it creates .venv and installs the
# project into it; it installs again where the environment's graphtrain is another checkout's.
# Relative paths (CONFIG, --data.paths, the run directory) are the caller's:
# only the set-up and the tests run in this folder. After a save on a signal it exits 75.
set -euo pipefail
CALLER_DIR="$PWD"
cd "$(dirname "$0")"

setup() {
    if [[ -n "${VIRTUAL_ENV:-}" ]]; then
        PY="$VIRTUAL_ENV/bin/python"
    else
        if [[ ! -x .venv/bin/python ]]; then
            # Reuse a torch that the machine already has (GPU images ship one), else a clean venv.
            if python3 -c "import torch" >/dev/null 2>&1; then
                python3 -m venv --system-site-packages .venv
            else
                python3 -m venv .venv
            fi
        fi
        PY="$PWD/.venv/bin/python"
    fi
    local stamp found here
    here="$(pwd -P)"
    stamp="$(dirname "$PY")/../.graphtrain-installed"
    found="$(imported_from)"
    if [[ -n "$found" && "$found" != "$here" ]]; then
        # Another checkout's editable install (or a copy in site-packages): the ranks, which
        # run where the caller stands, would run its code.
        echo "launch.sh: graphtrain imports from $found, not from this checkout" >&2
    fi
    if [[ ! -f "$stamp" || pyproject.toml -nt "$stamp" || "$found" != "$here" ]]; then
        echo "launch.sh: installing graphtrain and its dependencies into $(dirname "$(dirname "$PY")")" >&2
        "$PY" -m pip install -q --upgrade pip >/dev/null
        if ! "$PY" -c "import torch" >/dev/null 2>&1; then
            # Without a GPU, the CPU build that the tests are run against; with one, the newest
            # CUDA build of the tested releases (2.11 to 2.15; README).
            local spec="${TORCH_SPEC:-}"
            if [[ -z "$spec" ]]; then
                if command -v nvidia-smi >/dev/null 2>&1; then spec="torch>=2.11,<2.16"; else spec="torch==2.13.0 triton==3.6.0"; fi
            fi
            # shellcheck disable=SC2086
            "$PY" -m pip install -q $spec
        fi
        "$PY" -m pip install -q -e ".[dev]"
        touch "$stamp"
        found="$(imported_from)"
        if [[ "$found" != "$here" ]]; then
            echo "launch.sh: graphtrain still imports from ${found:-nowhere}, not from $here" \
                "(PYTHONPATH=${PYTHONPATH:-}); unset PYTHONPATH or run that checkout's launch.sh" >&2
            exit 1
        fi
    fi
}

# The checkout whose graphtrain $PY finds away from this folder, as the ranks do (found, not
# imported: no torch import; empty if none).
imported_from() {
    (cd / && PYTHONSAFEPATH=1 "$PY" -c 'import importlib.util as u, os
s = u.find_spec("graphtrain")
print(os.path.dirname(os.path.dirname(os.path.realpath(s.origin))) if s and s.origin else "")' \
        2>/dev/null) || true
}

# Runs the command (exec: this script ends there) or, with DRY_RUN=1, prints it and ends, so
# that exactly the one command that would run is printed.
run() {
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
        printf '%q ' "$@"; echo
        exit 0
    fi
    exec "$@"
}

setup

if [[ "${1:-}" == "test" ]]; then
    shift
    # Two test files at a time (pytest-xdist; a file's tests stay together, so its module
    # fixtures run once): much of a test's time is compiling on one core.
    run "$PY" -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile --durations=30 "$@"
fi

# Everything else runs where the caller stands, so that their relative paths mean what they
# typed; PYTHONSAFEPATH (Python 3.11+): a models/ folder there must not shadow ours.
cd "$CALLER_DIR"
export PYTHONSAFEPATH=1

case "${1:-}" in
    inspect|export|generate|eval|plan) run "$PY" -m graphtrain "$@" ;;
esac

if [[ "${1:-}" == "train" ]]; then shift; fi
args=()
[[ -n "${CONFIG:-}" ]] && args+=(--config "$CONFIG")
[[ -n "${PRESET:-}" ]] && args+=(--preset "$PRESET")
args+=("$@")

if [[ -z "${NGPU:-}" ]]; then
    NGPU=1
    if command -v nvidia-smi >/dev/null 2>&1; then
        NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
        [[ "$NGPU" -ge 1 ]] || NGPU=1
    fi
fi
NNODES="${NNODES:-1}"

if [[ "$NGPU" == "1" && "$NNODES" == "1" ]]; then
    run "$PY" -m graphtrain train "${args[@]}"
fi
# Check the config and the layout once, before any rank starts: a mistake is then one line and
# exit code 2 instead of a traceback from every rank.
if [[ "${DRY_RUN:-0}" != "1" ]]; then
    WORLD_SIZE=$((NGPU * NNODES)) "$PY" -m graphtrain train --check "${args[@]}" || exit $?
fi
# `graphtrain torchrun` is torchrun with an exit code of 75 after a save on a signal and a grace
# period after a signal that fits the save (graphtrain.preemption.run_torchrun).
grace=()
[[ -n "${SHUTDOWN_TIMEOUT:-}" ]] && grace=(--shutdown-timeout "$SHUTDOWN_TIMEOUT")
if [[ "$NNODES" == "1" ]]; then
    run "$PY" -m graphtrain torchrun ${grace[@]+"${grace[@]}"} \
        --nnodes 1 --nproc-per-node "$NGPU" \
        --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-29500}" \
        -m graphtrain train "${args[@]}"
fi
# Several nodes meet in a c10d rendezvous at MASTER_ADDR:MASTER_PORT (the node on that host
# starts its store; nodes may start in any order and wait for each other).
run "$PY" -m graphtrain torchrun ${grace[@]+"${grace[@]}"} \
    --nnodes "$NNODES" --nproc-per-node "$NGPU" --node-rank "${NODE_RANK:-0}" \
    --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}" \
    --rdzv-id "${RDZV_ID:-graphtrain}" \
    -m graphtrain train "${args[@]}"
