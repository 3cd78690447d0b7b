import os
import sys

# the workers spawned by dist_harness import test modules by name
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
