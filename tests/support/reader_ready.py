"""Imported by the reader process as a preload in tests/hub/test_worker.py: slow, and leaves a mark when done."""

import os
import time

_mark = os.environ.get("FDLORA_TEST_READY_MARK")
if _mark:
    time.sleep(0.5)
    with open(_mark, "w") as f:
        f.write("imported")
