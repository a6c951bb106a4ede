"""Proposers behind one protocol (base.py): a draft model, prompt lookup, the 1-gram match
and the target's n-gram table. The loop (runtime/loop.py) sees only `Proposer`."""
from specrt.runtime.proposers.base import EMPTY, Chain, Proposal, Proposer, ProposerStats
from specrt.runtime.proposers.draft import DraftModel
from specrt.runtime.proposers.lookup import OneGram, PromptLookup, lookup
from specrt.runtime.proposers.ngram import TableGuess

__all__ = ["EMPTY", "Chain", "DraftModel", "OneGram", "PromptLookup", "Proposal", "Proposer", "ProposerStats",
           "TableGuess", "lookup"]
