"""graphtrain: a compile-graph-centric trainer for GPT and Mixture-of-Experts language models."""

import graphtrain.compile  # noqa: F401  (registers the "graphtrain" torch.compile backend)

__version__ = "0.1.0"
