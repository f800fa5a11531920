import sys
from pathlib import Path

# Test helpers (pipeline_runs.py) live next to the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))
