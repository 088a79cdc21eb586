"""The GPU check: the rollout engine, tree-packed training, the DeepSpeed core, role switches, KV
migration and a vLLM engine, measured in ONE run on one device; JSON out.

    bash bench/gpu_check.sh                                   # the one command on a GPU machine
    python -m bench.gpu --budget 420 --out bench/results/gpu.json [--quick] [--copy-to DIR]
    python -m bench.gpu --budget 200 --sections deepspeed,migration    # a rerun: other sections kept

On CUDA it uses the gpu-0.5b and gpu-1.5b presets (seeded random weights built locally with
``save_model_folder``: nothing is downloaded) in bf16. Without CUDA the same code falls back to the
tiny preset and tiny sizes, so the script is tested where there is no GPU (tests/test_gpu_check.py).

Sections, in order (a failure is recorded as ``"status": "error"`` with the traceback's tail and
the next section still runs; one failed measurement inside a section goes under its ``"errors"`` and
the section is ``"partial"``; a section that cannot start before the budget runs out is recorded as
``"skipped"`` with the reason; the JSON is rewritten after every section and sub-step, so a killed
run leaves what it measured):

    engine       a multi-turn agent workload (each turn's prompt = previous prompt + output + a tool
                 result), batch 1/16/64: our engine vs HF ``generate`` on the same prompts (HF: one
                 batched call per turn, left padding, the full context every turn), prefix-cache hits
    train        bench/train.py's packed branched batch: tree-packed fwd+bwd vs per-path on the same
                 model and batch; GradWorker (its gradient sum lives in a CPU buffer for the gloo
                 reduction) timed apart; fp32 equality of logprobs and gradients on one sequence
    deepspeed    CoreTrainer (ZeRO-2, bf16): one micro-batch by its worker, apply (surrogate backward
                 + optimizer step), weight sync back to the worker; mean step time, peak memory
    role_switch  the product's switch sequence (scheduler/cells.py CellPool.to_train / to_rollout) on one
                 cell whose engine and trainer share the device: rollout->train: drain, engine.sleep(),
                 the trainer's weights to the device, one micro-batch fwd+bwd; train->rollout: the
                 trainer offloaded to the host, engine.wake() with its NEW weights, the first token
                 (goals <= 3 s and <= 1.5 s)
    migration    two engine processes on the one device: a session's KV moved A->B over /dev/shm
                 (ShmTransport) and over torch IPC (TorchIpcTransport: a CUDA IPC handle on a GPU)
                 vs recomputing the context on B
    vllm         one vLLM engine started as a campaign starts it (stack/serving.py engine_process:
                 our adapter in front of vLLM's server): start, tokens/s at concurrency 8 (bench/engines_compare
                 agent_workload), a weight reload of version 1, sleep and wake with version 2 (free GPU memory
                 before / asleep / after on a GPU, vLLM's sleep mode; on CPU a pause, memory kept). vLLM is the
                 first of $GYRE_VLLM_PYTHON, ./.venv-vllm/bin/python and this python whose environment holds
                 it; none: "skipped" with the reason (the device machine reaches no package registry and
                 carries at most 64 MiB, so vLLM runs there only if its image has it)

Timings synchronize the device around each measured interval; figures are wall-clock.

Modules: plan.py (sizes per device), run.py (the budget, the models, the shared batch, the JSON), one
module per section (engine.py, train.py, deepspeed_core.py, role_switch.py, migration.py,
vllm_engine.py), check.py (``main`` and the summary), __main__.py (the command line).
"""

from bench.gpu.check import DEFAULT_OUT, main, summary
from bench.gpu.plan import SECTIONS

__all__ = ["DEFAULT_OUT", "SECTIONS", "main", "summary"]
