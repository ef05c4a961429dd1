"""pretrain: an LLM pretraining batch job that trains the best model a fixed dollar budget buys."""

__version__ = "0.1.0"
