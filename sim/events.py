"""The kinds of event on the simulation's heap, one place for every part that pushes or pops them.

sim/run.py's loop pops `(when, seq, kind, target, gen)` and hands each kind to its part: the engines
and executions of sim/rollout.py push ENGINE_STEP, PREFILL_END, GAP_END and DEADLINE; the training of
sim/training.py pushes TRAIN_DRAINED and UPDATE_DONE; the controller in sim/run.py pushes SWITCH_DONE
and TICK.
"""

ENGINE_STEP, PREFILL_END, GAP_END, DEADLINE, SWITCH_DONE, TRAIN_DRAINED, UPDATE_DONE, TICK = range(8)
