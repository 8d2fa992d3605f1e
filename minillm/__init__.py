"""minillm: a from-scratch NumPy runtime for decoder-only transformers, built to teach inference."""
