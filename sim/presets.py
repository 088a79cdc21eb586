"""What the simulator runs: the modelled work, engines, trainers and cluster of each preset.

A `Preset` composes small frozen configs (one per modelled part, a docstring under every field)
and `sample_workload` draws its executions, seeded, so every policy runs on the same work.

Presets (`PRESETS`):
- `paper-flagship`: the flagship run of the QwenGyre paper, calibrated to its two baselines. The
  paper gives only: 48 steps, ~700K tokens per rollout, switches 8.5 s to train / 3.5 s back, equal
  GPU budgets, and the makespans colocate 91.5 h, async 134.6 h, elastic 75.4 h. Everything else is
  OUR assumption, set from hardware and model figures (not fitted) unless marked CALIBRATED:
  * 16 cells of 8 H100 80 GB (128 GPUs); a cell runs one TP8 engine (`engine.devices`) or a trainer
    replica. The size is chosen so that the trainer's footprint is half the pool (below).
  * a Qwen3-235B-A22B-class MoE in bf16: 470 GB of weights, 192 KB of KV per token (94 layers x
    4 KV heads x 128 x 2 x 2 bytes); 90% of the devices' memory usable, so an engine's KV cache
    holds ~539K tokens: five to eight executions at the suites' contexts. Executions wait for KV
    room; at a turn whose context no longer fits, an execution is preempted and recomputes.
  * decode by continuous batching: a step takes 12 ms + 0.5 ms per sequence + 20 ns per context
    token of the batch (batch 1 at 64K: ~72 tokens/s; 8 at 96K: ~30 tokens/s each); prefill
    20,000 tokens/s per engine.
  * 128 executions per step (16 problems x 8), one per session slot of the pool (8 per engine):
    colocate starts a step at once, a half-pool split runs it in about two waves.
  * executions: turns lognormal (sigma 0.3; medians 230 / 170 / 300 in three suites), 300 tokens
    decoded + 2,500 tool-result tokens per turn (~690K unique tokens per execution: the paper's
    ~700K); contexts compress at 128K, keeping half (`context_keep`); deadline 4 h (never reached).
  * tool gaps lognormal per turn, sigma 1.5, median 1.4 s: CALIBRATED (the production trace's p50
    1.6 s / p99 ~700 s tail, `GAP_TRACE`, gives 46 s a turn on average: an execution alone would
    outlast the paper's step).
  * training by active parameters: 8 x 22B FLOPs a token (forward, backward, old logprobs) + 370
    GFLOP of attention at ~60K context, on 989 TFLOP/s devices at 40% MFU (CALIBRATED): 5,800
    tokens/s per cell; 60 s per update and publication; a footprint of 8 cells (3.8 TB of weights,
    gradients and Adam states plus long-context activations over 80 GB devices): fewer train cells
    offload and run at a quarter of their rate.
  * the paper's async (`async-paperlike`, sim/baselines.py): a static split, one step off-policy,
    the next batch generated only once the previous is complete and trained only once complete;
    the best of the splits `async_splits` (8 train cells: the footprint). The streaming async row
    (`async`) keeps the same splits with streaming: the honest strongest static baseline.
  The two CALIBRATED knobs were set, on the 48-step campaign, so that colocate and the paper-like
  async land within 10% of 91.5 h and 134.6 h; elastic was never looked at while setting them.
- `cpu-small`: the real comparison's machine (bench/schedule_real.py): four one-thread cells that
  own a quarter core each (partitioned), two sessions a cell, groups of 2 of 8 problems a step.
  RECALIBRATED on 2026-12-06 (again after the engine's flash prefill and with the core started
  before the clock) from that benchmark's two calibration runs (colocate and async on the
  seed-8000 problems, `bench/results/schedule-measured-cpu-small.json`): the machine is what
  `sim.calibrate.calibrate` fitted (decode 0.0262 s a token at batch 1 and a fifth of it per more
  sequence, training 954 tokens/s a cell, a 1.47 s update, colocate's switch until productive
  3.70 s, back 0.06 s), and the executions are `measured_suite` of the same runs (2.87 turns at the
  median, 44 tokens decoded and 324 more unique tokens a turn, 0.36 s of tools a turn, 11.9% of the
  unique tokens trained: most groups carry no signal). The first fit of that day (decode 0.0301 s,
  876 tokens/s, a 1.83 s update, 1.82 s and 0.04 s switches, 0.46 s of tools) had the core's
  start-up inside the calibration runs. Elastic as the benchmark runs it (lent core,
  gain_factor 0). Until 2026-12-06 it was a first, loose guess on shared cores (12 x 4 executions
  of six turns, 320 tokens/s, switches at the goals).
- `cpu-small-tail`: cpu-small with a heavy tail (one execution in six of 55 turns at the median,
  into a 40 s deadline, as bench/results/rollout.json saw 40-70 turn executions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Suite:
    """One problem suite: how long its executions run and how many tokens they touch."""

    name: str
    weight: float
    """Share of a step's problems drawn from this suite."""
    turns_median: float
    """Median number of model calls (turns) of one execution."""
    turns_sigma: float
    """Lognormal sigma of the number of turns: the heavy tail of execution lengths."""
    output_tokens_per_turn: float
    """Tokens decoded per turn."""
    context_tokens_per_turn: float
    """Tokens added to the context per turn besides the output (tool results, observations)."""
    gap_median_s: float
    """Median tool time after a turn (command, tests, environment)."""
    gap_sigma: float
    """Lognormal sigma of one tool gap."""
    trained_share: float = 1.0
    """Share of an execution's unique tokens that are trained (zero-signal groups are skipped,
    selection keeps at most J_max paths)."""


