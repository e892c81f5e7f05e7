"""Test hook, imported at start-up by a training subprocess that has this folder on PYTHONPATH:
DCP's file writer stops for good (in the .tmp folder) when it writes the checkpoint
folder named by GRAPHTRAIN_TEST_PAUSE_SAVE, and touches a file "paused" in it so the test knows
when to SIGKILL the process."""

import os
import time

from torch.distributed.checkpoint import FileSystemWriter

_target = os.environ.get("GRAPHTRAIN_TEST_PAUSE_SAVE", "")
_write_data = FileSystemWriter.write_data


def _paused_write_data(self, plan, planner):
    if _target and str(self.path).endswith(_target):
        with open(os.path.join(self.path, "paused"), "w"):
            pass
        time.sleep(600)
    return _write_data(self, plan, planner)


FileSystemWriter.write_data = _paused_write_data
