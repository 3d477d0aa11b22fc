import os

import pytest


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """Keep the built-in default model out of $HOME: an existing MOEFERRY_CACHE (CI sets one)
    is reused, else a per-session temporary directory."""
    if not os.environ.get("MOEFERRY_CACHE"):
        os.environ["MOEFERRY_CACHE"] = str(tmp_path_factory.mktemp("moeferry-cache"))
    return os.environ["MOEFERRY_CACHE"]
