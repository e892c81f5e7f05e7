"""The Python half of benchmarks/first_contact.sh: a training run that reports what happened to
its CUDA graphs, and the summary of such a run.

    python benchmarks/first_contact.py train RUN_DIR [graphtrain train ARGS...]
    python benchmarks/first_contact.py summarize RUN_DIR LOG

`train` runs `graphtrain train --training.run_dir=RUN_DIR ARGS` in this process (the CLI's own
main) and then writes RUN_DIR/first_contact.json: the device, Inductor's count of skipped
CUDA-graph captures and whether its cudagraph trees recorded any graph. Those live in this
process only, which is why the run is not a `python -m graphtrain` subprocess. The exit code is
the CLI's.

`summarize` prints, one fact a line (each starts with two spaces, for summary.txt): the losses
logged; which graph passes changed a graph and in which regions, with the graphtrain ops they
inserted (from the pass dumps, compile.dump_graphs = true); which attention the blocks traced
(flex_attention or SDPA, from the captured graph); whether the MTP CUDA graphs were captured or
skipped, and why (first_contact.json and the log's lines from graphtrain and Inductor); whether
the energy metric is in metrics.jsonl, and why not where the log says. `summarize_run` returns
the same lines (tests/test_first_contact.py reads them from a real dry run).
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

INFO_FILE = "first_contact.json"


def train(run_dir: str, args: list[str]) -> int:
    """`graphtrain train --training.run_dir=run_dir *args` in-process; then INFO_FILE."""
    import torch

    from graphtrain.cli import main

    code = 1
    try:
        code = main(["train", f"--training.run_dir={run_dir}", *args])
    finally:
        info: dict[str, object] = {"exit_code": code, "cuda": torch.cuda.is_available()}
        try:
            from torch._dynamo.utils import counters

            info["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
        except Exception as error:  # private API: say so rather than fail the run
            info["cudagraph_skips"] = f"unknown ({type(error).__name__}: {error})"
        info["cudagraph_trees_recorded"] = _trees_recorded()
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    return code


def _trees_recorded() -> int | str:
    """Root recordings of Inductor's cudagraph trees on the current device (0 on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    try:
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_manager(
            torch.cuda.current_device(), create_if_none_exists=False
        )
        return 0 if manager is None else sum(len(v) for v in manager.roots.values())
    except Exception as error:  # private API
        return f"unknown ({type(error).__name__}: {error})"


def _passes(run_dir: Path) -> list[str]:
    """'pass: regions it changed (ops it inserted)' for every pass with a non-empty op diff."""
    regions: dict[str, set[str]] = defaultdict(set)
    inserted: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    quiet: set[str] = set()
    for path in sorted((run_dir / "graphs").glob("*/**/summary.json")):
        region = path.relative_to(run_dir / "graphs").parts[0].rsplit("-", 1)[0]
        for entry in json.loads(path.read_text()):
            label = entry.get("label", "?")
            if label == "captured":
                continue
            diff = entry.get("op_diff") or {}
            if not diff:
                quiet.add(label)
                continue
            regions[label].add(region)
            for op, n in diff.items():
                if n > 0 and ("graphtrain" in op or "scaled" in op):
                    inserted[label][op] += n
    lines = []
    for label in sorted(regions):
        # Summed over every compiled graph (forward and backward, each compile of a region).
        ops = ", ".join(f"{op} +{n}" for op, n in sorted(inserted[label].items()))
        lines.append(
            f"  pass fired: {label} in {', '.join(sorted(regions[label]))}"
            + (f" ({ops})" if ops else "")
        )
    silent = sorted(quiet - set(regions))
    if silent:
        lines.append(f"  passes that changed nothing: {', '.join(silent)}")
    if not regions and not silent:
        lines.append("  passes: no graph dumps found (compile.dump_graphs off, or no compile ran)")
    return lines