@dataclass(frozen=True)
class EngineModel:
    """A rollout engine in one cell: decode latency against batch size and context length."""

    sessions_per_cell: int
    """Executions one engine hosts at once (its KV cache at the suite's context lengths)."""
    latency_fixed_s: float
    """Seconds per decode step whatever the batch (weights read once per step)."""
    latency_per_seq_s: float
    """Seconds added to a decode step per sequence in the batch."""
    latency_per_ctx_token_s: float
    """Seconds added to a decode step per sequence per context token (attention reads)."""
    max_context: int
    """Context length cap: longer executions compress (summary calls)."""
    kv_bytes_per_token: float
    """KV cache bytes per context token: what a migration moves."""
    migrate_bytes_per_s: float
    """Bandwidth of a KV migration between engines."""
    migrate_fixed_s: float = 0.05
    """Per-session fixed cost of a migration (reroute, handshake)."""
    devices: int = 1
    """Devices one engine spans (tensor parallel); a cell of `Cluster.devices_per_cell` devices runs
    devices_per_cell // devices engines, each with its own batch and KV cache."""
    device_memory_gb: float = 0.0
    """Memory of one device. 0: the KV cache is not modelled (only `sessions_per_cell` limits an engine)."""
    weights_gb: float = 0.0
    """Memory the model's weights take across the engine's devices."""
    memory_utilization: float = 0.9
    """Share of the devices' memory the engine may use (weights + KV; the rest is activations)."""
    prefill_tokens_per_s: float = 0.0
    """Prompt tokens one engine prefills per second: each segment's new tokens (tool results) are
    prefilled before it decodes, and a preempted execution recomputes its whole context. 0: free."""

    def latency(self, batch: float, context: float) -> float:
        """Seconds per decode step of a session decoding with `batch` sequences at `context`."""
        return self.latency_fixed_s + batch * (
            self.latency_per_seq_s + self.latency_per_ctx_token_s * context
        )

    def step_latency(self, batch: int, context_sum: float) -> float:
        """Seconds per decode step of a continuous batch: `batch` sequences whose contexts sum to
        `context_sum` (each sequence gets one token per step)."""
        return (
            self.latency_fixed_s + batch * self.latency_per_seq_s + self.latency_per_ctx_token_s * context_sum
        )

    @property
    def kv_capacity_tokens(self) -> float:
        """Context tokens one engine's KV cache holds: the devices' usable memory less the weights,
        over the KV bytes per token (inf where memory is not modelled)."""
        if self.device_memory_gb <= 0:
            return math.inf
        free = self.devices * self.device_memory_gb * self.memory_utilization - self.weights_gb
        return max(free, 0.0) * 1e9 / self.kv_bytes_per_token

    def prefill_s(self, tokens: float) -> float:
        return tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s > 0 else 0.0


