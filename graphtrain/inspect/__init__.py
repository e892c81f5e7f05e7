"""`graphtrain inspect`: what the compiler did to a model, as data, a terminal summary and a page.

    report = graphtrain.inspect.inspect(model, x, y, passes=["-fuse_linear_cross_entropy"])
    report.custom_ops            # Counter: graphtrain op name -> count in the final graphs
    report.graph_breaks          # reasons and source lines
    report.recompiles            # graphs compiled again, with torch's guard failure
    write_report(report, "out")  # out/report.html (self-contained), report.json, summary.txt

Files: report.py (the Report, built from graph dumps), capture.py (running the compile),
profile.py (kernel time attributed to graphs, kernels and source lines: --profile), api.py
(entry points), terminal.py and html.py (the two renderings), cli.py (the command).
"""

from graphtrain.inspect.api import inspect, inspect_config, write_report
from graphtrain.inspect.report import Report, load_report

__all__ = ["Report", "inspect", "inspect_config", "load_report", "write_report"]
