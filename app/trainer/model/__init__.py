"""The model and what reads it: the GPT itself, the looped model's deep supervision, generation with a KV
cache, and the evaluation during training. One concern per file:

    gpt.py          the GPT top to bottom: norms, rotary positions, attention, MLP, the switches, the loss
    supervision.py  the looped model's per-loop read-outs and the one objective they make
    generate.py     decoding: KV cache, sampling, streaming (pretrain sample and serve use it too)
    evaluate.py     the validation loss and the short samples a run writes while it trains
"""
