"""Offline serving: a station in this process, with no HTTP, for bulk work. `LLM` and `SamplingParams` (llm.py) are
the Python API; `jaxstation batch` runs an OpenAI batch file (batch.py). Both build each request as the OpenAI routes
do and run it through the same scheduler, continuously batched over the lanes (runs.py)."""
