"""examples/simple_train_loop.py as the tests run it (the same flags), plus --misbuild for the refusal test: every
chunk built with pre_process=True, as NVIDIA's single-stage example builds its model (--misbuild-rank R: only on
global rank R)."""

import importlib.util
import os
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "simple_train_loop.py"


def load_example():
    spec = importlib.util.spec_from_file_location("simple_train_loop", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


if __name__ == "__main__":
    example = load_example()
    misbuilt_ranks = None
    if "--misbuild" in sys.argv:
        sys.argv.remove("--misbuild")
        misbuilt_ranks = {int(os.environ["RANK"])}
    if "--misbuild-rank" in sys.argv:
        at = sys.argv.index("--misbuild-rank")
        misbuilt_ranks = {int(sys.argv[at + 1])}
        del sys.argv[at:at + 2]
    if misbuilt_ranks is not None and int(os.environ["RANK"]) in misbuilt_ranks:
        build = example.model_provider

        def misbuilt(*args, **kwargs):
            from megatron.core import parallel_state

            first_stage = parallel_state.is_pipeline_first_stage
            parallel_state.is_pipeline_first_stage = lambda *a, **k: True
            try:
                return build(*args, **kwargs)
            finally:
                parallel_state.is_pipeline_first_stage = first_stage

        example.model_provider = misbuilt
    example.main()
