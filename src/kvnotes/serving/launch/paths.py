"""Where the vLLM process finds kvnotes: the folder that holds the ``kvnotes`` package.

The server runs in its own virtual environment (vLLM pins other versions of torch and
transformers); it imports the connector from this source tree through ``PYTHONPATH``.
"""

from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[3]  # .../src (or site-packages)
