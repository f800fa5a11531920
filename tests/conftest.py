import os
import sys
from pathlib import Path

# Test helpers (pipeline_runs.py) live next to the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402

if os.environ.get("MEGATRON_APP_CORE"):
    # The sanitizer build (tools/build_sanitized.sh): loaded before any test imports the module by its name.
    import megatron_app.transport._core  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip, with the reason, where no CUDA device is visible."""
    cuda_tests = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_tests:
        return
    import torch  # is_available() does not initialise CUDA: forking ranks afterwards stays allowed

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in cuda_tests:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def real_corpus(tmp_path_factory):
    """tools/make_corpus.py's corpus: {'dir', 'data_path', 'tokenizer_json', 'output'}."""
    from real_corpus import build_real_corpus

    return build_real_corpus(tmp_path_factory.mktemp("real_corpus"))