def _attention(run_dir: Path) -> str:
    """Which attention op the first block's captured graph holds."""
    for path in sorted((run_dir / "graphs").glob("block-*/summary.json")):
        for entry in json.loads(path.read_text()):
            if entry.get("label") != "captured":
                continue
            ops = " ".join(entry.get("op_counts") or {})
            if "flex_attention" in ops:
                return "  attention: flex_attention (packed documents, BlockMask)"
            if "_varlen_attn" in ops:
                return "  attention: varlen_attn (packed documents, cu_seqlens)"
            if "scaled_dot_product_attention" in ops:
                return "  attention: scaled_dot_product_attention (SDPA)"
            return (
                "  attention: none of flex_attention, varlen_attn, SDPA in the captured block graph"
            )
    return "  attention: unknown (no captured block graph)"


def _cudagraphs(run_dir: Path, log: str) -> list[str]:
    lines = []
    info_path = run_dir / INFO_FILE
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    skips, trees = info.get("cudagraph_skips"), info.get("cudagraph_trees_recorded")
    fallback = re.findall(r"compile\.cudagraph_mtp: (.*)", log)
    # Inductor's own reasons (TORCH_LOGS=cudagraphs / perf_hints): "skipping cudagraphs due to ..."
    inductor = sorted(set(re.findall(r"(skipping cudagraphs[^\n]*)", log)))
    if isinstance(trees, int) and trees > 0 and not skips:
        verdict = f"CAPTURED ({trees} cudagraph tree root(s) recorded, no skip)"
    elif isinstance(trees, int) and trees > 0:
        verdict = f"PARTLY captured ({trees} root(s) recorded, {skips} skip(s))"
    elif skips:
        verdict = f"SKIPPED by Inductor ({skips} skip(s))"
    elif fallback:
        verdict = "not used (graphtrain chose not to)"
    elif not info:
        verdict = f"unknown (no {INFO_FILE}: the run did not finish)"
    else:
        verdict = f"none recorded (skips {skips}, trees {trees})"
    lines.append(f"  MTP CUDA graphs: {verdict}")
    lines += [f"    graphtrain: {line.strip()}" for line in fallback[:3]]
    lines += [f"    inductor: {line.strip()[:300]}" for line in inductor[:5]]
    return lines


def _energy(steps: list[dict], log: str, cuda: bool) -> str:
    keys = sorted({k for s in steps for k in s if k.startswith("energy/")})
    if keys:
        last = next(s for s in reversed(steps) if keys[0] in s)
        values = ", ".join(f"{k}={last[k]:.4g}" for k in keys if k in last)
        return f"  energy metric: PRESENT ({values})"
    why = re.findall(r"(energy per token not logged[^\n]*)", log)
    if why:
        return f"  energy metric: ABSENT: {why[0]}"
    if not cuda:
        return "  energy metric: ABSENT (not a CUDA run: NVML is read on CUDA only)"
    return "  energy metric: ABSENT (no reason in the log: is pynvml importable? see preflight)"


def summarize_run(run_dir: Path, log_path: Path | None = None) -> list[str]:
    """The summary lines of one first-contact training run (see the module docstring)."""
    run_dir = Path(run_dir)
    log = log_path.read_text(errors="replace") if log_path and log_path.exists() else ""
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.open()] if metrics.exists() else []
    steps = [r for r in records if "loss" in r]
    lines = [f"  steps logged: {len(steps)}; losses: {[round(s['loss'], 4) for s in steps]}"]
    if steps:
        last = steps[-1]
        keys = [k for k in last if k.split("/")[0] in ("fp8", "mtp", "memory")]
        keys += [k for k in ("tokens_per_s", "tflops_per_device", "mfu") if k in last]
        lines.append("  last step: " + ", ".join(f"{k}={last[k]:.4g}" for k in keys))
    lines += _passes(run_dir)
    lines.append(_attention(run_dir))
    lines += _cudagraphs(run_dir, log)
    info = run_dir / INFO_FILE
    cuda = bool(json.loads(info.read_text()).get("cuda")) if info.exists() else True
    lines.append(_energy(steps, log, cuda))
    return lines


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "train":
        return train(argv[1], argv[2:])
    if len(argv) == 3 and argv[0] == "summarize":
        print("\n".join(summarize_run(Path(argv[1]), Path(argv[2]))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
