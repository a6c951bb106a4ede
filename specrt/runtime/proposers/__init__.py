"""Guessers behind one protocol (base.py): prompt lookup, the 1-gram match and the target's
n-gram table. The batched engine's policy (runtime/batch/policy.py) sees only `Proposer`; draft
models are BatchModels the engine runs itself (base.py)."""
from specrt.runtime.proposers.base import EMPTY, Chain, Proposal, Proposer
from specrt.runtime.proposers.lookup import OneGram, PromptLookup, lookup
from specrt.runtime.proposers.ngram import TableGuess

__all__ = ["EMPTY", "Chain", "OneGram", "PromptLookup", "Proposal", "Proposer", "TableGuess", "lookup"]
