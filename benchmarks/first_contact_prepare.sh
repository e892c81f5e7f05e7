#!/usr/bin/env bash
# Prepare the first GPU command on a machine with the network (no GPU needed), then print it.
#
#   bash benchmarks/first_contact_prepare.sh [--dry-run]
#
# 1. Downloads into .whl/ (git-ignored; it must be carried to the GPU machine) the wheels that
#    graphtrain imports and the GPU image lacks: tensordict and its pyvers (pure Python; its
#    cloudpickle and numpy are in the image), and nvidia-ml-py (pynvml, the energy metric; in
#    the image too, carried so the metric does not hang on the image's contents), fla-core and
#    einops (FLA's Gated DeltaNet kernels: gpu_session.sh's hybrid stage). Python 3.12,
#    installed there with pip --no-index --no-deps --target, nothing into the image's
#    environment. The image has torch, triton, safetensors, tokenizers, pyarrow, numpy and
#    tensorboard.
# 2. Checks the script's syntax; with --dry-run also runs its CPU dry run (~1-3 min).
# 3. Prints the command with GRAPHTRAIN_COMMIT set to this checkout's HEAD (the device copy's
#    git HEAD can be stale), and warns when the tree is dirty (the results would be stamped with
#    a commit that is not what ran).

set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-$(command -v python3 || command -v python)}
wheels=(tensordict==0.15.3 pyvers==0.2.3 nvidia-ml-py==13.615.71 fla-core==0.6.0 einops==0.8.1)

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
EOF
