#!/usr/bin/env bash
# Prepare a GPU command on a machine with the network (no GPU needed), then print it.
#
#   bash benchmarks/first_contact_prepare.sh [--dry-run] [--fa4]
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
#    With --fa4, also FlashAttention-4 (flex attention's FLASH backend: attention.py's FA4 row,
#    the `fa4` stage) into .fa4/ (git-ignored), ~102 MB: more than one call carries (64 MiB
#    with the tree), because nvidia-cutlass-dsl's CUDA library wheel alone is 92 MB. So that
#    wheel is cut in two: .fa4/one holds the small wheels, its first 40 MB and the whole
#    wheel's sha256 (48 MiB), .fa4/two the rest (50 MiB). Carry .fa4/one (beside .whl) with one
#    stage's call and .fa4/two with the next call on the same warm machine, the `fa4` stage:
#    ignored files stay there between calls, and gpu_session.sh joins, checks and installs.
# 2. Checks the script's syntax; with --dry-run also runs its CPU dry run (~1-3 min).
# 3. Prints the command with GRAPHTRAIN_COMMIT set to this checkout's HEAD (the device copy's
#    git HEAD can be stale), and warns when the tree is dirty (the results would be stamped with
#    a commit that is not what ran).

set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-$(command -v python3 || command -v python)}
dry_run=0
fa4=0
for arg in "$@"; do
    case $arg in
    --dry-run) dry_run=1 ;;
    --fa4) fa4=1 ;;
    *) echo "usage: bash benchmarks/first_contact_prepare.sh [--dry-run] [--fa4]" >&2 && exit 2 ;;
    esac
done
wheels=(tensordict==0.15.3 pyvers==0.2.3 nvidia-ml-py==13.615.71 fla-core==0.6.0
    liger-kernel==0.8.5 cut-cross-entropy==25.1.1 torchao==0.18.0
    torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
    datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18)

# download DIR WHEEL...: the Python 3.12 wheels of WHEEL (name==version) not yet in DIR.
download() {
    local dir=$1 w name version missing=()
    shift
    mkdir -p "$dir"
    for w in "$@"; do
        name=${w%%==*}
        version=${w##*==}
        compgen -G "$dir/${name//-/_}-${version}-*.whl" >/dev/null || missing+=("$w")
    done
    if ((${#missing[@]})); then
        "$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" \
            "${missing[@]}"
    fi
    git check-ignore -q "$dir/" || echo "WARNING: $dir/ is not git-ignored here"
}

download .whl "${wheels[@]}"
ls -l .whl

if ((fa4)); then
    # flash-attn-4 4.0.0b36 (2026-10-21): the release whose _flash_attn_fwd/_bwd keywords
    # torch 2.11's FLASH templates call; cutlass-dsl 4.8.1 (cu13: the image's torch is cu130)
    # and the rest: what it imports that the image lacks (it has cuda-bindings, protobuf,
    # einops).
    download .fa4/wheels flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
        nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
        nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 \
        torch-c-dlpack-ext==0.1.5
    big=$(basename .fa4/wheels/nvidia_cutlass_dsl_libs_cu13-*.whl)
    rm -rf .fa4/one .fa4/two
    mkdir -p .fa4/one .fa4/two
    find .fa4/wheels -name '*.whl' ! -name "$big" -exec cp {} .fa4/one/ \;
    head -c 40000000 ".fa4/wheels/$big" >".fa4/one/$big.part1"
    tail -c +40000001 ".fa4/wheels/$big" >".fa4/two/$big.part2"
    sha256sum ".fa4/wheels/$big" | cut -d' ' -f1 >".fa4/one/$big.sha256"
    du -sh .fa4/one .fa4/two .whl
fi

bash -n benchmarks/first_contact.sh
if ((dry_run)); then
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
After first contact, the next pending stages instead (benchmarks/RESULTS.md, "Running the GPU
benchmarks"; same call shape, it ends within ~9 min; a chain shares one budget):

    GRAPHTRAIN_COMMIT=$commit bash benchmarks/gpu_session.sh STAGE[,STAGE...]
EOF
if ((fa4)); then
    cat <<EOF

FlashAttention-4 (--fa4): carry .fa4/one beside .whl with one stage's call, then, on the same
warm machine (within ~30 s of that call's end), one call that carries .fa4/two (~3-4 min):

    GRAPHTRAIN_COMMIT=$commit BUDGET=220 bash benchmarks/gpu_session.sh fa4
EOF
fi
