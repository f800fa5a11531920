"""The real corpus of tools/make_corpus.py, built once per test session (license texts and Python help topics)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "make_corpus.py"


def build_real_corpus(directory: Path, *extra: str) -> dict:
    result = subprocess.run([sys.executable, str(TOOL), "--output-dir", str(directory), *extra],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return {"dir": directory, "data_path": str(directory / "corpus_text_document"),
            "tokenizer_json": str(directory / "tokenizer.json"), "output": result.stdout}
