"""What turns gradients into updates. One concern per file:

optimizer.py  AdamW, or Muon for the hidden matrices (shared out across ranks), clipping, fused steps
schedule.py   the learning rate and Muon's momentum of every step (cosine, WSD, constant), the one
              object the loop asks
"""
