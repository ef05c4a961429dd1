"""pretrain: an LLM pretraining batch job that trains the best model a fixed dollar budget buys."""

import os

__version__ = "0.1.0"

# The process that started this one, read before anything slow is imported. Under torchrun it is the
# launcher: a rank whose launcher dies while the rank still imports torch (seconds) is handed to PID 1,
# and only this tells it, when it joins the run, that it had a launcher (end_with_launcher).
STARTED_BY = os.getppid()
