"""`rollover simulate`: a discrete-event capacity planner for the async rollout window.

`distributions` (rollout durations), `ideal` (the closed-form bound), `world` (the simulated
backend, gateway, update and weight sync), `planner` (one simulation, a sweep, the
recommendation) and `cli` (the command).

It runs the real `Trainer` — staleness cap, window top-up, `AsyncRolloutManager`, carry-over,
pause/drain, update, weight sync — in virtual time. Only the outside world is simulated:
`SimulatedBackend` plays the rollouts, `SimulatedGateway` the few gateway calls the trainer
makes, and the policy update and weight sync just move the virtual clock. So the numbers come
from the scheduling code a real run executes, not from a model of it.

The model, stated once:

- Every rollout needs `duration` seconds of *active* time, drawn (seeded) from a distribution:
  parametric, or durations measured in an earlier run.
- At most `capacity` rollouts run at once (agents, or what the engine serves at full speed);
  the rest wait in a FIFO queue. The default is `batch_size * n`, what a synchronous step keeps
  busy, so a bigger window can only win through duration variance, not extra parallelism.
- `pause_freezes_rollouts` (default on): while the trainer updates and syncs weights, running
  rollouts make no progress, because a collocated engine serves nothing then and every agent
  stalls at its next model call. Switch it off for an engine that keeps serving during updates.
- A pause drains in `drain_seconds` when any rollout is running (rollouts progress while it
  drains), instantly otherwise.
- A rollout's tokens carry the policy version it started under; the version lag counts from it.

Measured durations include any time a rollout spent frozen by a pause, so durations from an
async run overstate the active time somewhat; durations from a sync run do not.
"""

from rollover.simulate.distributions import (
    Constant,
    Distribution,
    Empirical,
    Exponential,
    LogNormal,
    Pareto,
    load_durations,
)
from rollover.simulate.ideal import IdealSteps, ideal_step_seconds
from rollover.simulate.planner import (
    DEFAULT_WINDOWS,
    Scenario,
    Simulation,
    SimulationResult,
    recommend,
    simulate,
    sweep,
    window_sizes,
)

__all__ = [
    "DEFAULT_WINDOWS",
    "Constant",
    "Distribution",
    "Empirical",
    "Exponential",
    "IdealSteps",
    "LogNormal",
    "Pareto",
    "Scenario",
    "Simulation",
    "SimulationResult",
    "ideal_step_seconds",
    "load_durations",
    "recommend",
    "simulate",
    "sweep",
    "window_sizes",
]
