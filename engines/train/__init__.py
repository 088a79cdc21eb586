"""Training: tree-packed loss on prefix-shared trees, a DeepSpeed core cell, elastic satellites.

tree.py     packed sequence -> ancestor mask, per-target logprobs (one forward over unique tokens)
loss.py     PPO-style clipped objective, per-execution token averaging, step metrics
worker.py   GradWorker: plain torch forward/backward on a copy of the weights (satellites, and the core)
core.py     CoreTrainer: authoritative weights + optimizer in DeepSpeed, checkpoints, publishing
elastic.py  one elastic data-parallel step, the core's side: micro-batches claimed from a TCPStore, one gloo
            reduction (elastic_protocol.py: what the core and the satellites share)
stream.py   the step's micro-batch queue: chunks appended as groups finish (streaming), the close
satellite.py a satellite's share of a step (run_satellite) and its process
reference.py per-path training, the reference tree-packed training is checked and timed against
"""
