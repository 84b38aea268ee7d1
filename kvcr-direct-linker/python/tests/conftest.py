import os
import sys

# The helpers beside the tests (pools) import by name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gpu: needs a CUDA GPU; runs with KVCR_TEST_GPU=1 (and fails without one then)",
    )
