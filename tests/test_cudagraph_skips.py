"""compile.cudagraph_mtp: a CUDA graph capture that Inductor skips is said once in graphtrain's
log, with Inductor's reason (issue 26, defect 5). Inductor's skip is driven through its own
logging function; no GPU is needed to see what reaches the log."""

import dataclasses
import logging

from torch._inductor import cudagraph_utils

from graphtrain.compile import _CudagraphSkipReporter, apply_compile
from models.gpt import GPT, PRESETS


def _reporters() -> list[logging.Handler]:
    log = cudagraph_utils.cudagraphs_log
    return [h for h in log.handlers if isinstance(h, _CudagraphSkipReporter)]


def test_a_skipped_capture_is_said_once_with_its_reason(caplog):
    for handler in _reporters():  # a fresh reporter: another test may have installed one
        cudagraph_utils.cudagraphs_log.removeHandler(handler)
    cfg = dataclasses.replace(PRESETS["debug"], mtp_depth=1, num_layers=1)
    # The layout allows CUDA graphs: the MTP regions get them, and the reporter is installed
    # (nothing compiles yet: Module.compile is lazy).
    apply_compile(GPT(cfg), inner="inductor", cudagraph_mtp=True, device_type="cuda")
    apply_compile(GPT(cfg), inner="inductor", cudagraph_mtp=True, device_type="cuda")
    (reporter,) = _reporters()
    try:
        with caplog.at_level(logging.WARNING, logger="graphtrain"):
            for _ in range(3):  # Inductor logs a skip per graph and per re-record
                cudagraph_utils.log_cudagraph_skip_and_bump_counter(
                    "skipping cudagraphs due to mutated inputs (1 instances)"
                )
        lines = [r.getMessage() for r in caplog.records if "cudagraph_mtp" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "mutated inputs" in lines[0] and "slower" in lines[0]
    finally:
        cudagraph_utils.cudagraphs_log.removeHandler(reporter)


def test_no_reporter_without_cuda_graphs():
    for handler in _reporters():
        cudagraph_utils.cudagraphs_log.removeHandler(handler)
    cfg = dataclasses.replace(PRESETS["debug"], mtp_depth=1, num_layers=1)
    apply_compile(GPT(cfg), inner="inductor", cudagraph_mtp=True, device_type="cpu")
    apply_compile(GPT(cfg), inner="inductor", cudagraph_mtp=False, device_type="cuda")
    assert _reporters() == []
