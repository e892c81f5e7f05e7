#!/usr/bin/env bash
# Prepare a GPU command on a machine with the network (no GPU needed), then print it.
#
#   bash benchmarks/first_contact_prepare.sh [--dry-run]
#
# 1. Downloads into .whl/ (git-ignored; it must be carried to the GPU machine) the wheels that
#    graphtrain and the peers of gpu_session.sh's stages import and the GPU image lacks:
#    tensordict and its pyvers; nvidia-ml-py (pynvml, the energy metric; in the image too,
#    carried so the metric does not hang on the image's version); fla-core (FLA's Gated
#    DeltaNet kernels: the hybrid stage); liger-kernel and cut-cross-entropy (cross_entropy.py),
#    torchao (fp8_linear.py); torchtitan 0.2.2 (e2e.py) with the wheels its trainer imports
#    that the image lacks (torchdata, tyro, datasets and theirs). Python 3.12, ~8 MB,
#    installed there with pip --no-index --no-deps --target, nothing into the image's
#    environment. The image has torch, triton, safetensors, tokenizers, pyarrow, numpy,
#    tensorboard, einops, pandas, requests, httpx, huggingface-hub, pyyaml, tqdm and xxhash
#    (its package list as read on 2026-11-17); a peer that still misses one is a row that
#    says "not run: ModuleNotFoundError ...".
# 2. Checks the script's syntax; with --dry-run also runs its CPU dry run (~1-3 min).
# 3. Prints the command with GRAPHTRAIN_COMMIT set to this checkout's HEAD (the device copy's
#    git HEAD can be stale), and warns when the tree is dirty (the results would be stamped with
#    a commit that is not what ran).

set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-$(command -v python3 || command -v python)}
wheels=(tensordict==0.15.3 pyvers==0.2.3 nvidia-ml-py==13.615.71 fla-core==0.6.0
    liger-kernel==0.8.5 cut-cross-entropy==25.1.1 torchao==0.18.0
    torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
    datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18)

mkdir -p .whl
missing=()
for w in "${wheels[@]}"; do
    name=${w%%==*}
    version=${w##*==}
    compgen -G ".whl/${name//-/_}-${version}-*.whl" >/dev/null || missing+=("$w")
done
if ((${#missing[@]})); then
    "$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${missing[@]}"
fi
ls -l .whl
git check-ignore -q .whl/ || echo "WARNING: .whl/ is not git-ignored here"

bash -n benchmarks/first_contact.sh
if [ "${1:-}" = "--dry-run" ]; then
    OUT=$root/runs/first-contact-dry FIRST_CONTACT_DRY_RUN=1 PYTHON=$python \
        bash benchmarks/first_contact.sh
fi

commit=$(git rev-parse HEAD)
[ -z "$(git status --porcelain --untracked-files=no)" ] ||
    echo "WARNING: uncommitted changes: GRAPHTRAIN_COMMIT=$commit does not describe them"
cat <<EOF

The first-contact command (one call, carry .whl, timeout_s 600; it ends within ~9.5 min):

    GRAPHTRAIN_COMMIT=$commit bash benchmarks/first_contact.sh

\$OUT then holds summary.txt (read it first), one log per item and artifacts.tar.gz.
After first contact, the next pending stage instead (benchmarks/RESULTS.md, "Running the GPU
benchmarks"; same call shape, it ends within ~9 min):

    GRAPHTRAIN_COMMIT=$commit bash benchmarks/gpu_session.sh STAGE
EOF