@dataclass(frozen=True)
class TrainerModel:
    """A trainer replica in one cell (the core or a satellite)."""

    tokens_per_s: float
    """Training tokens per second of one cell (streaming micro-batches). 0: derived from the active
    parameters (`active_params_b`, `attention_gflop_per_token`, `device_tflops`, `mfu`)."""
    update_s: float
    """Seconds of the optimizer update, weight publication and engine hot-swap after a step, with
    the core alone on its cores (on shared cores it takes longer while engines decode)."""
    min_cells: int = 1
    """The model's minimum training footprint: cells for weights, gradients, optimizer states and
    long-context activations. Fewer ready train cells train at `offload_efficiency` of their rate."""
    offload_efficiency: float = 0.25
    """Below `min_cells` the trainer offloads optimizer states and parameters to host memory
    (ZeRO-offload) and trains at this share of its rate per cell; 0: it trains nothing."""
    active_params_b: float = 0.0
    """Active parameters (billions): a trained token costs 8 x active FLOPs (forward, backward and
    the old-logprob forward)."""
    attention_gflop_per_token: float = 0.0
    """Attention FLOPs per trained token at the suites' contexts (GFLOP; forward, backward, logprobs)."""
    device_tflops: float = 0.0
    """Peak dense bf16 TFLOP/s of one device."""
    mfu: float = 0.0
    """Share of the peak a long-context RL training step reaches."""

    def cell_tokens_per_s(self, devices_per_cell: int) -> float:
        """Tokens per second one cell trains: `tokens_per_s`, or the FLOPs a cell delivers over the
        FLOPs a token costs."""
        if self.tokens_per_s > 0:
            return self.tokens_per_s
        flop = 8 * self.active_params_b * 1e9 + self.attention_gflop_per_token * 1e9
        if flop <= 0 or self.device_tflops <= 0 or self.mfu <= 0:
            raise ValueError("trainer: set tokens_per_s, or active_params_b, device_tflops and mfu")
        return devices_per_cell * self.device_tflops * 1e12 * self.mfu / flop


@dataclass(frozen=True)
class Cluster:
    """The pool of cells."""

    cells: int
    """Cells in the pool; cell 0 is the core."""
    devices_per_cell: int
    """Devices (GPUs, or threads on CPU) per cell: idle figures are in device-seconds."""
    shared_cores: float | None = None
    """CPU only: cores shared by all active cells; each active cell runs at min(1, cores/active)."""


