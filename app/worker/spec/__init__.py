"""Speculative decoding in the worker: proposers draft tokens, the runner verifies them in one target
forward (verify.py accepts them). proposer.py is the interface every drafting method implements."""
