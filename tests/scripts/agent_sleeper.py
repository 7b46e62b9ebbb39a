"""A plain script that never imports ckptrun: silent for --seconds, then exits 0."""

import sys
import time

time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 3)
print("slept", flush=True)
