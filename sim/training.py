"""The training side of the simulation: a fluid model of micro-batches and the optimizer update.

`TrainingModel` is mixed into sim/run.py's `Simulation` and works on its state: a group's tokens join
its step's backlog when its last execution finishes (sim/rollout.py); the ready train cells of the
moment drain the oldest untrained step's backlog at `train_rate` each (offloading below the model's
minimum footprint); the update follows once the step's batch is complete and trained, and publishes
version step + 1. On shared cores (CPU presets) the training and the update slow down with the cells
that decode. Events it pushes are sim/events.py's TRAIN_DRAINED and UPDATE_DONE.
"""

from __future__ import annotations

from sim.events import TRAIN_DRAINED, UPDATE_DONE


class TrainingModel:
    """The training streams of a `Simulation` (sim/run.py), which holds the state these read."""

    def _train_cells(self) -> float:
        """Ready train cells, in full-rate cells: below the model's minimum footprint they offload
        and train at `offload_efficiency` of their rate."""
        if self.ready_train >= self.p.trainer.min_cells:
            return self.ready_train
        return self.ready_train * self.p.trainer.offload_efficiency

    def _training(self) -> bool:
        return self.version < self.p.steps and (self.updating or self.steps.backlog[self.version] > 0)

    def _advance_training(self) -> None:
        """Trains the oldest untrained step's backlog from the last mark to now (and, on shared
        cores, counts the core-seconds used since the mark: nothing changed in between)."""
        dt = self.now - self.train_mark
        self.train_mark = self.now
        if dt > 0 and self.p.cluster.shared_cores is not None:
            self.tally.core_busy_s += dt * min(self.p.cluster.shared_cores, self._demand())
        if dt <= 0 or not self._training():
            return
        cells = self.ready_train if self.updating else self._train_cells()
        self.tally.busy_s["train"] += cells * dt
        if self.updating:
            self.update_left -= dt * self._speed()
        else:
            rate = cells * self.train_rate * self._speed()
            self.steps.backlog[self.version] = max(0.0, self.steps.backlog[self.version] - rate * dt)

    def _training_changed(self) -> None:
        """Reschedules the drain of the backlog, or starts the update once the batch is done."""
        self._advance_training()
        if self.version >= self.p.steps:
            return
        if self.updating:
            if self.p.cluster.shared_cores is not None:  # its speed may have changed since it started
                self.train_gen += 1
                self._push(
                    self.now + max(self.update_left, 0.0) / self._speed(), UPDATE_DONE, None, self.train_gen
                )
            return
        self.train_gen += 1
        backlog = self.steps.backlog[self.version]
        if backlog > 1e-6:
            rate = self._train_cells() * self.train_rate * self._speed()
            if rate > 0:
                self._push(self.now + backlog / rate, TRAIN_DRAINED, self.train_gen)
        elif self.steps.finished_groups[self.version] == self.p.groups_per_step:
            self.steps.backlog[self.version] = 0.0
            # on shared cores the update is CPU work like any other: it slows while engines decode
            self.updating, self.update_left = True, self.p.trainer.update_s
            self._push(self.now + self.update_left / self._speed(), UPDATE_DONE, None, self.train_gen)

    def _update_done(self) -> None:
        self._advance_training()
        if self.p.cluster.shared_cores is not None and self.update_left > 1e-6 * self.p.trainer.update_s:
            # slowed down since it was scheduled: not done yet
            self._training_changed()
            return
        self.updating = False
        self.version += 1
        if self.version == self.p.steps:
            self.makespan = self.now
            return
        self._training_changed()
