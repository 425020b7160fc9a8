"""kvnotes in a vLLM server: the product side.

The connector (the only module that imports vLLM) splices registered skills into requests; the
piece store and splice planning decide what it may splice; skills are compiled and published by
:mod:`kvnotes.serving.skills`; :mod:`kvnotes.serving.launch` starts the one kind of server every
caller uses; :mod:`kvnotes.serving.compose_client` sends composed prompts to it.

Nothing is imported here: vLLM's process imports ``kvnotes.serving.connector``, and its import
closure must stay free of the engine and of transformers.
"""
