"""The GPU tier's environment, set before any CUDA work in this process and inherited by the
workers it spawns ([Note: deterministic GPU runs] in `support.cuda_deterministic`)."""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
