#!/usr/bin/env bash
# One stage, or a chain of stages, of the pending GPU work on one H100 (or H200), after the
# first contact (benchmarks/first_contact.sh), in the order of issue 25 item 3: e2e, profile,
# loss, fp8, mtp, kernels (then hybrid, profile-fp8; fa4 in the call after any stage). A call
# ends inside 9 minutes: every item runs under its own cap, cut to what is left of BUDGET seconds
# (default 520, counted from the start of this script, the wheel install and preflight
# included), and an item left with less than it needs to show anything (20 s, or the least it
# names) is skipped and named so in summary.txt, its time left to the items after it. Items
# run most important first within a stage, the stages of a chain in the order given, on the one
# budget: a stage that runs shorter than its caps leaves its time to the next.
#
#   GRAPHTRAIN_COMMIT=<commit> bash benchmarks/gpu_session.sh STAGE[,STAGE...] [LOG_DIR]
#
# STAGE: preflight | tests | e2e | profile | loss | fp8 | mtp | kernels | hybrid | profile-fp8 | fa4
# (see `stages` below and "Running the GPU benchmarks" in benchmarks/RESULTS.md); at most 5 in a
# chain, e.g. `fp8,mtp`. LOG_DIR (default $OUT, else ./gpu-logs; what a device run brings back
# is at most 8 files) gets summary.txt (every item's start, end and exit code), preflight.log
# (the wheel install too), one log per stage (STAGE.log: its items' output in turn) and
# results.md (the sections the call appended to benchmarks/RESULTS.md). A failing item never
# stops the call: all items run, and the call exits non-zero if any failed.
#
# GRAPHTRAIN_COMMIT: the commit the results are stamped with (benchmarks/cross_entropy.py's
# git_commit()); set it by hand where the repository copy's git HEAD is stale.
#
# Wheels. The GPU machine is expected to have torch, triton and safetensors. graphtrain itself
# needs tensordict (graphtrain.step, the data loader: the tests and e2e stages); the peers are
# optional, and every benchmark prints a "not run: why" row where one is missing or fails:
# liger-kernel and cut-cross-entropy (cross_entropy.py), torchao (fp8_linear.py), torchtitan
# 0.2.2 (e2e.py). `bash benchmarks/first_contact_prepare.sh` downloads them, with what they
# import that the image lacks, as Python 3.12 wheels into .whl/ (git-ignored; ~8 MB);
# only where `preflight` reports them missing, graphtrain's own requirements that its trainer
# imports (about 60 MB more): numpy tokenizers pyarrow.
#
# Bring .whl/ along with the repository; each stage installs whatever *.whl it
# finds in $GRAPHTRAIN_WHEELS (default .whl) with
#   python -m pip install --no-index --no-deps --target "$TMPDIR/graphtrain-wheels" .whl/*.whl
# and puts that directory on PYTHONPATH, so nothing is installed into the machine's environment.
# `preflight` (seconds) prints what imports and what does not.
#
# FlashAttention-4 (`first_contact_prepare.sh --fa4`) comes in two halves, .fa4/one and
# .fa4/two, one per call on the same warm machine (a call carries 64 MiB): where both are here,
# every stage joins the cut wheel, checks its sha256 and installs it with the rest; where one
# is, summary.txt says which the next call must carry.

set -uo pipefail
export PYTHONUNBUFFERED=1

START=$SECONDS
BUDGET=${BUDGET:-520}
IFS=, read -r -a chain <<<"${1:-}"
log_dir=${2:-${OUT:-./gpu-logs}}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$(command -v python3 || command -v python)}
wheels=${GRAPHTRAIN_WHEELS:-$root/.whl}

usage() {
    echo "usage: GRAPHTRAIN_COMMIT=<commit> bash benchmarks/gpu_session.sh STAGE[,STAGE...]" \
        "[LOG_DIR]" >&2
    echo "STAGE: preflight tests e2e profile loss fp8 mtp kernels hybrid profile-fp8 fa4" \
        "(at most 5)" >&2
    exit 2
}

