"""Benchmarks: minillm's speed against transformers and against this machine's limits.

python -m benchmarks.speed            # the full run (see benchmarks/speed.py)
python -m benchmarks.speed --quick    # a smoke run in about a minute
"""
