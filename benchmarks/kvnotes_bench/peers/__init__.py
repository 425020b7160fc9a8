"""kvnotes against its peers on the same weights and prompts: kvboost 0.9.0 as a library
(``kvnotes-bench peers``: :mod:`.bench`) and as a server (``kvnotes-bench peers-servers``).

Nothing here imports kvboost: :mod:`.kvboost_worker` runs it in ``.venv-peers``. The package
imports nothing at load, so the worker starts without kvnotes' dependencies.
"""
