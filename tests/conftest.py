"""Test-session settings shared by every test module."""

import torch

# Forked workers run with one thread (OpenMP does not survive fork); the in-process reference
# must use the same count, or matmul reduction order, and so the last bits, differ.
torch.set_num_threads(1)
