import os
import sys

# The helpers beside the tests (sglang_files, host_pool, engine) import by name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
