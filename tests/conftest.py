import os
import sys
from pathlib import Path

# Test helpers (pipeline_runs.py) live next to the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402

if os.environ.get("MEGATRON_APP_CORE"):
    # The sanitizer build (tools/build_sanitized.sh): loaded before any test imports the module by its name.
    import megatron_app.transport._core  # noqa: E402,F401


@pytest.fixture(scope="session")
def real_corpus(tmp_path_factory):
    """tools/make_corpus.py's corpus: {'dir', 'data_path', 'tokenizer_json', 'output'}."""
    from real_corpus import build_real_corpus

    return build_real_corpus(tmp_path_factory.mktemp("real_corpus"))
