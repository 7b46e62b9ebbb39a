"""Prints this worker's environment as one JSON line (env parity test)."""

import json
import os
import sys

print("ENVDUMP " + json.dumps(dict(os.environ), sort_keys=True), flush=True)
print("ARGV " + json.dumps(sys.argv), flush=True)
