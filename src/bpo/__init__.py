"""bpo: Branching Policy Optimization for LLM agents in snapshottable sandboxes."""

__version__ = "0.1.0"