@dataclass(frozen=True)
class Preset:
    """A whole simulated campaign: work, machines, switch costs, the controller's tick."""

    name: str
    steps: int
    """Optimizer steps of the campaign."""
    groups_per_step: int
    """Problems per step (each one group)."""
    group_size: int
    """Executions per problem."""
    suites: tuple[Suite, ...]
    deadline_s: float
    """Wall-clock limit of one execution; it then ends as a timeout and trains on what it did."""
    segments: int
    """Turns are simulated in this many segments per execution (decode, then tool gap): fewer
    events, the same totals."""
    cluster: Cluster
    engine: EngineModel
    trainer: TrainerModel
    to_train_s: float
    """Seconds for a cell to leave rollout and join training (drain, sleep, weight pull, join)."""
    to_rollout_s: float
    """Seconds for a cell to leave training and serve (wake, load weights, register)."""
    tick_s: float
    """The controller asks the policy every tick_s seconds."""
    seed: int = 0
    elastic: dict[str, float] = field(default_factory=dict)
    """ElasticConfig fields for this preset (dwell times scale with the step)."""
    async_splits: tuple[int, ...] = (1,)
    """Train-cell counts the async baseline is tried with; the best one is reported."""
    problem_share: float = 0.0
    """Share of the variance of an execution's log turns that belongs to its problem (0..1): the
    members of a group then share their suite and that part of their length, as siblings do on a
    real problem, and a problem's earlier executions predict it. 0: every execution draws its
    length alone (the presets' default, and the figures of bench/results/schedule.json)."""
    dispatch_order: str = "group"
    """Which queued executions of a step start first: "group" (problem order, as sampled),
    "predicted" (longest predicted first: the problem's expected duration, what its history in the
    executions table tells; members of a group stay together) or "oracle" (each execution's true
    duration: the limit of any predictor)."""

    stream_training: bool = True
    """Groups train as they finish (micro-batches stream into the step's backlog). False: a step's
    batch trains only once all its executions have finished (the paper's async baseline)."""
    context_keep: float = 1.0
    """Share of `engine.max_context` an execution keeps when it compresses its context (a summary
    call); past the cap its context runs between keep x max and max, (1 + keep) / 2 x max on
    average. 1.0: the context stays at the cap."""

    @property
    def executions_per_step(self) -> int:
        return self.groups_per_step * self.group_size

    @property
    def engines_per_cell(self) -> int:
        return max(1, self.cluster.devices_per_cell // self.engine.devices)

    @property
    def train_tokens_per_s(self) -> float:
        """Tokens per second one train cell trains."""
        return self.trainer.cell_tokens_per_s(self.cluster.devices_per_cell)


@dataclass(frozen=True)
class Workload:
    """Sampled executions of a campaign; arrays are [step, execution(, segment)]."""

    decode_tokens: np.ndarray  # [S, E, K] tokens decoded in each segment
    context: np.ndarray  # [S, E, K] context length while the segment decodes
    gaps_s: np.ndarray  # [S, E, K] tool time after each segment
    train_tokens: np.ndarray  # [S, E] tokens trained if the execution completes
    batch1_s: np.ndarray  # [S, E] duration at batch-1 decode speed, capped by the deadline
    predicted_s: np.ndarray | None = None
    """[S, E] the expected batch-1 duration of each execution's problem (its members share it):
    what a predictor that knows the problem's history can know before dispatch; None when the
    workload has no per-problem part (problem_share 0) or was measured."""
    prefill_tokens: np.ndarray | None = None
    """[S, E, K] new prompt tokens each segment prefills before it decodes (tool results,
    observations); None: no prefill."""


def _lognormal_sum(rng: np.random.Generator, n: np.ndarray, median: float, sigma: float) -> np.ndarray:
    """The sum of n lognormal gaps, drawn as one lognormal with the same mean and variance
    (Fenton-Wilkinson), so millions of turns cost one draw per segment."""
    mean = median * math.exp(sigma**2 / 2)
    n = np.maximum(n, 1e-9)
    s2 = np.log1p((math.exp(sigma**2) - 1) / n)  # relative variance of a sum of n falls as 1/n
    return np.exp(rng.normal(np.log(n * mean) - s2 / 2, np.sqrt(s2)))


def sample_workload(preset: Preset, seed: int | None = None) -> Workload:
    """Draws every execution of the campaign with one seeded generator (same seed, same work)."""
    rng = np.random.default_rng(preset.seed if seed is None else seed)
    shape = (preset.steps, preset.executions_per_step)
    k = preset.segments
    weights = np.array([s.weight for s in preset.suites])
    suite = rng.choice(len(preset.suites), size=shape, p=weights / weights.sum())

    def per_suite(attr: str) -> np.ndarray:
        return np.array([getattr(s, attr) for s in preset.suites])[suite]

    rho = preset.problem_share
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"{preset.name}: problem_share is {rho}, not within 0..1")
    if rho == 0.0:
        log_turns = rng.normal(np.log(per_suite("turns_median")), per_suite("turns_sigma"))
        problem_log_turns = None
    else:
        g = preset.group_size
        suite = np.repeat(suite[:, ::g], g, axis=1)  # a group's members solve one problem
        median, sigma = np.log(per_suite("turns_median")), per_suite("turns_sigma")
        member = rng.normal(0.0, 1.0, shape)
        problem = np.repeat(np.random.default_rng([preset.seed if seed is None else seed, 1]).normal(
            0.0, 1.0, (shape[0], shape[1] // g)), g, axis=1)  # fmt: skip
        problem_log_turns = median + sigma * math.sqrt(rho) * problem
        log_turns = problem_log_turns + sigma * math.sqrt(1.0 - rho) * member
    turns = np.maximum(1.0, np.round(np.exp(log_turns)))
    per_segment = (turns / k)[..., None] * np.ones(k)
    out_per_turn = per_suite("output_tokens_per_turn")
    unique_per_turn = out_per_turn + per_suite("context_tokens_per_turn")
    decode = per_segment * out_per_turn[..., None]
    prefill = per_segment * per_suite("context_tokens_per_turn")[..., None]
    turns_before_middle = np.cumsum(per_segment, axis=-1) - per_segment / 2
    context = compressed_context(turns_before_middle * unique_per_turn[..., None], preset)
    gaps = np.empty_like(decode)
    for index, s in enumerate(preset.suites):
        mask = suite == index
        gaps[mask] = _lognormal_sum(rng, per_segment[mask], s.gap_median_s, s.gap_sigma)
    train = turns * unique_per_turn * per_suite("trained_share")
    prefill_s = preset.engine.prefill_s(prefill)
    batch1 = np.minimum(
        (decode * preset.engine.latency(1, context) + gaps + prefill_s).sum(axis=-1), preset.deadline_s
    )
    predicted = None
    if problem_log_turns is not None:  # the problem's median member: its turns at the mean tool gap
        expected_turns = np.maximum(1.0, np.exp(problem_log_turns))
        mid_context = compressed_context(expected_turns * unique_per_turn / 2, preset)
        gap_mean = per_suite("gap_median_s") * np.exp(per_suite("gap_sigma") ** 2 / 2)
        per_turn = out_per_turn * preset.engine.latency(1, mid_context) + gap_mean
        predicted = np.minimum(expected_turns * per_turn, preset.deadline_s)
    return Workload(decode, context, gaps, train, batch1, predicted, prefill)


def compressed_context(tokens: np.ndarray, preset: Preset) -> np.ndarray:
    """The mean context of a segment whose middle has seen `tokens` unique tokens: as many up to
    the cap, then (1 + context_keep) / 2 of it (the execution compresses, `Preset.context_keep`)."""
    cap = preset.engine.max_context
    return np.where(tokens <= cap, tokens, cap * (1 + preset.context_keep) / 2)


GAP_TRACE = {"gap_median_s": 1.6, "gap_sigma": 2.59}  # p50 1.6 s, p90 44 s, p99 ~700 s (SCHEDULER-NOTES)
PAPER_GAPS = {"gap_median_s": 1.4, "gap_sigma": 1.5}  # calibrated: see the module docstring

PAPER_FLAGSHIP = Preset(
    name="paper-flagship",
    steps=48,
    groups_per_step=16,
    group_size=8,
    suites=(
        Suite("swe", 0.5, 230, 0.3, 300, 2500, **PAPER_GAPS),
        Suite("terminal", 0.3, 170, 0.3, 300, 2500, **PAPER_GAPS),
        Suite("research", 0.2, 300, 0.3, 300, 2500, **PAPER_GAPS),
    ),
    deadline_s=4 * 3600,
    segments=6,
    cluster=Cluster(cells=16, devices_per_cell=8),
    engine=EngineModel(
        sessions_per_cell=8,
        latency_fixed_s=0.012,
        latency_per_seq_s=0.0005,
        latency_per_ctx_token_s=2e-8,
        max_context=131072,
        kv_bytes_per_token=192 * 1024,
        migrate_bytes_per_s=25e9,
        devices=8,
        device_memory_gb=80,
        weights_gb=470,
        memory_utilization=0.9,
        prefill_tokens_per_s=20000,
    ),
    trainer=TrainerModel(
        tokens_per_s=0,
        update_s=60,
        min_cells=8,
        active_params_b=22,
        attention_gflop_per_token=370,
        device_tflops=989,
        mfu=0.4,
    ),
    to_train_s=8.5,
    to_rollout_s=3.5,
    tick_s=60,
    elastic={"min_dwell_s": 600, "lend_core": True},
    async_splits=(8, 10, 12),
    context_keep=0.5,
)

# cpu-small's executions: `sim.calibrate.measured_suite` of the two calibration runs of
# bench/results/schedule-measured-cpu-small.json (2026-12-06: colocate and async, generator seed 8000);
# `python -m bench.schedule_real --measured bench/results/schedule-measured-cpu-small.json` prints
# them ("suite") and the machine below
CPU_SHORT = Suite("short", 1.0, 2.87, 0.332, 44.2, 324.4, 0.362, 0.562, trained_share=0.119)

CPU_SMALL = Preset(
    name="cpu-small",
    steps=48,
    groups_per_step=8,
    group_size=2,
    suites=(CPU_SHORT,),
    deadline_s=120,
    segments=3,
    cluster=Cluster(cells=4, devices_per_cell=1, shared_cores=None),  # partitioned: a quarter core each
    engine=EngineModel(
        sessions_per_cell=2,
        latency_fixed_s=0.0262,
        latency_per_seq_s=0.00524,
        latency_per_ctx_token_s=0.0,
        max_context=32768,
        kv_bytes_per_token=4096,
        migrate_bytes_per_s=1e9,
    ),
    trainer=TrainerModel(tokens_per_s=954, update_s=1.47),
    to_train_s=3.70,
    to_rollout_s=0.06,
    tick_s=0.25,
    elastic={"min_dwell_s": 2.0, "gain_factor": 0.0, "lend_core": True},
    async_splits=(1, 2),
)

CPU_SMALL_TAIL = Preset(
    **{
        **CPU_SMALL.__dict__,
        "name": "cpu-small-tail",
        "deadline_s": 40,
        "suites": (
            replace(CPU_SHORT, weight=5 / 6),
            replace(CPU_SHORT, name="long", weight=1 / 6, turns_median=55),
        ),
    }
)

PRESETS = {p.name: p for p in (PAPER_FLAGSHIP, CPU_SMALL, CPU_SMALL_TAIL)}


def with_settings(preset: Preset, settings: list[str]) -> Preset:
    """`preset` with `key=value` settings applied: a field (`steps=8`), a field of a part
    (`cluster.cells=512`, `engine.sessions_per_cell=4`, `trainer.tokens_per_s=8000`,
    `trainer.min_cells=4`, `engine.device_memory_gb=141`), a field of one suite or of every suite
    (`suites.swe.turns_median=300`, `suites.*.gap_sigma=2`), or an elastic policy setting
    (`elastic.min_dwell_s=300`, `elastic.lend_core=false`). Values are parsed as the field's type."""
    for setting in settings:
        key, sep, raw = setting.partition("=")
        if not sep:
            raise ValueError(f"--set {setting!r}: expected key=value (e.g. cluster.cells=512)")
        head, _, leaf = key.partition(".")
        if head == "elastic" and leaf:
            flag = {"true": True, "false": False}.get(raw.lower())  # elastic.lend_core=false
            preset = replace(preset, elastic={**preset.elastic, leaf: float(raw) if flag is None else flag})
            continue
        if head == "suites" and leaf:
            preset = replace(preset, suites=_set_suites(preset, key, leaf, raw))
            continue
        if head not in {f.name for f in fields(preset)}:
            raise ValueError(f"--set {key}: {preset.name} has no field {head!r}")
        current = getattr(preset, head)
        if leaf:
            if not is_dataclass(current) or leaf not in {f.name for f in fields(current)}:
                raise ValueError(f"--set {key}: {head} has no field {leaf!r}")
            value = _parse(raw, getattr(current, leaf), key)
            preset = replace(preset, **{head: replace(current, **{leaf: value})})
        else:
            preset = replace(preset, **{head: _parse(raw, current, key)})
    return preset


def _set_suites(preset: Preset, key: str, leaf: str, raw: str) -> tuple[Suite, ...]:
    """`suites.NAME.FIELD=value` (one suite) or `suites.*.FIELD=value` (every suite)."""
    name, _, attr = leaf.partition(".")
    names = [s.name for s in preset.suites]
    if name != "*" and name not in names:
        raise ValueError(
            f"--set {key}: {preset.name} has no suite {name!r} (its suites: {', '.join(names)}, or *)"
        )
    if attr not in {f.name for f in fields(Suite)}:
        raise ValueError(f"--set {key}: a suite has no field {attr!r}")
    return tuple(
        replace(s, **{attr: _parse(raw, getattr(s, attr), key)}) if name in ("*", s.name) else s
        for s in preset.suites
    )


def _parse(raw: str, current: object, key: str) -> object:
    try:
        if isinstance(current, bool):
            return raw.lower() in {"1", "true", "yes"}
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float) or current is None:
            return float(raw)
        if isinstance(current, str):
            return raw
    except ValueError:
        raise ValueError(f"--set {key}={raw}: not a {type(current).__name__}") from None
    if isinstance(current, tuple):
        return tuple(int(x) for x in raw.split(","))
    raise ValueError(f"--set {key}: its value ({type(current).__name__}) cannot be set from the command line")
