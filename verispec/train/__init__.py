"""Training drafter heads (EAGLE-style, Medusa) for a target model, in resumable stages.

    data.py      self-distillation: the target's own greedy answers to training prompts (jsonl shards)
    extract.py   prefill passes over prompt + answer: target features and next-token top-k distributions
    vocab.py     the reduced draft vocabulary (most frequent tokens of the training data)
    loops.py     training loops (EAGLE-3 training-time test unrolling; Medusa heads), logging, checkpoints
    evaluate.py  held-out top-1 agreement and mean accepted length through the engine

Stages write under one work directory (default .verispec-train/<target>/, ignored by git) and skip
what is already there, so an interrupted run picks up where it stopped. Checkpoint format and loading
live in verispec.heads (the drafters load heads without importing the training code).
"""