# Five stages: summary.txt, preflight.log, results.md and a log per stage are the 8 files.
((${#chain[@]} >= 1 && ${#chain[@]} <= 5)) || usage
for stage in "${chain[@]}"; do
    case $stage in
    preflight | tests | e2e | profile | loss | fp8 | mtp | kernels | hybrid | profile-fp8 | fa4) ;;
    *)
        echo "unknown stage '$stage'" >&2
        usage
        ;;
    esac
done
mkdir -p "$log_dir" || exit 2
log_dir=$(cd "$log_dir" && pwd)
# Bulky outputs (inspect's report folders) stay out of LOG_DIR, which must keep to 8 files.
work=${TMPDIR:-/tmp}/graphtrain-gpu-session
mkdir -p "$work" || exit 2
cd "$root" || exit 2
names=()
codes=()

# item NAME CAP_SECONDS[:LEAST] COMMAND...: run COMMAND with its output appended to
# LOG_DIR/STAGE.log (and on the terminal), killed after CAP_SECONDS or what is left of BUDGET
# less 10 s, whichever is less; skipped when that is under LEAST seconds (default 20): an item
# that shows nothing before then (a compile before its first row, a report written at its end)
# names its LEAST, and where it no longer has them, the time goes to the items after it. Its
# exit code is kept for the summary (124: over the cap; 99: skipped). With GPU_SESSION_DRY_RUN
# set, COMMAND is named but not run.
item() {
    local name=$1 cap=${2%%:*} least=20
    [[ $2 == *:* ]] && least=${2#*:}
    shift 2
    local avail=$((BUDGET - (SECONDS - START) - 10))
    ((cap > avail)) && cap=$avail
    if ((cap < least)); then
        echo "=== $name: SKIPPED, $((BUDGET - (SECONDS - START))) s left of $BUDGET," \
            "it needs $least" | tee -a "$log_dir/summary.txt"
        names+=("$name")
        codes+=(99)
        return
    fi
    echo "=== $name (cap ${cap} s, t=$((SECONDS - START)) s): $*" \
        | tee -a "$log_dir/summary.txt" "$log_dir/$stage.log"
    local start=$SECONDS
    [ -n "${GPU_SESSION_DRY_RUN:-}" ] && set -- true  # the chain's bookkeeping, on CPU: a test
    timeout --signal=INT --kill-after=10 "$cap" "$@" 2>&1 | tee -a "$log_dir/$stage.log"
    local code=$?
    echo "=== $name: exit $code after $((SECONDS - start)) s" | tee -a "$log_dir/summary.txt"
    names+=("$name")
    codes+=("$code")
}

bench() {  # bench NAME CAP[:LEAST] SCRIPT ARGS...: a benchmark script of this directory
    local name=$1 cap=$2 script=$3
    shift 3
    item "$name" "$cap" "$python" "benchmarks/$script" "$@"
}

# fa4_wheels: prints the FlashAttention-4 wheels to install, the cut one joined into $work,
# where both halves are here; else says (in summary.txt too) what is missing.
fa4_wheels() {
    local one=$root/.fa4/one two=$root/.fa4/two part name
    [ -d "$one" ] || [ -d "$two" ] || return 0
    if [ ! -d "$one" ] || [ ! -d "$two" ]; then
        local here=.fa4/one missing=.fa4/two
        [ -d "$one" ] || { here=.fa4/two; missing=.fa4/one; }
        echo "FlashAttention-4: not installed, only $here is here: carry $missing with the" \
            "next call on this machine" | tee -a "$log_dir/summary.txt" >&2
        return 0
    fi
    for part in "$one"/*.part1; do
        name=$(basename "$part" .part1)
        cat "$part" "$two/$name.part2" >"$work/$name" 2>/dev/null
        if [ "$(sha256sum "$work/$name" | cut -d' ' -f1)" != "$(cat "$one/$name.sha256")" ]; then
            echo "FlashAttention-4: not installed, $name joined from .fa4/one and .fa4/two" \
                "fails its sha256" | tee -a "$log_dir/summary.txt" >&2
            return 0
        fi
        echo "$work/$name"
    done
    ls "$one"/*.whl
}

install_wheels() {
    shopt -s nullglob
    local found=("$wheels"/*.whl)
    shopt -u nullglob
    mapfile -t -O ${#found[@]} found < <(fa4_wheels)
    if ((${#found[@]})); then
        local target="${TMPDIR:-/tmp}/graphtrain-wheels"
        "$python" -m pip install -q --no-index --no-deps --target "$target" "${found[@]}" \
            >"$log_dir/preflight.log" 2>&1 || echo "wheel install failed: see preflight.log"
        export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
        # A --target install leaves .pth files unread: cutlass-dsl's puts its packages' folder
        # on sys.path (without it, `import cutlass` fails: seen, FlashAttention-4's import).
        local dsl=$target/nvidia_cutlass_dsl/dsl_packages
        [ -d "$dsl" ] && export PYTHONPATH="$PYTHONPATH:$dsl"
        echo "installed ${#found[@]} wheels from $wheels into $target"
    else
        echo "no wheels in $wheels: the peers' rows will say 'not run'"
    fi
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
}

preflight() {
    "$python" - <<'EOF'
import importlib, os
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
print(f"GRAPHTRAIN_COMMIT={os.environ.get('GRAPHTRAIN_COMMIT') or '(unset: git HEAD, may be stale)'}")
for name in ("tensordict", "safetensors", "tokenizers", "numpy", "pyarrow", "tensorboard",
             "graphtrain.step", "liger_kernel.transformers", "cut_cross_entropy",
             "torchao.float8", "torchtitan.train", "flash_attn.cute"):
    try:
        importlib.import_module(name)
        print(f"  {name}: ok")
    except Exception as e:
        print(f"  {name}: MISSING ({type(e).__name__}: {e})")
EOF
}

# Time estimates (H100, no Inductor cache on a fresh machine; compile dominates the small ones).
# The numbers are estimates, not measurements: the first run of each stage checks them. The caps
# of a stage may add up to more than BUDGET: the last items then get what is left, or are skipped.
stages() {
    case $stage in
    preflight) ;;
    tests)
        # Every GPU-marked test (small shapes; the Triton kernels compile once each; the train
        # runs of tests/gpu compile tiny models with Inductor) plus collecting the whole suite
        # (~30 s): ~3-6 min. A test file that fails to import on the GPU machine is reported
        # without stopping the others. Two items: pytest prints failures at the end of a run,
        # so a run cut by its cap says which failed but not why (2026-11-28: 68 tests in 323 s
        # with a cold Triton cache, 4 failed, no tracebacks); the ops' and passes' tests
        # (~1-2 min cold) come first and finish. Four test files at a time where pytest-xdist
        # imports (the GPU image has it): each process compiles its kernels one after the
        # other at their first launch, so a cold run is bound by compiling on one core.
        local xdist=()
        "$python" -c "import xdist" 2>/dev/null && xdist=(-n 4 --dist loadfile)
        item tests-ops 200 "$python" -m pytest -m gpu -q -rfEs --durations=10 "${xdist[@]}" \
            tests/custom_ops tests/passes
        item tests 400 "$python" -m pytest -m gpu -q -rfEs --durations=25 "${xdist[@]}" \
            --continue-on-collection-errors --ignore=tests/custom_ops --ignore=tests/passes tests
        ;;
    e2e)
        # e2e.py 1b, trainer mode: plain torch.compile, graphtrain, four variant rows,
        # torchtitan 0.2.2; 15 timed steps of 8192 tokens (~0.15 s each) after 4 warm-up steps.
        # Three variants are the A/B of three defaults in the same process (the plain row, the
        # tokenised corpus and the Inductor cache shared): torch's fused AdamW instead of
        # AdamWCopies (auto's CUDA choice since 2026-11-27), autocast's casts instead of the
        # working weights (a wash with torch's AdamW; predicted ~1 ms in the copies' favour
        # with AdamWCopies), the fused loss's fast mode forced (auto leaves 1b's loss to
        # Inductor). Every row now warms the learning rate up over the 4 untimed steps: on
        # 2026-11-27, at the constant 3e-4 from step 0, the 1b rows' loss rose from ~12.27 to
        # 12.445 in 19 steps where torchtitan's fell to 7.9 (RESULTS.md: Adam's first full step
        # with our SwiGLU init; on CPU at 1b's dims a 4-step warm-up removes the blow-up and
        # our init then learns as torchtitan's does). The fourth variant is that constant rate
        # again: it should rise where the others learn. The fifth is the compiler's selective
        # recomputation at half the saved activations (training.activation_memory_budget, new
        # 2026-11-29): predicted activations 12.0 -> 6.6 GiB (the memory plan), the peak ~5 GiB
        # lower, the step 2-5% slower (elementwise work recomputed in the backward). Measured
        # 2026-11-27 (H200) with four variants and torchtitan: 141 s.
        bench e2e-1b 330:120 e2e.py --model 1b --steps 15 --warmup 4 \
            --variant=--optim.implementation=fused --variant=--training.working_weights=false \
            --variant=--compile.lce_mode=fast --variant=--schedule.warmup_steps=0 \
            --variant=--training.activation_memory_budget=0.5
        # moe-1b with balanced routing, batch 4 (16384 tokens a step, ~0.08 s): plain,
        # graphtrain, a variant row without the working weights, one without
        # fold_routing_weights (new, on by default: its A/B), torchtitan's Qwen3-style MoE with
        # moe-1b's dims. graphtrain's peak was 1.0 GiB above plain's on 2026-11-27: copies of
        # the experts' w1 and w3 beside their concatenation, which the backward keeps
        # (RESULTS.md, found on CPU); since then they get no copies, and fold_routing_weights
        # keeps no expert outputs. Predicted peaks: ~22.8 GiB for graphtrain (plain's 24.6),
        # the working-weights row the same, ~24.5 without the fold; the fold -0.2 to +0.4 ms a
        # step (RESULTS.md). Measured 2026-11-27 without the variants: 203 s; ~60 s a variant.
        bench e2e-moe-1b 330:120 e2e.py --model moe-1b --batch 4 --force-balance --steps 15 \
            --warmup 4 --variant=--training.working_weights=false \
            --variant=--compile.passes=-fold_routing_weights
        ;;
    profile)
        # attention.py: 1b's attention over the default corpus's packed documents (the e2e
        # rows' batches), fwd and fwd+bwd: flex (Triton, the default), flex with Hopper's TMA
        # loads (USE_TMA, off by default in torch 2.11), varlen (FlashAttention-2),
        # flex's FlashAttention-4 backend where flash-attn-4 is installed (not in .whl/: its
        # CUDA library wheel alone is ~92 MB), causal SDPA
        # without documents as a bound; each against fp32 math. The 1.15x verdict's attention
        # term (~19 ms of a 1b step). Tokeniser and corpus as e2e's, then ~5 compiles: ~1-2 min.
        bench attention 150 attention.py
        # `graphtrain inspect --profile 3`: the regions compiled with the default passes, 3 steps
        # under torch.profiler, kernel time by region, FX node and source line (summary.txt,
        # report.html in --out, outside LOG_DIR: only the log comes back), then each fusing
        # pass's region re-timed with that pass off: ~1.5-3 min each. Its own stage since the
        # e2e stage has torchtitan's rows.
        item profile-1b 200:90 "$python" -m graphtrain inspect --preset 1b --device cuda \
            --profile 3 --out "$work/inspect-1b"
        # moe-1b: only fold_routing_weights (new, on by default, unmeasured) re-timed with the
        # pass off: each re-time compiles the block region again (~1 min), and with the
        # router's and the dispatch's (measured 2026-11-22) the item would outrun its cap.
        item profile-moe-1b 200:90 "$python" -m graphtrain inspect --preset moe-1b --device cuda \
            --profile 3 --out "$work/inspect-moe-1b" --model.force_balance=true \
            --compare fold_routing_weights
        ;;
    loss)
        # cross_entropy.py, fast / low-memory modes against eager, torch.compile, Liger, CCE,
        # torch's F.linear_cross_entropy: 2 shapes x 10 rows per precision, each row do_bench
        # 50 + 300 ms plus one memory pass (~1 s a row, ~20 s); the compiled rows compile once
        # per shape, ~30 s each: ~2-3 min per precision. One item per precision, so each
        # records its own section even if the other runs over. First the op's GPU tests (13
        # passed in 13 s on 2026-11-27; since then low-memory mode casts a master weight chunk
        # by chunk: test_cuda_low_memory_master_weight), less the slow fp32 cases of
        # test_cuda_matches_float64 (FMA-only Triton GEMMs).
        item lce-tests 70 "$python" -m pytest -m gpu -q -rfEs \
            -k "fast_mode or graph_capture or master_weight or (matches_float64 and dtype0)" \
            tests/custom_ops/test_linear_cross_entropy.py
        bench cross_entropy-bf16 220 cross_entropy.py --precision bf16
        bench cross_entropy-fp32-master 220 cross_entropy.py --precision fp32-master
        # Where fast mode's 4.2 ms over torch.compile go at the first shape (2026-11-27, H200):
        # each row's kernels under torch.profiler, both precisions.
        bench lce-kernels 120 cross_entropy.py --kernels \
            --shape 8192,4096,128256 \
            --impl torch.compile,graphtrain-fast,graphtrain-fast-bf16acc,graphtrain-low_memory
        ;;
    fp8)
        # fp8_linear.py: GEMM-only rates, 3 linear shapes x 4 rows, 3 rmsnorm + linear rows, the
        # grouped rows; ~18 Inductor compiles of ~15-20 s: ~5-6 min.
        bench fp8_linear 330 fp8_linear.py
        # e2e.py --fp8 3b, batch 1 (4096 tokens, ~0.2 s a step at 45% MFU plus the 3.2B AdamW
        # step): graphtrain bf16, graphtrain fp8, plain bf16, ~63 GiB each, one at a time; 10
        # layers of 4096 to compile per row, ~1 min each: the steps are cut to 6 + 2. What is
        # left of the budget (~3 min): the row that misses it says so in its log. Predicted
        # (2026-11-30, no working copies of the FP8 linears' weights): fp8 peak 52.4 -> ~48.5
        # GiB, under plain's 48.9; its step 136.9 -> ~135.7 ms.
        bench e2e-3b-fp8 300:90 e2e.py --fp8 --model 3b --batch 1 --steps 6 --warmup 2
        ;;
    mtp)
        # mtp.py: 3 token counts x 4 rows (eager, torch.compile, reduce-overhead, graphtrain);
        # the 9 compiled rows of one block at ~15 s each, CUDA-graph capture included: ~2-3 min.
        bench mtp 220 mtp.py
        # moe-1b's FP8 rows (the 1.5x target) in the time this stage leaves: graphtrain bf16,
        # plain bf16, graphtrain fp8 at the default fp8.min_dim = 4096, which refuses every
        # moe-1b GEMM (predicted ~1.0x: what the default costs where nothing qualifies), then a
        # variant row with the filter at 512, where every expert GEMM (K, N = 1024, 512) and
        # every attention projection qualify. Predicted slower than bf16 (RESULTS.md, FP8
        # section: at K = 1024 the casts cost more than the FP8 GEMMs save, the grouped
        # experts ~1.2 ms against 0.80 ms in bf16): what it measures is by how much, the
        # evidence for the 4096 default and against the 1.5x target at these dims.
        # ~100 s of compile a graphtrain row (2026-11-27: 96 s): ~5-6 min; a row cut by the cap
        # leaves the others recorded.
        bench e2e-moe-1b-fp8 360:120 e2e.py --fp8 --model moe-1b --batch 4 --force-balance \
            --steps 10 --warmup 3 --variant="--training.fp8=true --fp8.min_dim=512"
        ;;
    kernels)
        # adamw_step.py: moe-1b's 1,046M parameters, 4 rows of clipping + one optimizer step
        # (~12-16 ms, predicted) timed by do_bench; building the model and its 17 GB of fp32
        # state: ~1 min.
        bench adamw_step 110:60 adamw_step.py
        # moe_router.py: 3 routers x 4 rows, forward and forward+backward, the compiled rows
        # ~20 s each (6 compiles x 2 modes): ~3 min (the 2026-11-22 runs took about as long).
        bench moe_router 190 moe_router.py
        # moe_dispatch.py: one shape, 3 rows, 2 compiles + profiler passes: ~1-2 min.
        bench moe_dispatch 120 moe_dispatch.py
        # tp_overlap.py: plain bf16 GEMMs of Llama-3-8B at 8192 tokens for tp = 2, 4, 8, one and
        # chunked, no compile (the TP-overlap decomposition's overhead): < 1 min.
        bench tp_overlap 80 tp_overlap.py
        ;;
    hybrid)
        # First the op's GPU tests (ours and FLA's against float64, forward and backward; FLA's
        # skip on Hopper with triton 3.6; the chunk inverse's kernel; the inline form compiled,
        # aot_eager and Inductor, one compile each): 2026-11-30 (H200), 3 passed, 3 skipped in
        # 14 s, before the inverse's and the inline form's tests (~1 min more).
        item gdr-tests 100 "$python" -m pytest -m gpu -q -rfEs \
            tests/custom_ops/test_gated_delta_rule.py tests/custom_ops/test_unit_lower_inverse.py
        # hybrid-1b's step, the rows that set compile.gdr_form's default first: graphtrain (the
        # gated_delta_rule pass on by default since 2026-11-30, our kernels on Hopper with
        # triton 3.6, where FLA's are refused; 249 ms a step, 39 s warm-up on 2026-11-30), then
        # compile.gdr_form=inline (the chunked form around our two kernels, fused by Inductor,
        # its backward derived; predicted faster than the op's row by ~2-3 ms a layer if the
        # slots row beats the op, at a higher peak), then the pass off (the memory plan's 40.6
        # GiB against the measured peak; predicted near plain's time), then plain
        # torch.compile last (--plain-last: 470 ms, 156 s warm-up on 2026-11-30, its chunk
        # terms fp32 under autocast since 2026-12-01). ~2.5 min warm-up each for the last two:
        # the cap cuts plain first, a cut row is named.
        bench e2e-hybrid-1b 300:90 e2e.py --model hybrid-1b --steps 10 --warmup 3 --plain-last \
            --variant=--compile.gdr_form=inline --variant=--compile.passes=-gated_delta_rule
        # gated_delta_rule.py at Qwen3-Next's shapes (batch 1, 4096 tokens, 32 value heads of
        # 128): ours (2026-11-30: 3.3 ms forward, 12.0 ms forward + backward; predicted ~6.5-7.5
        # since the inverse kernel), FLA's (its forward timed, its backward refused on Hopper
        # with triton 3.6), the chunked form compiled with our two kernels in its slots (the
        # next lever, predicted ~4-5 ms; compiles in ~1 min), then the compiled chunked
        # reference, which compiles the unrolled 64-chunk loop for minutes: a cut row is named.
        bench gated_delta_rule 150 gated_delta_rule.py
        # Where our op's forward + backward go, kernel by kernel: its chunk terms in torch,
        # eager, inside the op (fp32 pointwise work, matmuls), the inverses and the loop over
        # chunks in Triton; the inverse three ways; the slots row again. ~1.5-2 min: what is left.
        bench gdr-kernels 150 gated_delta_rule.py --kernels
        ;;
    fa4)
        # attention.py with flex's FlashAttention-4 row (its wheels installed above): flex's
        # Triton kernel, FA4, varlen (FA2) and causal SDPA on the same batch, each against fp32
        # math; FA4's CuTe DSL kernels compile at first call (~1 min, forward and backward
        # together, not measured yet) beside the ~1-2 min of the other rows. A failing FA4 row
        # prints its traceback in attention.log. Where it is faster than flex's Triton kernel,
        # FA4 becomes a training.attention choice and an e2e variant row, not before (2026-11-27,
        # H200, flash-attn-4 4.0.0b36: 2.41 ms fwd+bwd against flex's 1.16, 54 s in all: not).
        bench attention 200 attention.py
        ;;
    profile-fp8)
        # Where the FP8 rows' time goes, kernel by kernel (fp8_linear.py --kernels, printed):
        # the plain recipe compiled, graphtrain's op, its pass with fp8_cast_once off and on at
        # 16384x4096x4096 (the shape where the op lost most to the plain recipe), then bf16 and
        # FP8 grouped GEMMs at moe-1b's w1|w3 (fp8_grouped_mm ran 5.5x slower). 3 compiles: ~1.5 min.
        bench fp8-kernels 120 fp8_linear.py --kernels --shapes 16384x4096x4096
        # The 3b preset with training.fp8 and fp8_cast_once (off by default: the compiled
        # rmsnorm + linear ran slower with it on 2026-11-28), one sequence of 4096 (~63 GiB): 3
        # profiled steps, then the block region re-timed with fp8_cast_once off and with
        # fp8_linear off (the A/B that decides the pass's default, and where FP8's time goes:
        # its casts, amaxes and GEMMs by kernel). One 3b compile + 2 block re-compiles: ~5 min.
        item profile-3b-fp8 480:180 "$python" -m graphtrain inspect --preset 3b --device cuda \
            --profile 3 --out "$work/inspect-3b-fp8" --training.fp8=true \
            --compile.passes=+fp8_cast_once --compare fp8_cast_once,fp8_linear
        ;;
    esac
}

install_wheels
preflight 2>&1 | tee -a "$log_dir/preflight.log"
results=benchmarks/RESULTS.md
before=$(wc -c <"$results" 2>/dev/null || echo 0)
for stage in "${chain[@]}"; do
    echo "=== stage $stage (t=$((SECONDS - START)) s)" | tee -a "$log_dir/summary.txt"
    stages
done
tail -c +$((before + 1)) "$results" >"$log_dir/results.md" 2>/dev/null

failed=0
echo "=== ${1}: exit codes" | tee -a "$log_dir/summary.txt"
for i in "${!names[@]}"; do
    echo "  ${names[$i]}: ${codes[$i]}" | tee -a "$log_dir/summary.txt"
    [ "${codes[$i]}" = 0 ] || failed=1
done
echo "logs in $log_dir; sections appended to $results: $log_dir/results.md"
exit $failed
