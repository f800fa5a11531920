import os
import sys
from pathlib import Path

# Test helpers (pipeline_runs.py) live next to the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))
# torch.cuda.is_available() asks the CUDA runtime unless this is set, and from then on no fork of the asking process
# can use CUDA ("Cannot re-initialize CUDA in forked subprocess"): tests ask at collection time, megatron-core 0.19
# at import time. With it, torch answers from NVML and forks stay good (tests/helpers/fork_ranks.py says more); the
# processes the tests start inherit it.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest  # noqa: E402

if os.environ.get("MEGATRON_APP_CORE"):
    # The sanitizer build (tools/build_sanitized.sh): loaded before any test imports the module by its name.
    import megatron_app.transport._core  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip, with the reason, where no CUDA device is visible."""
    cuda_tests = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_tests:
        return
    import torch  # is_available() answers from NVML here (above): forking afterwards stays allowed

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


@pytest.fixture
def megatron_single_rank(tmp_path):
    """One gloo rank with Megatron's model-parallel state (every size 1), seeded as the trainer seeds."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_app.train.init import seed_all

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    seed_all(0, "cpu")
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
