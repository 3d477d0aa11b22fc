"""Test set-up shared by every test.

Triton kernels run under the interpreter on machines without a GPU, so CI checks every
kernel against its plain-torch reference. TRITON_INTERPRET must be set before triton.jit
decorates anything, hence here, before any moeferry module is imported.
"""
import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """Keep the built-in default model out of $HOME: an existing MOEFERRY_CACHE (CI sets one)
    is reused, else a per-session temporary directory. Autouse: every test that reaches
    ensure_default_model() builds it there, once."""
    if not os.environ.get("MOEFERRY_CACHE"):
        os.environ["MOEFERRY_CACHE"] = str(tmp_path_factory.mktemp("moeferry-cache"))
    return os.environ["MOEFERRY_CACHE"]


@pytest.fixture
def device():
    return torch.device("cuda" if _HAS_CUDA else "cpu")
