"""Training: tree-packed loss on prefix-shared trees, a DeepSpeed core cell, elastic satellites.

tree.py     packed sequence -> ancestor mask, per-target logprobs (one forward over unique tokens)
loss.py     PPO-style clipped objective, per-execution token averaging, step metrics
worker.py   GradWorker: plain torch forward/backward on a copy of the weights (satellites, and the core)
core.py     CoreTrainer: authoritative weights + optimizer in DeepSpeed, checkpoints, publishing
elastic.py  one elastic data-parallel step: a micro-batch queue on a TCPStore, one gloo reduction
reference.py per-path training, the reference tree-packed training is checked and timed against
"""
