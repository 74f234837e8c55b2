"""The emulated CUDA driver used by the tests (C source and its build helper)."""
